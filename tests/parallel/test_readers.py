"""kvd.parallel.readers: which source shards a reshard sends and who reads each, checked against a
reference that slices one full [layers, heads, head_dim] cache, over every TP x PP pair up to
TP 16 x PP 4 (the GQA boundaries: 8 KV heads at TP 1..16, 2 at TP 4, 1), uneven partitions."""
from __future__ import annotations

import itertools

import pytest
import torch

from kvd.parallel import KVLayout, assemble, is_primary, primary_shards, read_plans, readers, shard_layouts, slice_shard

HEAD_DIM = 2
TPS = (1, 2, 4, 8, 16)
PPS = (1, 2, 3, 4)
# 7 layers: vLLM's split is uneven for PP 2 (4, 3), 3 (2, 3, 2) and 4 (2, 2, 2, 1)... plus explicit ones
PARTITIONS = {1: [None], 2: [None, "1,6"], 3: [None, "5,1,1"], 4: [None, "1,1,1,4"]}


def deployments(heads: int):
    for tp, pp in itertools.product(TPS, PPS):
        if heads % tp and tp % heads:
            continue
        for partition in PARTITIONS[pp]:
            yield tp, pp, partition


def reference(full: torch.Tensor, kv: KVLayout) -> list[torch.Tensor]:
    (l0, l1), (h0, h1) = kv.layer_range(), kv.head_range()
    return [full[i, h0:h1] for i in range(l0, l1)]


@pytest.mark.parametrize("heads", [8, 2, 1])
def test_every_pair_rebuilds_every_rank_from_primary_shards_only(heads):
    model = KVLayout(num_layers=7, num_kv_heads=heads, head_dim=HEAD_DIM, dtype="float32")
    full = torch.randn(7, heads, HEAD_DIM)
    pairs = 0
    for (stp, spp, spart), (dtp, dpp, dpart) in itertools.product(list(deployments(heads)), repeat=2):
        srcs = shard_layouts(model, stp, spp, spart)
        dsts = shard_layouts(model, dtp, dpp, dpart)
        held = {(s.tp_rank, s.pp_rank): reference(full, s) for s in srcs}
        plans = read_plans(srcs, dsts)
        who = readers(srcs, dsts)
        primaries = {(s.tp_rank, s.pp_rank) for s in primary_shards(srcs)}
        used = set()
        for dst in dsts:
            pieces = plans[dst.tp_rank, dst.pp_rank]
            got = assemble(dst, [(p, slice_shard(p, held[p.src_tp_rank, p.src_pp_rank], head_axis=-2))
                                 for p in pieces])
            assert all(torch.equal(g, e) for g, e in zip(got, reference(full, dst))), (stp, spp, spart, dst)
            for rank in {(p.src_tp_rank, p.src_pp_rank) for p in pieces}:
                assert rank in primaries and (dst.tp_rank, dst.pp_rank) in who[rank]
                used.add(rank)
        assert set(who) == used  # no source listed that nobody reads
        # every primary shard is needed by somebody: nothing is saved only to wait for its TTL
        assert used == primaries, (stp, spp, spart, dtp, dpp, dpart)
        assert sum(len(r) for r in who.values()) == sum(len({(p.src_tp_rank, p.src_pp_rank) for p in pl})
                                                        for pl in plans.values())
        pairs += 1
    assert pairs >= {8: 400, 2: 100, 1: 400}[heads]


def test_replicas_are_sent_once():
    # 8 KV heads at TP 16: ranks 2r and 2r+1 hold head r; only the even ranks are sources
    model = KVLayout(num_layers=2, num_kv_heads=8, head_dim=HEAD_DIM, dtype="float16")
    assert [s.tp_rank for s in primary_shards(shard_layouts(model, 16, 1))] == list(range(0, 16, 2))
    # 2 KV heads at TP 4 -> TP 1: two shards cross, not four
    two = model.__class__(num_layers=2, num_kv_heads=2, head_dim=HEAD_DIM, dtype="float16")
    assert readers(shard_layouts(two, 4, 1), shard_layouts(two, 1, 1)) == {(0, 0): [(0, 0)], (2, 0): [(0, 0)]}
    # TP 1 -> TP 4 with 2 heads: the one shard is read by all four decode ranks
    assert readers(shard_layouts(two, 1, 1), shard_layouts(two, 4, 1)) == {(0, 0): [(0, 0), (1, 0), (2, 0), (3, 0)]}


def test_an_mla_style_cache_is_one_shard_per_stage():
    """One latent every TP rank holds: modelled as one KV head, sent by rank 0 of each stage."""
    latent = KVLayout(num_layers=4, num_kv_heads=1, head_dim=HEAD_DIM, dtype="bfloat16")
    srcs = shard_layouts(latent, 8, 2)
    assert [(s.tp_rank, s.pp_rank) for s in srcs if is_primary(s)] == [(0, 0), (0, 1)]
    who = readers(srcs, shard_layouts(latent, 4, 1))
    assert who == {(0, 0): [(0, 0), (1, 0), (2, 0), (3, 0)], (0, 1): [(0, 0), (1, 0), (2, 0), (3, 0)]}
