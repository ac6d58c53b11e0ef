"""Who reads which source shard when one deployment's KV cache is rebuilt in another (worker and
scheduler processes; pure, no I/O, no torch).

`plan_reshard` answers for one destination rank; a transfer also needs the view from the
sources: which source shards are worth sending at all, and how many destination ranks read
each one, so that the last reader (or whoever sees every reader finish) can release it.

- Replicated heads (TP > num_kv_heads, and MLA-style caches, modelled as one KV head that every
  rank holds) are sent once: only the *primary* holder of each head group, the first rank of
  its replica set, is a source. The other replicas hold the same bytes.
- `readers` maps every primary source shard to the destination ranks whose plan uses it.
"""
from __future__ import annotations

from collections.abc import Sequence

from .kv_layout import KVLayout, ShardPiece, plan_reshard

Rank = tuple[int, int]  # (tp_rank, pp_rank)


def is_primary(layout: KVLayout) -> bool:
    """Whether this shard is the first holder of its KV heads (replicas after it hold the same)."""
    return layout.tp_rank % layout.head_replicas == 0


def primary_shards(layouts: Sequence[KVLayout]) -> list[KVLayout]:
    """The shards worth sending: one holder per head group and pipeline stage."""
    return [s for s in layouts if is_primary(s)]


def read_plans(srcs: Sequence[KVLayout], dsts: Sequence[KVLayout]) -> dict[Rank, list[ShardPiece]]:
    """Each destination rank's plan, reading from the primary source shards only."""
    primaries = primary_shards(srcs)
    return {(d.tp_rank, d.pp_rank): plan_reshard(primaries, d) for d in dsts}


def readers(srcs: Sequence[KVLayout], dsts: Sequence[KVLayout]) -> dict[Rank, list[Rank]]:
    """Primary source shard -> the destination ranks that read it (in rank order; a source no
    destination needs is absent)."""
    out: dict[Rank, list[Rank]] = {}
    for dst, pieces in sorted(read_plans(srcs, dsts).items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for src in sorted({(p.src_tp_rank, p.src_pp_rank) for p in pieces}):
            out.setdefault(src, []).append(dst)
    return out
