"""Which global ranks form each tensor-, pipeline-, data- and expert-parallel group (pure: any process).

Pure functions, no torch.distributed: `kvd.parallel.state` turns a RankLayout into
process groups, and tests check every layout without starting a process.

The convention is vLLM's (vllm/distributed/parallel_state.py, initialize_model_parallel):
ranks are laid out as an array [dp, pp, tp] with tp varying fastest, so

    global rank = (dp_idx * pp + pp_idx) * tp + tp_idx

- a TP group is one (dp_idx, pp_idx): tp contiguous ranks;
- a PP group is one (dp_idx, tp_idx): pp ranks with stride tp;
- a DP group is one (pp_idx, tp_idx): dp ranks with stride pp * tp;
- EP groups live inside one pp stage: that stage's dp * tp ranks, flattened with dp
  outer and tp inner, cut into consecutive runs of `ep` ranks. vLLM's expert-parallel
  layout is ep = dp * tp (one EP group per stage); ep = 1 means no expert parallelism.

Groups are listed in vLLM's creation order and each group's ranks are ascending, which is
also the order torch.distributed.new_group numbers them, so a rank's position in its tuple
is its rank within the group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GroupKind = Literal["tp", "pp", "dp", "ep"]
Group = tuple[int, ...]  # global ranks, ascending
GROUP_KINDS: tuple[GroupKind, ...] = ("tp", "pp", "dp", "ep")


@dataclass(frozen=True, slots=True)
class RankLayout:
    """Every parallel group of one world; build it with `rank_layout`."""

    world_size: int
    tp: int
    pp: int
    dp: int
    ep: int
    tp_groups: tuple[Group, ...]
    pp_groups: tuple[Group, ...]
    dp_groups: tuple[Group, ...]
    ep_groups: tuple[Group, ...]

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_idx, pp_idx, tp_idx) of a global rank."""
        self._check_rank(rank)
        rest, tp_idx = divmod(rank, self.tp)
        dp_idx, pp_idx = divmod(rest, self.pp)
        return dp_idx, pp_idx, tp_idx

    def rank_of(self, dp_idx: int, pp_idx: int, tp_idx: int) -> int:
        """Inverse of `coords`."""
        for name, idx, size in (("dp", dp_idx, self.dp), ("pp", pp_idx, self.pp), ("tp", tp_idx, self.tp)):
            if not 0 <= idx < size:
                raise ValueError(f"{name} index {idx} out of range for {name} size {size}")
        return (dp_idx * self.pp + pp_idx) * self.tp + tp_idx

    def groups(self, kind: GroupKind) -> tuple[Group, ...]:
        """All groups of one kind, in the order every rank must create them."""
        match kind:
            case "tp":
                return self.tp_groups
            case "pp":
                return self.pp_groups
            case "dp":
                return self.dp_groups
            case "ep":
                return self.ep_groups
        raise ValueError(f"unknown group kind {kind!r}; expected one of {GROUP_KINDS}")

    def group_of(self, kind: GroupKind, rank: int) -> Group:
        """The group of that kind holding `rank` (each rank is in exactly one)."""
        self._check_rank(rank)
        for group in self.groups(kind):
            if rank in group:
                return group
        raise AssertionError(f"rank {rank} is in no {kind} group")  # unreachable: rank_layout covers all

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")


def _check_size(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def rank_layout(
    world_size: int,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    data_parallel_size: int = 1,
    expert_parallel_size: int | None = 1,
) -> RankLayout:
    """Lay out `world_size` ranks as [dp, pp, tp]; expert_parallel_size None means dp * tp.

    Raises ValueError unless every size is a positive int, world_size == tp * pp * dp,
    and ep divides dp * tp.
    """
    world = _check_size("world_size", world_size)
    tp = _check_size("tensor_parallel_size", tensor_parallel_size)
    pp = _check_size("pipeline_parallel_size", pipeline_parallel_size)
    dp = _check_size("data_parallel_size", data_parallel_size)
    if world % (tp * pp):
        raise ValueError(
            f"world size {world} is not divisible by tensor_parallel_size * pipeline_parallel_size"
            f" = {tp} * {pp} = {tp * pp}"
        )
    if world != tp * pp * dp:
        # no implicit outer replica dimension: a mismatch is almost always a config mistake
        raise ValueError(
            f"world size {world} != tp * pp * dp = {tp} * {pp} * {dp} = {tp * pp * dp}"
            f" (data_parallel_size={world // (tp * pp)} would fit)"
        )
    ep = dp * tp if expert_parallel_size is None else _check_size("expert_parallel_size", expert_parallel_size)
    if (dp * tp) % ep:
        raise ValueError(
            f"expert_parallel_size {ep} must divide data_parallel_size * tensor_parallel_size = {dp * tp}"
        )

    def rank(d: int, p: int, t: int) -> int:
        return (d * pp + p) * tp + t

    tp_groups = tuple(tuple(rank(d, p, t) for t in range(tp)) for d in range(dp) for p in range(pp))
    pp_groups = tuple(tuple(rank(d, p, t) for p in range(pp)) for d in range(dp) for t in range(tp))
    # vLLM builds DP groups from all_ranks.transpose(1, 3): tp_idx outer, pp_idx inner
    dp_groups = tuple(tuple(rank(d, p, t) for d in range(dp)) for t in range(tp) for p in range(pp))
    ep_groups: list[Group] = []
    for p in range(pp):
        stage = [rank(d, p, t) for d in range(dp) for t in range(tp)]
        ep_groups += [tuple(stage[i:i + ep]) for i in range(0, len(stage), ep)]
    return RankLayout(world, tp, pp, dp, ep, tp_groups, pp_groups, dp_groups, tuple(ep_groups))
