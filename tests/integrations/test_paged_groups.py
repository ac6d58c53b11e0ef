"""kvd.integrations.paged.groups and the per-group side of paged.layout (pure: no vLLM, no daemons):
which blocks each kind of KV cache group keeps, and the per-group load plans applied to paged
caches cut from one full reference cache, over TP pairs: every consumer rank's blocks of every
group hold exactly their slice, nothing else is written; every refusal names its field."""
from __future__ import annotations

import itertools

import pytest
import torch

from kvd.errors import BadRequest, LayoutMismatch
from kvd.integrations.paged.groups import (
    CHUNKED,
    FULL,
    MAMBA,
    SLIDING,
    GroupRead,
    KVGroup,
    as_tables,
    blocks_for,
    check_entry_blocks,
    group_reads,
    per_group,
)
from kvd.integrations.paged.plans import PagedKVLayout, SourceDeployment, check_source, plan_loads
from kvd.parallel import KVLayout, shard_layouts

B = 4  # tokens per block
NUM_BLOCKS = 40


def name(i: int) -> str:
    return f"model.layers.{i}.attn"


def attended(kind: str, window: int | None, n: int) -> set[int]:
    """The tokens before n that the next query (token n) reads, by the kind's definition."""
    if kind == SLIDING:
        return set(range(max(0, n - window + 1), n))
    if kind == CHUNKED:
        return set(range(n // window * window, n))
    return set(range(n))


@pytest.mark.parametrize("kind, window", [(FULL, None), (SLIDING, 8), (SLIDING, 5), (CHUNKED, 8), (CHUNKED, 4)])
def test_kept_blocks_are_the_blocks_the_next_token_reads(kind, window):
    """For every prompt length: the kept range starts at the block of the first token the next query
    reads (vLLM frees the ones before), and ends with the blocks that hold the tokens."""
    group = KVGroup(kind, B, (name(0),), window)
    for n in range(1, 120):
        first, stop = group.kept_blocks(n)
        assert stop == blocks_for(n, B)
        needed = attended(kind, window, n)
        assert first == (min(needed) // B if needed else n // B), (n, first, needed)
        assert all(first <= t // B < stop for t in needed)


def test_a_state_keeps_its_last_block_and_kinds_are_checked():
    state = KVGroup(MAMBA, 1024, (name(0),))
    assert [state.kept_blocks(n) for n in (1, 99, 1024, 1025)] == [(0, 1), (0, 1), (0, 1), (1, 2)]
    for bad in [("linear", 4, None), (SLIDING, 4, None), (FULL, 4, 8), (FULL, 0, None)]:
        with pytest.raises(BadRequest):
            KVGroup(bad[0], bad[1], (name(0),), bad[2])
    group = KVGroup(SLIDING, B, (name(0), name(2)), 8)
    assert KVGroup.from_wire(group.to_wire()) == group and group.label == "sliding_window(8)"
    with pytest.raises(BadRequest):
        KVGroup.from_wire(["sliding_window", 4])


def test_tables_and_per_group_values():
    assert as_tables([3, 1, 2]) == ([3, 1, 2],) and as_tables(([1], [2, 3])) == ([1], [2, 3])
    assert per_group(2, 3, "x") == (2, 2, 2) and per_group((), 2, "x") == (0, 0) and per_group([1, 4], 2, "x") == (1, 4)
    with pytest.raises(BadRequest, match="first_block: 1 values for 2"):
        per_group([1], 2, "first_block")
    with pytest.raises(BadRequest):
        per_group(["a"], 1, "first_blocks")


def test_group_reads_map_each_group_onto_its_own_table():
    groups = [KVGroup(SLIDING, B, (name(0),), 8), KVGroup(FULL, B, (name(1),)), KVGroup(MAMBA, 64, (name(2),))]
    n = 21  # 6 blocks; the window (8) of token 21 starts at token 14: block 3
    tables = ([0, 0, 0, 17, 18, 19], [5, 6, 7, 8, 9, 10], [33])
    reads = group_reads(groups, tables, (3, 2, 0), n)  # blocks 0-1 of the full group hit a local cache
    assert reads == [GroupRead(0, (name(0),), (0, 3), (17, 18, 19)), GroupRead(1, (name(1),), (2, 6), (7, 8, 9, 10)),
                     GroupRead(2, (name(2),), (0, 1), (33,))]
    # a group with nothing left to fill is no read at all
    assert [r.group for r in group_reads(groups, tables, (6, 6, 1), n)] == []
    with pytest.raises(LayoutMismatch, match="keeps blocks from 3"):
        group_reads(groups, tables, (2, 0, 0), n)


def test_an_entry_must_hold_what_decode_keeps_for_the_tokens_it_loads():
    mine = [KVGroup(SLIDING, B, (name(0),), 8), KVGroup(MAMBA, 64, (name(1),))]
    reads = group_reads(mine, ([0, 0, 0, 17, 18, 19], [33]), (3, 0), 21)
    layers = [name(0), name(1)]
    assert check_entry_blocks(mine, reads, 21, mine, (3, 0), 21, layers) == []
    # a producer that kept every block (its hybrid manager off): its rows start elsewhere
    [problem] = check_entry_blocks(mine, reads, 21, mine, (0, 0), 21, [name(0)])
    assert "producer blocks from 0" in problem and "keeps blocks from 3" in problem
    # a state after other tokens than decode loads is another state
    [problem] = check_entry_blocks(mine, reads, 21, mine, (3, 0), 22, [name(1)])
    assert "mamba state after 22 tokens, 21 are loaded" in problem


# --- per-group load plans over TP pairs, applied to caches cut from one full cache -----------------

LAYERS = 4
WINDOW = 8
TP_PAIRS = [(1, 2), (2, 1), (1, 1), (2, 2), (2, 4), (4, 2)]


def groups_of(kind: str) -> tuple[KVGroup, ...]:
    """Layers 0, 2 of `kind`, layers 1, 3 full attention."""
    other = KVGroup(kind, 64 if kind == MAMBA else B, (name(0), name(2)),
                    WINDOW if kind in (SLIDING, CHUNKED) else None)
    return other, KVGroup(FULL, B, (name(1), name(3)))


def rank_layout(kv: KVLayout, groups: tuple[KVGroup, ...]) -> PagedKVLayout:
    h0, h1 = kv.head_range()
    state = {n for g in groups if g.kind == MAMBA for n in g.layers}
    fake = {name(i): torch.zeros((NUM_BLOCKS, 1, 1, 24) if name(i) in state else (NUM_BLOCKS, h1 - h0, B, 6))
            for i in range(LAYERS)}
    return PagedKVLayout.from_caches(fake, model="m", block_size=B, kv=kv, head_axis=0, groups=groups)


@pytest.mark.parametrize("kind", [SLIDING, CHUNKED])
def test_per_group_plans_rebuild_every_consumer_rank_exactly(kind):
    """The producer saves, per group, the kept blocks of its table; each consumer rank fills, per
    group, its own table's kept blocks with its heads of them: equal to the full cache's."""
    groups = groups_of(kind)
    model = KVLayout(num_layers=LAYERS, num_kv_heads=4, head_dim=6, dtype="float32")
    full = [torch.randn(NUM_BLOCKS, 4, B, 6) for _ in range(LAYERS)]
    n = 37  # 10 blocks of 4; the window of token 37 starts at 30 (block 7), its chunk at 32 (block 8)
    src_tables = ([0] * 10, [0] * 10)
    src_tables = tuple([20 + 2 * i + g for i in range(10)] for g in range(2))  # scattered, per group
    for (stp, dtp) in TP_PAIRS:
        src = SourceDeployment(stp)
        # what each producer rank's entry holds: per layer, the rows of its group's kept range
        entries = {}
        for s in shard_layouts(model, stp, 1):
            h0, h1 = s.head_range()
            layout = rank_layout(s, groups)
            rows = {}
            for group, table in zip(groups, src_tables):
                first, stop = group.kept_blocks(n)
                for layer in group.layers:
                    i = int(layer.split(".")[2])
                    rows[layer] = full[i][table[first:stop], h0:h1]
            entries[s.tp_rank] = (layout, rows, [g.kept_blocks(n)[0] for g in groups])
        for d in shard_layouts(model, dtp, 1):
            mine = rank_layout(d, groups)
            dst_tables = tuple([3 + 3 * i + g for i in range(10)] for g in range(2))
            first = tuple(g.kept_blocks(n)[0] for g in groups)
            reads = group_reads(groups, dst_tables, first, n)
            out = {name(i): torch.full((NUM_BLOCKS, d.head_range()[1] - d.head_range()[0], B, 6), float("nan"))
                   for i in range(LAYERS)}
            for read in plan_loads(mine, src):
                producer, rows, their_first = entries[read.src.tp_rank]
                check_source(mine, producer, read)
                names = [c[0] for c in read.copies]
                assert check_entry_blocks(groups, reads, n, producer.kv_groups, their_first, n, names) == []
                for group_read in reads:
                    for layer, src_head, dst_head, heads in read.copies:
                        if layer in group_read.layers:
                            a, b = group_read.rows
                            out[layer][list(group_read.block_ids), dst_head:dst_head + heads] = \
                                rows[layer][a:b, src_head:src_head + heads]
            h0, h1 = d.head_range()
            for g, (group, table) in enumerate(zip(groups, dst_tables)):
                f, stop = group.kept_blocks(n)
                for layer in group.layers:
                    i = int(layer.split(".")[2])
                    want = full[i][src_tables[g][f:stop], h0:h1]
                    assert torch.equal(out[layer][table[f:stop]], want), (kind, stp, dtp, layer)
                    untouched = [b for b in range(NUM_BLOCKS) if b not in table[f:stop]]
                    assert torch.isnan(out[layer][untouched]).all(), (kind, stp, dtp, layer)


def test_a_state_moves_between_equal_tp_sizes_whole_and_nowhere_else():
    groups = groups_of(MAMBA)
    model = KVLayout(num_layers=LAYERS, num_kv_heads=4, head_dim=6, dtype="float32")
    for stp, dtp in itertools.product((1, 2), repeat=2):
        for d in shard_layouts(model, dtp, 1):
            mine = rank_layout(d, groups)
            if stp != dtp:
                with pytest.raises(LayoutMismatch, match="tp_size: a mamba state moves between equal TP sizes"):
                    plan_loads(mine, SourceDeployment(stp))
                continue
            [read] = plan_loads(mine, SourceDeployment(stp))
            assert (read.src.tp_rank, read.readers) == (d.tp_rank, 1)
            copies = {c[0]: c for c in read.copies}
            assert copies[name(0)][3] == copies[name(2)][3] == 0  # whole rows: a state has no heads to cut
            assert copies[name(1)][3] == 4 // dtp
    # PP may differ: each stage's state layers come from whichever stage held them
    mine = rank_layout(model.with_shard(0, 1, 0, 1), groups)
    assert sorted(r.src.pp_rank for r in plan_loads(mine, SourceDeployment(1, 2))) == [0, 1]
    # replicated KV heads (TP above the heads): rank 1 would read rank 0's shard, another state
    replicated = KVLayout(num_layers=LAYERS, num_kv_heads=1, head_dim=6, dtype="float32")
    first, second = shard_layouts(replicated, 2, 1)
    assert [r.src.tp_rank for r in plan_loads(rank_layout(first, groups), SourceDeployment(2))] == [0]
    with pytest.raises(LayoutMismatch, match="unreplicated KV heads"):
        plan_loads(rank_layout(second, groups), SourceDeployment(2))


def test_the_layout_names_its_groups_and_refuses_another_kind_of_group():
    groups = groups_of(SLIDING)
    kv = KVLayout(num_layers=LAYERS, num_kv_heads=4, head_dim=6, dtype="float32")
    layout = rank_layout(kv, groups)
    assert PagedKVLayout.from_wire(layout.to_wire()) == layout
    assert layout.to_wire()["groups"][0] == [SLIDING, B, WINDOW, [name(0), name(2)]]
    # one full-attention group: no "groups" on the wire, as before groups existed
    plain = PagedKVLayout.from_caches({name(i): torch.zeros(NUM_BLOCKS, 4, B, 6) for i in range(LAYERS)},
                                      model="m", block_size=B, kv=kv)
    assert "groups" not in plain.to_wire() and plain.kv_groups == (KVGroup(FULL, B, tuple(map(name, range(4)))),)
    [read] = plan_loads(layout, SourceDeployment(1))
    with pytest.raises(LayoutMismatch, match=f"producer KV cache group {FULL} of 4-token blocks, consumer "
                                             f"sliding_window\\(8\\)"):
        check_source(layout, plain, read)
    other_window = rank_layout(kv, (KVGroup(SLIDING, B, (name(0), name(2)), 16), groups[1]))
    with pytest.raises(LayoutMismatch, match="sliding_window\\(16\\)"):
        check_source(layout, other_window, read)
    with pytest.raises(BadRequest, match="do not cover the layers"):
        rank_layout(kv, groups[:1])
    with pytest.raises(BadRequest, match="in KV cache groups 0 and 1"):
        rank_layout(kv, (groups[0], KVGroup(FULL, B, (name(0), name(1), name(3)))))
