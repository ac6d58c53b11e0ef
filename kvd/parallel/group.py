"""One process group of the current rank, and the collectives run over it (worker process).

A thin layer over torch.distributed: it owns no layout logic (that is `ranks.py`) and no
module state (that is `state.py`). `src` and `dst` arguments are ranks *within the group*;
they are mapped to global ranks here so callers never mix the two numberings.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .ranks import GroupKind


@dataclass(frozen=True, slots=True)
class ParallelGroup:
    """The group of one kind that holds this process, as created by ParallelState."""

    kind: GroupKind
    ranks: tuple[int, ...]  # global ranks, ascending; position = rank within the group
    rank_in_group: int  # this process's position in `ranks`
    process_group: dist.ProcessGroup  # what torch.distributed calls take as `group=`

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == len(self.ranks) - 1

    def global_rank(self, group_rank: int) -> int:
        if not 0 <= group_rank < len(self.ranks):
            raise ValueError(f"rank {group_rank} is outside the {self.kind} group of size {len(self.ranks)}")
        return self.ranks[group_rank]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the group, as a new tensor; `x` itself is left untouched.

        With one rank `x` itself is returned (no copy), as vLLM does.
        """
        if self.world_size == 1:
            return x
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=self.process_group)
        return out

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim` in group-rank order (a new tensor)."""
        dim = _normalize_dim(x, dim)
        if self.world_size == 1:
            return x
        src = x.contiguous()
        parts = [torch.empty_like(src) for _ in range(self.world_size)]
        # list-form all_gather: gloo lacks all_gather_into_tensor, and cat handles any dim
        dist.all_gather(parts, src, group=self.process_group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `x` in place with group rank `src`'s tensor and return it.

        Every rank must pass a tensor of the same shape and dtype.
        """
        root = self.global_rank(src)
        if self.world_size == 1:
            return x
        dist.broadcast(x, src=root, group=self.process_group)
        return x

    def gather(self, x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Every rank's `x` concatenated along `dim` on group rank `dst`; None on the others."""
        dim = _normalize_dim(x, dim)
        root = self.global_rank(dst)
        if self.world_size == 1:
            return x
        src = x.contiguous()
        parts = [torch.empty_like(src) for _ in range(self.world_size)] if self.rank_in_group == dst else None
        dist.gather(src, gather_list=parts, dst=root, group=self.process_group)
        return torch.cat(parts, dim=dim) if parts is not None else None


def _normalize_dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} out of range for a tensor of {x.dim()} dims")
    return dim % x.dim()
