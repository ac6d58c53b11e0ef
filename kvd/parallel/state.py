"""The worker process's parallel state: its TP/PP/DP/EP groups, and the module-level accessors.

Modelled on vLLM's vllm/distributed/parallel_state.py, much smaller. `ranks.py` decides
which ranks form each group; this module only creates the torch.distributed groups and
guards the one process-wide current state (initialize once, destroy() to tear down and
allow a fresh initialize, which tests rely on). It does not initialize torch.distributed
itself: the caller owns the default process group and must destroy it after us.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .group import ParallelGroup
from .ranks import GROUP_KINDS, GroupKind, RankLayout, rank_layout

logger = logging.getLogger(__name__)


class ParallelStateError(RuntimeError):
    """The parallel state was used in the wrong lifecycle phase (never crosses the wire)."""


_current: ParallelState | None = None


class ParallelState:
    """The groups holding this rank. Not thread-safe: initialize and destroy from one thread."""

    def __init__(self) -> None:
        self.layout: RankLayout | None = None
        self._groups: dict[GroupKind, ParallelGroup] = {}

    @property
    def initialized(self) -> bool:
        return self.layout is not None

    def initialize(
        self,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int = 1,
        expert_parallel_size: int | None = 1,
        backend: str | None = None,
    ) -> None:
        """Create every group and install this state as the process's current one.

        Collective: every rank of the default group must call it with the same arguments,
        since torch.distributed.new_group must be called by all ranks for every group, in
        the same order. backend None means the default group's backend (gloo on CPU, nccl
        on CUDA). expert_parallel_size None means dp * tp, vLLM's expert-parallel layout.
        """
        global _current
        if self.initialized:
            raise ParallelStateError("this ParallelState is already initialized; call destroy() first")
        if _current is not None:
            raise ParallelStateError(
                "a parallel state is already initialized in this process; call destroy_parallel_state() first"
            )
        if not (dist.is_available() and dist.is_initialized()):
            raise ParallelStateError(
                "torch.distributed is not initialized; call torch.distributed.init_process_group() first"
            )
        world, me = dist.get_world_size(), dist.get_rank()
        layout = rank_layout(world, tensor_parallel_size, pipeline_parallel_size, data_parallel_size,
                             expert_parallel_size)
        backend = backend or dist.get_backend()
        groups: dict[GroupKind, ParallelGroup] = {}
        try:
            for kind in GROUP_KINDS:
                for ranks in layout.groups(kind):
                    pg = dist.new_group(list(ranks), backend=backend)  # every rank, every group
                    if me in ranks:
                        groups[kind] = ParallelGroup(kind, ranks, ranks.index(me), pg)
        except BaseException:
            _destroy_groups(groups)
            raise
        self.layout, self._groups, _current = layout, groups, self
        logger.info("parallel state: rank %d of %d, tp=%d pp=%d dp=%d ep=%d, backend %s",
                    me, world, layout.tp, layout.pp, layout.dp, layout.ep, backend)

    def destroy(self) -> None:
        """Destroy this state's groups and uninstall it; a no-op when not initialized.

        Local, not collective: torch's destroy_process_group of a subgroup only shuts down
        this rank's end, so ranks need not call it in step.
        """
        global _current
        groups, self._groups, self.layout = self._groups, {}, None
        if _current is self:
            _current = None
        _destroy_groups(groups)

    def group(self, kind: GroupKind) -> ParallelGroup:
        if not self.initialized:
            raise ParallelStateError(f"{kind} group requested before ParallelState.initialize()")
        return self._groups[kind]

    @property
    def tp(self) -> ParallelGroup:
        return self.group("tp")

    @property
    def pp(self) -> ParallelGroup:
        return self.group("pp")

    @property
    def dp(self) -> ParallelGroup:
        return self.group("dp")

    @property
    def ep(self) -> ParallelGroup:
        return self.group("ep")


def _destroy_groups(groups: dict[GroupKind, ParallelGroup]) -> None:
    if not dist.is_initialized():
        return  # the default group went first; torch already dropped every subgroup
    for group in groups.values():
        dist.destroy_process_group(group.process_group)


def current_state() -> ParallelState:
    if _current is None:
        raise ParallelStateError("parallel state is not initialized; call ParallelState().initialize() first")
    return _current


def is_initialized() -> bool:
    return _current is not None


def destroy_parallel_state() -> None:
    """Tear down the current state, if any (safe to call twice)."""
    if _current is not None:
        _current.destroy()


def get_tp_group() -> ParallelGroup:
    return current_state().tp


def get_pp_group() -> ParallelGroup:
    return current_state().pp


def get_dp_group() -> ParallelGroup:
    return current_state().dp


def get_ep_group() -> ParallelGroup:
    return current_state().ep


def get_tp_rank() -> int:
    return get_tp_group().rank_in_group


def get_tp_world_size() -> int:
    return get_tp_group().world_size


def get_pp_rank() -> int:
    return get_pp_group().rank_in_group


def get_pp_world_size() -> int:
    return get_pp_group().world_size


def get_dp_rank() -> int:
    return get_dp_group().rank_in_group


def get_dp_world_size() -> int:
    return get_dp_group().world_size


def get_ep_rank() -> int:
    return get_ep_group().rank_in_group


def get_ep_world_size() -> int:
    return get_ep_group().world_size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group; see ParallelGroup.all_reduce."""
    return get_tp_group().all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenation over the TP group along `dim` (negative dims allowed)."""
    return get_tp_group().all_gather(x, dim)


def tensor_model_parallel_broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """In-place broadcast from TP-group rank `src`."""
    return get_tp_group().broadcast(x, src)


def tensor_model_parallel_gather(x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
    """Concatenation along `dim` on TP-group rank `dst`, None elsewhere."""
    return get_tp_group().gather(x, dst, dim)
