"""Tensor/pipeline/data/expert parallelism: rank layouts, process groups, KV shard mapping (worker
process: the inference workers import it; the daemon never does).

- `ranks`: pure rank layout (which global ranks form each group), vLLM's convention.
- `sharding`: pure KV-cache shard mapping between TP/PP layouts (KVLayout, plan_reshard).
- `readers`: pure; which source shards a reshard sends (one per replicated head group) and
  which destination ranks read each.
- `group`, `state`: the torch.distributed groups of this process and the TP collectives.

The daemon never imports torch, yet it validates a KVLayout from an entry's meta; so
`ranks` and `sharding` import without torch (sharding's tensor helpers import it when
called), and the torch.distributed half is loaded here on first attribute access.
"""
from __future__ import annotations

import importlib
from typing import Any

from .kv_layout import KVLayout, ShardPiece, assemble, plan_reshard, shard_layouts, slice_shard
from .ranks import GROUP_KINDS, GroupKind, RankLayout, rank_layout
from .readers import is_primary, primary_shards, read_plans, readers

_LAZY = {
    "ParallelGroup": "group",
    **{name: "state" for name in (
        "ParallelState", "ParallelStateError", "current_state", "destroy_parallel_state", "is_initialized",
        "get_tp_group", "get_tp_rank", "get_tp_world_size", "get_pp_group", "get_pp_rank", "get_pp_world_size",
        "get_dp_group", "get_dp_rank", "get_dp_world_size", "get_ep_group", "get_ep_rank", "get_ep_world_size",
        "tensor_model_parallel_all_reduce", "tensor_model_parallel_all_gather",
        "tensor_model_parallel_broadcast", "tensor_model_parallel_gather",
    )},
}

__all__ = [
    "GROUP_KINDS", "GroupKind", "KVLayout", "RankLayout", "ShardPiece", "assemble", "is_primary", "plan_reshard",
    "primary_shards", "rank_layout", "read_plans", "readers", "shard_layouts", "slice_shard", *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
