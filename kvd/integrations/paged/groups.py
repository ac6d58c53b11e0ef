"""KV cache groups of a paged cache: which blocks of a request each group keeps, and which rows of
a producer's entry fill a consumer's blocks (engine worker and scheduler processes; pure: no I/O,
no engine import).

A hybrid model keeps one block table per group of layers (vLLM's hybrid KV cache manager): full
attention holds every block of the prompt; a sliding-window group only the blocks inside the
window of the next token (the ones before are freed, their table slots null); a chunked-local
group only the current chunk's; a Mamba (or linear-attention) group one block holding the state
after the tokens computed so far. `KVGroup.kept_blocks` says, for a request whose first n tokens
are computed, which block range [first, stop) of its table a group keeps: exactly what the
consumer's manager allocates for n loaded tokens, so exactly what a producer hands over.

An entry holds, for each layer, the rows of its group's range in order; its meta gives each
group's first block (`first_blocks`). A consumer fills, per group, its blocks
[first_block, stop) (the ones before are a local prefix-cache hit, or null) from rows
[first_block - producer_first, stop - producer_first) of the producer's tensors (`GroupRead`).

Groups are matched between producer and consumer by layer name (both are the same model), and
must agree on kind, window and block size; a Mamba state is only the state at exactly the
number of tokens loaded.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from ...errors import BadRequest, LayoutMismatch

FULL = "full_attention"
SLIDING = "sliding_window"
CHUNKED = "chunked_local_attention"
MAMBA = "mamba"  # Mamba and linear-attention state (vLLM's MambaSpec): one block per request
KINDS = (FULL, SLIDING, CHUNKED, MAMBA)
WINDOWED = (SLIDING, CHUNKED)

Blocks = tuple[list[int], ...]  # a request's block table, per group


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks hold num_tokens tokens."""
    return math.ceil(num_tokens / block_size)


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: its layers share one block table."""

    kind: str  # one of KINDS
    block_size: int  # tokens per block (a Mamba group's block is a whole request's state)
    layers: tuple[str, ...]  # the engine's layer names, as registered (a stage's own, with PP)
    window: int | None = None  # SLIDING: tokens a query attends back (itself included); CHUNKED: chunk size

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise BadRequest(f"KV cache group kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise BadRequest(f"KV cache group block size must be a positive int, got {self.block_size!r}")
        if (self.kind in WINDOWED) != (isinstance(self.window, int) and self.window >= 1):
            raise BadRequest(f"a {self.kind} group {'needs' if self.kind in WINDOWED else 'has no'} a window "
                             f"(got {self.window!r})")
        if not isinstance(self.layers, tuple) or not all(isinstance(n, str) for n in self.layers):
            raise BadRequest("a KV cache group's layers are a tuple of layer names")

    @property
    def label(self) -> str:
        """The kind, with its window: "sliding_window(64)"."""
        return f"{self.kind}({self.window})" if self.window else self.kind

    def skipped_tokens(self, num_tokens: int) -> int:
        """Tokens the next query (token num_tokens) no longer attends to (vLLM's
        get_num_skipped_tokens): their blocks are freed."""
        if self.window is None:  # (full attention, Mamba: a window only for the two kinds below)
            return 0
        if self.kind == SLIDING:
            return max(0, num_tokens - self.window + 1)
        if self.kind == CHUNKED:
            return num_tokens // self.window * self.window
        return 0

    def kept_blocks(self, num_tokens: int) -> tuple[int, int]:
        """The block range [first, stop) of a request's table this group keeps once its first
        num_tokens tokens are computed (stop: the blocks that hold them)."""
        stop = blocks_for(num_tokens, self.block_size)
        if self.kind == MAMBA:
            return max(0, stop - 1), stop  # the state after num_tokens: the last block
        return min(self.skipped_tokens(num_tokens) // self.block_size, stop), stop

    def same_cache(self, other: KVGroup) -> bool:
        return (self.kind, self.block_size, self.window) == (other.kind, other.block_size, other.window)

    def to_wire(self) -> list[Any]:
        return [self.kind, self.block_size, self.window, list(self.layers)]

    @classmethod
    def from_wire(cls, raw: Any) -> KVGroup:
        try:
            kind, block_size, window, layers = raw
            return cls(str(kind), int(block_size), tuple(str(name) for name in layers),
                       None if window is None else int(window))
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"not a KV cache group: {raw!r:.120} ({exc})") from None


def check_groups(groups: Sequence[KVGroup], layers: Sequence[str]) -> None:
    """Every layer in exactly one group, and no group naming a layer that is not there."""
    seen: dict[str, int] = {}
    for index, group in enumerate(groups):
        for name in group.layers:
            if name in seen:
                raise BadRequest(f"layer {name!r} is in KV cache groups {seen[name]} and {index}")
            seen[name] = index
    if set(seen) != set(layers):
        missing, extra = sorted(set(layers) - set(seen)), sorted(set(seen) - set(layers))
        raise BadRequest(f"KV cache groups do not cover the layers: missing {missing[:3]}, unknown {extra[:3]}")


def per_group(value: int | Sequence[int], groups: int, what: str) -> tuple[int, ...]:
    """An int for every group, or one per group."""
    if isinstance(value, int):
        return (value,) * groups
    try:
        values = tuple(int(v) for v in value) or (0,) * groups
    except (TypeError, ValueError):
        raise BadRequest(f"{what}: not a list of block numbers: {value!r:.80}") from None
    if len(values) != groups:
        raise BadRequest(f"{what}: {len(values)} values for {groups} KV cache groups")
    return values


def as_tables(block_ids: Sequence[int] | Sequence[Sequence[int]]) -> Blocks:
    """Per-group block tables; a flat list of block ids is the table of a model's one group."""
    if len(block_ids) and all(isinstance(b, int) for b in block_ids):
        return (list(cast("Sequence[int]", block_ids)),)
    return tuple(list(table) for table in cast("Sequence[Sequence[int]]", block_ids)) or ([],)


@dataclass(frozen=True)
class GroupRead:
    """One consumer group's copy: rows [rows[0], rows[1]) of each of its layers in the producer's
    entry, into blocks `block_ids` of the consumer's caches."""

    group: int  # the consumer's group index
    layers: tuple[str, ...]
    rows: tuple[int, int]
    block_ids: tuple[int, ...]


def group_reads(groups: Sequence[KVGroup], tables: Blocks, first_blocks: Sequence[int],
                num_tokens: int) -> list[GroupRead]:
    """What a consumer copies, group by group, to fill blocks [first_blocks[g], len(tables[g])) of
    each group's table, from an entry whose producer computed num_tokens tokens and saved each
    group's kept range (`producer_first` below, checked by `check_entry_blocks`). Groups with
    nothing to fill are left out."""
    reads = []
    for index, (group, table, first) in enumerate(zip(groups, tables, first_blocks, strict=True)):
        if first >= len(table):
            continue
        start = group.kept_blocks(num_tokens)[0]
        if first < start:
            raise LayoutMismatch(f"KV cache group {index} ({group.label}): blocks from {first} are asked for, "
                                 f"the group keeps blocks from {start} for {num_tokens} tokens")
        reads.append(GroupRead(index, group.layers, (first - start, len(table) - start), tuple(table[first:])))
    return reads


def check_entry_blocks(mine: Sequence[KVGroup], reads: Sequence[GroupRead], num_tokens: int,
                       theirs: Sequence[KVGroup], their_first: Sequence[int], their_tokens: int,
                       layers: Sequence[str]) -> list[str]:
    """Why a producer's entry (its groups, each group's first block, the tokens it computed)
    cannot give `reads` (planned by `group_reads` for num_tokens) of `layers`, the ones this
    consumer copies from it: messages naming the field, [] when it can. Groups are matched to
    ours by layer; a layer the producer does not hold, or holds in another kind of group, is
    `layout.check_source`'s to report."""
    theirs_of = {name: (index, group) for index, group in enumerate(theirs) for name in group.layers}
    wanted = set(layers)
    problems: list[str] = []
    for read in reads:
        group = mine[read.group]
        start = group.kept_blocks(num_tokens)[0]
        for name in read.layers:
            if name not in wanted or name not in theirs_of:
                continue
            index, _ = theirs_of[name]  # (of the same kind, window and block size: `check_source`)
            if group.kind == MAMBA and their_tokens != num_tokens:
                problems.append(f"layer {name}: a {MAMBA} state after {their_tokens} tokens, {num_tokens} are loaded")
            elif their_first[index] != start:
                problems.append(f"layer {name}: producer blocks from {their_first[index]}, the consumer's "
                                f"{group.label} group keeps blocks from {start} for {num_tokens} tokens")
            if len(problems) > 4:
                return problems
    return problems
