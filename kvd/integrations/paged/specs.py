"""What a paged KV worker is told to move and what it reports back (engine worker and scheduler
processes; pure dataclasses, no I/O): a request to save (`SaveSpec`) or load (`LoadSpec`), the
step's results and the worker's counters. The scheduler side of a connector builds the specs;
`handoff.PagedKVWorker` carries them out.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from ...client.reshard import shard_key
from .groups import Blocks, as_tables, per_group
from .plans import SourceDeployment

META_KEY = "paged_kv"


def entry_key(request_key: str, tp_rank: int, pp_rank: int = 0) -> str:
    """The entry of one producer rank's shard of a request."""
    return shard_key(request_key, tp_rank, pp_rank)


@dataclass
class SaveSpec:
    """Hand off the first num_tokens of a request whose prompt completes in this step: per KV cache
    group, the request's blocks holding them (a flat list: a model's one group) and the first one
    that moves (the blocks before it are outside a window: decode keeps none of them)."""

    req_id: str
    request_key: str
    block_ids: Blocks  # per group: the request's block table for num_tokens tokens
    num_tokens: int
    dest: str | None = None  # the daemon to push to; None: kept on this node's daemon
    first_block: tuple[int, ...] = ()  # per group (() is 0 for each)

    def __post_init__(self) -> None:
        self.block_ids = as_tables(self.block_ids)
        self.first_block = per_group(self.first_block, len(self.block_ids), "first_block")


@dataclass
class LoadSpec:
    """Fill a request's blocks from the producer's entries: per KV cache group, blocks
    [first_block, len(block_ids)) of its table (the first ones are already computed here, a
    prefix-cache hit, or outside a window)."""

    req_id: str
    request_key: str
    block_ids: Blocks  # per group: the request's block table for num_tokens tokens (flat: one group)
    num_tokens: int
    first_block: int | tuple[int, ...] = 0  # per group (an int: the same for each)
    source: str | None = None  # the daemon to pull from; None: here (pushed), or wherever the registry says
    producer: SourceDeployment = field(default_factory=SourceDeployment)  # the producer's TP/PP
    directory: bool = False  # the producer listed its shards in a cluster registry (for the log)

    def __post_init__(self) -> None:
        self.block_ids = as_tables(self.block_ids)
        self.first_block = per_group(self.first_block, len(self.block_ids), "first_block")

    @property
    def first_blocks(self) -> tuple[int, ...]:
        """first_block per group (a tuple since construction)."""
        return cast(tuple[int, ...], self.first_block)

    def filled_blocks(self) -> set[int]:
        """The blocks a load writes, every group's."""
        return {b for table, first in zip(self.block_ids, self.first_blocks, strict=True) for b in table[first:]}


@dataclass
class TransferResults:
    finished_loads: set[str] = field(default_factory=set)
    failed_loads: set[str] = field(default_factory=set)
    failed_blocks: set[int] = field(default_factory=set)


@dataclass
class TransferStats:
    """What one worker moved since the last take: counters and each load's duration."""

    saves: int = 0
    save_failures: int = 0
    saved_bytes: int = 0
    loads: int = 0
    load_failures: int = 0
    loaded_bytes: int = 0
    load_seconds: list[float] = field(default_factory=list)
    # per forward step that saved: seconds the engine's thread spent in kvd (gathers and commits)
    save_seconds: list[float] = field(default_factory=list)
    saved_by_kind: dict[str, int] = field(default_factory=dict)  # saved_bytes by KV cache group kind
    loaded_by_kind: dict[str, int] = field(default_factory=dict)
    # prefix reuse through the KV tier (tier_worker.py): pages stored, hits loaded
    tier_saves: int = 0  # pages
    tier_save_failures: int = 0  # pages refused or lost with their daemon
    tier_saved_bytes: int = 0
    tier_loads: int = 0  # hits loaded whole
    tier_load_failures: int = 0  # hits that lost pages (their blocks are recomputed)
    tier_loaded_bytes: int = 0

    def count(self, by_kind: dict[str, int], kind: str, nbytes: int) -> None:
        by_kind[kind] = by_kind.get(kind, 0) + nbytes

    def empty(self) -> bool:
        # bytes count too: a step can save layers of a request whose save has not finished yet
        return not (self.saves or self.save_failures or self.saved_bytes or self.loads or self.load_failures
                    or self.loaded_bytes or self.tier_saves or self.tier_save_failures or self.tier_loads
                    or self.tier_load_failures)
