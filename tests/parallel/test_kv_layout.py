"""kvd.parallel.kv_layout: layer/head rules, the wire form, and reshard plans checked bit-exact
against slices of one full [num_layers, num_kv_heads, head_dim] tensor, over every TP/PP pair."""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvd.errors import BadRequest, LayoutMismatch
from kvd.parallel import KVLayout, ShardPiece, assemble, plan_reshard, shard_layouts, slice_shard
from kvd.wire import protocol

TPS = (1, 2, 4, 8)
PPS = (1, 2, 4)
HEAD_DIM = 4


def model(num_layers: int = 8, num_kv_heads: int = 8, **kw) -> KVLayout:
    return KVLayout(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=HEAD_DIM, dtype="float32", **kw)


def shard_of(full: torch.Tensor, layout: KVLayout, extra: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """The reference: this shard's per-layer tensors [*extra, heads, head_dim], cut from `full`."""
    (l0, l1), (h0, h1) = layout.layer_range(), layout.head_range()
    return [full[layer, h0:h1].expand(*extra, h1 - h0, HEAD_DIM).clone() for layer in range(l0, l1)]


def holdings(full: torch.Tensor, srcs: list[KVLayout], head_axis: int = -2,
             extra: tuple[int, ...] = ()) -> dict[tuple[int, int], list[torch.Tensor]]:
    """What each source shard holds, keyed by (tp_rank, pp_rank)."""
    return {(s.tp_rank, s.pp_rank): [t.movedim(-2, head_axis) for t in shard_of(full, s, extra)] for s in srcs}


def reshard(held: dict[tuple[int, int], list[torch.Tensor]], srcs: list[KVLayout], dst: KVLayout,
            head_axis: int = -2) -> tuple[list[ShardPiece], list[torch.Tensor]]:
    pieces = plan_reshard(srcs, dst)
    data = [(p, slice_shard(p, held[p.src_tp_rank, p.src_pp_rank], head_axis)) for p in pieces]
    return pieces, assemble(dst, data, head_axis)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("num_layers", [5, 8])
@pytest.mark.parametrize("kv_heads", [1, 2, 8, 16])
@pytest.mark.parametrize("src_tp, dst_tp", list(itertools.product(TPS, TPS)))
def test_reshard_matches_reference(num_layers, kv_heads, src_tp, dst_tp):
    base = model(num_layers, kv_heads)
    full = torch.randn(num_layers, kv_heads, HEAD_DIM)
    for src_pp, dst_pp in itertools.product(PPS, PPS):
        srcs = shard_layouts(base, src_tp, src_pp)
        held = holdings(full, srcs)
        for dst in shard_layouts(base, dst_tp, dst_pp):
            pieces, got = reshard(held, srcs, dst)
            expected = shard_of(full, dst)
            assert len(got) == len(expected)
            for g, e in zip(got, expected):
                assert torch.equal(bits(g), bits(e))
            for p in pieces:  # every piece comes from a source that really holds it
                src = next(s for s in srcs if (s.tp_rank, s.pp_rank) == (p.src_tp_rank, p.src_pp_rank))
                (sl0, sl1), (sh0, sh1) = src.layer_range(), src.head_range()
                assert sl0 <= p.layer_start < p.layer_stop <= sl1 and sh0 <= p.head_start < p.head_stop <= sh1
                assert (p.src_layer_offset, p.src_head_offset) == (p.layer_start - sl0, p.head_start - sh0)
            if (src_tp, src_pp) == (dst_tp, dst_pp):  # identical layouts: rank to rank, one piece
                assert [(p.src_tp_rank, p.src_pp_rank) for p in pieces] == [(dst.tp_rank, dst.pp_rank)]
            if src_tp == src_pp == 1:
                assert len(pieces) == 1


@pytest.mark.parametrize("head_axis, extra", [(-2, (2, 3)), (-3, (2, 3)), (0, ())])
def test_reshard_with_paged_shapes_and_head_axis(head_axis, extra):
    """[2, blocks, block_size, heads, head_dim] (NHD) and [.., heads, block_size, head_dim] (HND)."""
    base = model(6, 8)
    full = torch.randn(6, 8, HEAD_DIM)
    srcs = shard_layouts(base, 2, 3)
    held = holdings(full, srcs, head_axis, extra)
    for dst in shard_layouts(base, 8, 2):
        _, got = reshard(held, srcs, dst, head_axis)
        for g, e in zip(got, shard_of(full, dst, extra)):
            assert torch.equal(bits(g), bits(e.movedim(-2, head_axis)))


def test_bfloat16_and_special_values_survive_bit_exact():
    base = KVLayout(num_layers=4, num_kv_heads=4, head_dim=HEAD_DIM, dtype="bfloat16")
    full = torch.randint(-(2**15), 2**15, (4, 4, HEAD_DIM), dtype=torch.int16).view(torch.bfloat16)
    srcs = shard_layouts(base, 4, 2)
    for dst in shard_layouts(base, 2, 4):
        held = {(s.tp_rank, s.pp_rank): shard_of(full, s) for s in srcs}
        pieces = plan_reshard(srcs, dst)
        got = assemble(dst, [(p, slice_shard(p, held[p.src_tp_rank, p.src_pp_rank])) for p in pieces])
        for g, e in zip(got, shard_of(full, dst)):
            assert torch.equal(g.view(torch.int16), e.view(torch.int16))


def test_layer_split_follows_vllm():
    def parts(n, pp):
        return [model(n, 8, pp_rank=r, pp_size=pp).layer_range() for r in range(pp)]
    # vLLM's documented 61-layer examples: leftovers go to the stages before the last
    assert [b - a for a, b in parts(61, 2)] == [31, 30]
    assert [b - a for a, b in parts(61, 4)] == [15, 15, 16, 15]
    assert parts(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert parts(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    explicit = model(10, 8, pp_size=4, pp_partition="4, 2,2,2")
    assert explicit.pp_partition == "4,2,2,2" and explicit.layer_partition() == (4, 2, 2, 2)


def test_reshard_between_partitions():
    base = model(10, 2)
    full = torch.randn(10, 2, HEAD_DIM)
    srcs = shard_layouts(base, 4, 2, pp_partition="7,3")
    held = holdings(full, srcs)
    for dst in shard_layouts(base, 2, 4):
        _, got = reshard(held, srcs, dst)
        assert all(torch.equal(g, e) for g, e in zip(got, shard_of(full, dst)))


def test_gqa_head_ranges():
    assert [model(8, 2, tp_rank=r, tp_size=8).head_range() for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4
    assert [model(8, 8, tp_rank=r, tp_size=2).head_range() for r in range(2)] == [(0, 4), (4, 8)]
    assert model(8, 1, tp_rank=5, tp_size=8).head_range() == (0, 1)
    assert model(8, 2, tp_size=8).head_replicas == 4 and model(8, 8, tp_size=2).head_replicas == 1


def test_replicated_heads_spread_over_sources():
    base = model(4, 2)
    srcs = shard_layouts(base, 4, 1)  # src ranks 0,1 hold head 0; 2,3 hold head 1
    chosen = [plan_reshard(srcs, dst)[0].src_tp_rank for dst in shard_layouts(base, 8, 1)]
    assert chosen == [0, 1, 0, 1, 2, 3, 2, 3]  # own rank when it holds the head, else rotate


@pytest.mark.parametrize("kw, match", [
    (dict(num_kv_heads=3, tp_size=2), "cannot be split"),
    (dict(num_kv_heads=6, tp_size=4), "cannot be split"),
    (dict(num_layers=2, pp_size=4), "cannot fill"),
    (dict(tp_rank=2, tp_size=2), "rank out of range"),
    (dict(pp_rank=-1), "pp_rank must be an int"),
    (dict(head_dim=0), "head_dim must be an int"),
    (dict(num_layers=True), "num_layers must be an int"),
    (dict(num_layers=1 << 30), "num_layers must be an int"),
    (dict(dtype="float64"), "unsupported dtype"),
    (dict(dtype=["float32"]), "dtype must be a string"),
    (dict(block_size=0), "block_size"),
    (dict(page_layout=""), "page_layout"),
    (dict(pp_size=2, pp_partition="4,5"), "summing to num_layers=8"),
    (dict(pp_size=2, pp_partition="8,0"), "cannot fill"),
    (dict(pp_size=2, pp_partition="a,b"), "comma-separated ints"),
    (dict(pp_partition=8), "pp_partition must be a string"),
])
def test_invalid_layouts(kw, match):
    args = dict(num_layers=8, num_kv_heads=8, head_dim=HEAD_DIM, dtype="float32") | kw
    with pytest.raises(BadRequest, match=match):
        KVLayout(**args)


def test_wire_round_trip_through_the_protocol():
    layout = model(32, 8, tp_rank=1, tp_size=4, pp_rank=1, pp_size=2, block_size=16, page_layout="NHD",
                   pp_partition="17,15")
    msg = protocol.PutAlloc(req=1, request_id="r", tensors=[], meta={"kv_layout": layout.to_wire()})
    back = protocol.decode(protocol.encode(msg))
    assert KVLayout.from_wire(back.meta["kv_layout"]) == layout
    bare = model()
    assert set(bare.to_wire()) == {"num_layers", "num_kv_heads", "head_dim", "dtype",
                                   "tp_rank", "tp_size", "pp_rank", "pp_size"}
    assert all(type(v) in (int, str) for v in layout.to_wire().values())


layouts = st.builds(
    lambda layers, heads_exp, tp_exp, pp, dims, dtype, block, page: KVLayout(
        num_layers=layers, num_kv_heads=2**heads_exp, head_dim=dims, dtype=dtype,
        tp_rank=2**tp_exp - 1, tp_size=2**tp_exp, pp_rank=min(pp, layers) - 1, pp_size=min(pp, layers),
        block_size=block, page_layout=page),
    st.integers(1, 200), st.integers(0, 7), st.integers(0, 6), st.integers(1, 8), st.integers(1, 1024),
    st.sampled_from(["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float32"]),
    st.none() | st.integers(1, 1 << 10), st.none() | st.sampled_from(["NHD", "HND"]),
)


@given(layouts)
def test_wire_round_trip_property(layout):
    assert KVLayout.from_wire(layout.to_wire()) == layout


@pytest.mark.parametrize("mutate, match", [
    (lambda w: w.pop("head_dim"), "missing fields: head_dim"),
    (lambda w: w.update(extra=1), "unknown fields: extra"),
    (lambda w: w.update(tp_rank="0"), "tp_rank must be an int"),
    (lambda w: w.update(num_kv_heads=None), "num_kv_heads must be an int"),
    (lambda w: w.update(dtype=7), "dtype must be a string"),
])
def test_from_wire_rejects(mutate, match):
    wire = model().to_wire()
    mutate(wire)
    with pytest.raises(BadRequest, match=match):
        KVLayout.from_wire(wire)
    with pytest.raises(BadRequest, match="must be a map"):
        KVLayout.from_wire([1, 2])


def test_same_model_and_check_compatible():
    a = model(8, 8, tp_size=2)
    assert a.same_model(model(8, 8, tp_rank=3, tp_size=4, pp_size=2))  # shards differ, model does not
    assert not a.same_model(model(8, 16))
    a.check_compatible(model(8, 8, pp_size=4))
    with pytest.raises(LayoutMismatch, match=r"num_kv_heads 8 != 16") as info:
        a.check_compatible(model(8, 16))
    assert "head_dim" not in str(info.value)
    with pytest.raises(LayoutMismatch, match=r"dtype 'float32' != 'float16', block_size None != 16"):
        a.check_compatible(KVLayout(num_layers=8, num_kv_heads=8, head_dim=HEAD_DIM, dtype="float16",
                                    block_size=16))
    with pytest.raises(LayoutMismatch, match="different models"):
        plan_reshard([model(8, 8)], model(7, 8))


def test_plan_errors():
    base = model(8, 8)
    srcs = shard_layouts(base, 2, 2)
    with pytest.raises(BadRequest, match="no source holds layers"):
        plan_reshard([s for s in srcs if s.pp_rank == 0], base)
    with pytest.raises(BadRequest, match="two source layouts claim tp_rank 0, pp_rank 0"):
        plan_reshard([srcs[0], srcs[0], *srcs[1:]], base)
    with pytest.raises(BadRequest, match="no source"):
        plan_reshard([], base)


def test_assemble_checks_its_input():
    dst = model(2, 2)
    one = [torch.zeros(2, HEAD_DIM), torch.zeros(2, HEAD_DIM)]
    whole = ShardPiece(0, 0, 0, 2, 0, 2, 0, 0, 0, 0)
    assert len(assemble(dst, [(whole, one)])) == 2
    with pytest.raises(BadRequest, match="overlaps"):
        assemble(dst, [(whole, one), (whole, one)])
    with pytest.raises(BadRequest, match="do not cover"):
        assemble(dst, [(ShardPiece(0, 0, 0, 1, 0, 2, 0, 0, 0, 0), one[:1])])
    with pytest.raises(BadRequest, match="falls outside"):
        assemble(dst, [(ShardPiece(0, 0, 0, 2, 0, 2, 0, 0, -1, 0), one)])
    with pytest.raises(BadRequest, match="does not match layout dtype"):
        assemble(dst, [(whole, [t.half() for t in one])])
    with pytest.raises(BadRequest, match="does not fit"):
        assemble(dst, [(whole, [torch.zeros(1, 2, HEAD_DIM)] * 2)], out=[torch.zeros(3, 2, HEAD_DIM)] * 2)
    out = [torch.full((2, HEAD_DIM), 7.0), torch.full((2, HEAD_DIM), 7.0)]
    assert assemble(dst, [(whole, one)], out=out)[0].data_ptr() == out[0].data_ptr()
    assert all(torch.equal(t, torch.zeros(2, HEAD_DIM)) for t in out)
    with pytest.raises(BadRequest, match="shard has 1"):
        slice_shard(whole, one[:1])
