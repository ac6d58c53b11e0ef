"""kvd.sharded against real daemons: prefill and decode with different TP/PP layouts, every slice
checked bit-exact (bf16, random bit patterns, NaNs included) against the same slice of one full cache."""
from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time

import pytest
import torch

import kvd
from kvd.errors import LayoutMismatch
from kvd.parallel import KVLayout, shard_layouts
from kvd.sharded import LAYOUT_SUFFIX, get_shard, put_shard, release_shards, shard_key, shard_names

SEED = 1234


def model(num_layers: int, num_kv_heads: int, head_dim: int = 16, dtype: str = "bfloat16") -> KVLayout:
    return KVLayout(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)


def full_cache(m: KVLayout, prefix: tuple[int, ...] = (4, 8), head_axis: int = -2) -> dict[str, torch.Tensor]:
    """The whole model's cache, [*prefix, heads, head_dim] per tensor (heads moved to head_axis),
    every bf16 bit pattern possible (built from a fixed seed, so every process gets the same)."""
    gen = torch.Generator().manual_seed(SEED)
    shape = (*prefix, m.num_kv_heads, m.head_dim)
    return {f"layer.{g}.{kind}": torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16)
            .view(torch.bfloat16).movedim(-2, head_axis).contiguous()
            for g in range(m.num_layers) for kind in ("k", "v")}


def slice_of(full: dict[str, torch.Tensor], layout: KVLayout, head_axis: int = -2) -> dict[str, torch.Tensor]:
    h0, h1 = layout.head_range()
    return {name: full[name].narrow(head_axis, h0, h1 - h0).clone() for name in shard_names(layout)}


def assert_bits_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for name, e in expected.items():
        assert got[name].shape == e.shape, name
        assert torch.equal(got[name].contiguous().view(torch.int16), e.contiguous().view(torch.int16)), name


def put_all(client: kvd.Client, rid: str, m: KVLayout, tp: int, pp: int, full, dest=None, head_axis=-2):
    for src in shard_layouts(m, tp, pp):
        put_shard(client, rid, slice_of(full, src, head_axis), src, dest=dest, head_axis=head_axis)


def test_tp2_to_tp4_gqa_pulled_by_concurrent_decode_ranks(daemons):
    """2 KV heads over decode TP=4: each head on two ranks. Ranks pull from A concurrently, each
    fetching only the source shard holding its head (the other is not even put yet)."""
    a, b = daemons.pair()
    m = model(4, 2)
    full = full_cache(m)
    srcs, dsts = shard_layouts(m, 2, 1), shard_layouts(m, 4, 1)
    got: dict[int, dict] = {}
    errors: list[BaseException] = []

    def decode(dst: KVLayout) -> None:
        try:
            with b.client() as c:
                got[dst.tp_rank] = get_shard(c, "r1", dst, 2, 1, source="A", timeout=10)
        except BaseException as exc:
            errors.append(exc)

    with a.client() as ca, b.client() as cb:
        for src in srcs:  # tp0 first: ranks 0 and 1 (head 0) must not need tp1
            put_shard(ca, "r1", slice_of(full, src), src)
            threads = [threading.Thread(target=decode, args=(d,)) for d in dsts if d.head_range()[0] == src.tp_rank]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert not errors, errors
        for dst in dsts:
            assert_bits_equal(got[dst.tp_rank], slice_of(full, dst))
        held = {e["request_id"] for e in cb.list()}  # keep=True: read by two ranks, still here
        assert held == {shard_key("r1", t, 0) + s for t in (0, 1) for s in ("", LAYOUT_SUFFIX)}
        assert release_shards(cb, "r1", 2, 1) == 2 and cb.list() == []
        assert cb.stats()["pool"]["used_bytes"] == 0
        assert release_shards(ca, "r1", 2, 1) == 2 and ca.stats()["pool"]["used_bytes"] == 0


def test_pp2_to_pp1_pushed_into_preallocated_out(daemons):
    a, b = daemons.pair()
    m = model(5, 4)  # vLLM's split of 5 layers over 2 stages: [3, 2]
    full = full_cache(m)
    assert [s.layer_range() for s in shard_layouts(m, 1, 2)] == [(0, 3), (3, 5)]
    with a.client() as ca, b.client() as cb:
        put_all(ca, "r2", m, 1, 2, full, dest="B")
        dst = m.with_shard(0, 1, 0, 1)
        out = {name: torch.full_like(full[name], 7.0) for name in shard_names(dst)}
        got = get_shard(cb, "r2", dst, 1, 2, out=out)
        assert all(got[n] is out[n] for n in out)
        assert_bits_equal(got, slice_of(full, dst))
        assert release_shards(cb, "r2", 1, 2) == 2 and cb.stats()["pool"]["used_bytes"] == 0
        assert ca.stats()["pool"]["used_bytes"] == 0  # a push leaves no copy behind


def test_tp4_to_pp2_hnd_layout_last_reader_consumes(daemons):
    """[blocks, heads, block_size, head_dim] (head_axis=-3); the second decode rank consumes."""
    a, b = daemons.pair()
    m = model(6, 8)
    full = full_cache(m, head_axis=-3)
    with a.client() as ca, b.client() as cb:
        put_all(ca, "r3", m, 4, 1, full, dest="B", head_axis=-3)
        for dst in shard_layouts(m, 1, 2):
            got = get_shard(cb, "r3", dst, 4, 1, head_axis=-3, consume=dst.pp_rank == 1)
            assert_bits_equal(got, slice_of(full, dst, head_axis=-3))
        assert cb.list() == [] and cb.stats()["pool"]["used_bytes"] == 0


@pytest.mark.parametrize("field, wrong", [("head_dim", dict(head_dim=8)), ("dtype", dict(dtype="float16")),
                                          ("tp_size", dict(src_tp=1))])
def test_mismatch_is_raised_before_any_byte_is_assembled(daemons, field, wrong):
    d = daemons.start("A")
    m = model(4, 4)
    full = full_cache(m)
    with d.client() as c:
        put_all(c, "r4", m, 2, 1, full)
        asked = model(4, 4, head_dim=wrong.get("head_dim", 16), dtype=wrong.get("dtype", "bfloat16"))
        dst = asked.with_shard(0, 1, 0, 1)
        dt = torch.float16 if field == "dtype" else torch.bfloat16
        out = {n: torch.full((4, 8, 4, asked.head_dim), 7.0, dtype=dt) for n in shard_names(dst)}
        with pytest.raises(LayoutMismatch, match=field):
            get_shard(c, "r4", dst, wrong.get("src_tp", 2), 1, out=out, timeout=5)
        assert all(bool((t == 7.0).all()) for t in out.values())  # untouched
        # nothing was consumed: the right request still works
        assert_bits_equal(get_shard(c, "r4", m, 2, 1), slice_of(full, m))


def test_bad_shards_are_refused_on_put_and_on_get(daemons):
    d = daemons.start("A")
    m = model(4, 4)
    full = full_cache(m)
    src = m.with_shard(1, 2, 0, 1)
    good = slice_of(full, src)
    bad = {
        "missing layer": {k: v for k, v in good.items() if k != "layer.3.v"},
        "extra layer": {**good, "layer.4.k": good["layer.0.k"]},
        "head count": {k: torch.cat([v, v], -2) for k, v in good.items()},
        "dtype": {k: v.float() for k, v in good.items()},
        "head_dim": {k: v[..., :8] for k, v in good.items()},
    }
    with d.client() as c:
        for kv in bad.values():
            with pytest.raises(LayoutMismatch):
                put_shard(c, "r5", kv, src)
        assert c.list() == []  # refused before anything was sent
        # a shard whose layout entry is right but whose tensors are not (put around put_shard)
        put_shard(c, "r5", slice_of(full, m.with_shard(0, 2, 0, 1)), m.with_shard(0, 2, 0, 1))
        put_shard(c, "r5", good, src)
        c.delete(shard_key("r5", 1, 0))
        c.put(shard_key("r5", 1, 0), bad["head_dim"])
        out = {n: torch.full_like(full[n], 7.0) for n in shard_names(m)}
        with pytest.raises(LayoutMismatch, match="head_dim"):
            get_shard(c, "r5", m, 2, 1, out=out, timeout=5)
        assert all(bool((t == 7.0).all()) for t in out.values())


# --- N prefill processes -> M decode processes -------------------------------------------------

MP_MODEL = dict(num_layers=6, num_kv_heads=4, head_dim=32)
MP_REQUESTS = ("m0", "m1")


def _prefill(socket: str, pp_rank: int, results) -> None:
    try:
        m = model(**MP_MODEL)
        full = full_cache(m)  # each process builds the same cache from the seed and sends its shard
        src = m.with_shard(0, 1, pp_rank, 2)
        with kvd.Client(socket) as c:
            for rid in MP_REQUESTS:
                put_shard(c, rid, slice_of(full, src), src, dest="B")
        results.put(("prefill", pp_rank, None))
    except BaseException as exc:
        results.put(("prefill", pp_rank, repr(exc)))


def _decode(socket: str, tp_rank: int, results) -> None:
    try:
        dst = model(**MP_MODEL).with_shard(tp_rank, 2, 0, 1)
        with kvd.Client(socket) as c:
            got = {rid: {n: t.view(torch.int16).numpy() for n, t in get_shard(c, rid, dst, 1, 2, timeout=60).items()}
                   for rid in MP_REQUESTS}
        results.put(("decode", tp_rank, got))
    except BaseException as exc:
        results.put(("decode", tp_rank, repr(exc)))


def test_two_prefill_processes_to_two_decode_processes(daemons):
    """Prefill TP=1 x PP=2 pushes to B; decode TP=2 x PP=1 ranks on B read while it arrives."""
    a, b = daemons.pair()
    m = model(**MP_MODEL)
    full = full_cache(m)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_decode, args=(b.socket, r, results)) for r in range(2)]
    procs += [ctx.Process(target=_prefill, args=(a.socket, r, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        reports, deadline = [], time.monotonic() + 90
        while len(reports) < len(procs):
            try:
                reports.append(results.get(timeout=1))
            except queue.Empty:  # fail fast if a child died before it could report
                assert time.monotonic() < deadline, f"no report after 90 s: {reports}"
                assert not [p.exitcode for p in procs if p.exitcode], [p.exitcode for p in procs]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    decoded = {}
    for role, rank, value in reports:
        assert not isinstance(value, str), f"{role} {rank}: {value}"
        if role == "decode":
            decoded[rank] = value
    for tp_rank in range(2):
        expected = slice_of(full, m.with_shard(tp_rank, 2, 0, 1))
        for rid in MP_REQUESTS:
            got = {n: torch.from_numpy(x).view(torch.bfloat16) for n, x in decoded[tp_rank][rid].items()}
            assert_bits_equal(got, expected)
    with b.client() as cb, a.client() as ca:
        assert [release_shards(cb, rid, 1, 2) for rid in MP_REQUESTS] == [2, 2]
        assert cb.stats()["pool"]["used_bytes"] == 0 and ca.stats()["pool"]["used_bytes"] == 0
