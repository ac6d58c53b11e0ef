"""kvd.integrations.paged.plans (pure, no vLLM, no daemons): the connector's load plans applied to
paged caches cut from one full reference cache rebuild every consumer rank exactly, over TP x PP
pairs (GQA replication, MLA latents, uneven partitions); every refusal names its field."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from kvd.errors import BadRequest, LayoutMismatch
from kvd.integrations.paged.plans import (
    PagedKVLayout,
    SourceDeployment,
    check_source,
    layer_index,
    plan_loads,
    release_keys,
)
from kvd.parallel import KVLayout, is_primary, shard_layouts

BLOCKS, BLOCK, CONTENT = 3, 2, 4
DEPLOYMENTS = [(tp, pp, part) for tp in (1, 2, 4, 8) for pp, part in ((1, None), (2, None), (2, "4,1"), (4, None))]


def name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def caches(full, kv: KVLayout, mla: bool) -> dict[str, torch.Tensor]:
    (l0, l1), (h0, h1) = kv.layer_range(), kv.head_range()
    return {name(i): full[i].clone() if mla else full[i][:, h0:h1].clone() for i in range(l0, l1)}


def layout(kv: KVLayout, mla: bool, model: str = "m") -> PagedKVLayout:
    shape = (BLOCKS, BLOCK, CONTENT) if mla else (BLOCKS, kv.head_range()[1] - kv.head_range()[0], BLOCK, CONTENT)
    fake = {name(i): torch.zeros(shape) for i in range(*kv.layer_range())}
    return PagedKVLayout.from_caches(fake, model=model, block_size=BLOCK, kv=kv, head_axis=None if mla else 0)


@pytest.mark.parametrize("heads", [8, 2, None], ids=["gqa8", "gqa2", "mla"])
def test_plans_rebuild_every_consumer_rank(heads):
    mla = heads is None
    model = KVLayout(num_layers=5, num_kv_heads=heads or 1, head_dim=CONTENT, dtype="float32")
    full = [torch.randn(BLOCKS, BLOCK, CONTENT) if mla else torch.randn(BLOCKS, heads, BLOCK, CONTENT)
            for _ in range(5)]
    for (stp, spp, spart), (dtp, dpp, dpart) in itertools.product(DEPLOYMENTS, repeat=2):
        src = SourceDeployment(stp, spp, spart)
        held = {(s.tp_rank, s.pp_rank): (s, caches(full, s, mla)) for s in shard_layouts(model, stp, spp, spart)}
        reads_of: dict[tuple[int, int], int] = {}
        for dst in shard_layouts(model, dtp, dpp, dpart):
            mine = layout(dst, mla)
            out = {n: torch.full_like(c, float("nan")) for n, c in caches(full, dst, mla).items()}
            for read in plan_loads(mine, src):
                rank = (read.src.tp_rank, read.src.pp_rank)
                assert is_primary(read.src)
                check_source(mine, layout(held[rank][0], mla), read)  # the true producer passes
                reads_of[rank] = reads_of.get(rank, 0) + 1
                assert read.readers >= reads_of[rank]
                for layer, s, d, n in read.copies:
                    source = held[rank][1][layer]
                    if n == 0:
                        out[layer].copy_(source)
                    else:
                        out[layer][:, d:d + n] = source[:, s:s + n]
            assert all(torch.equal(out[n], c) for n, c in caches(full, dst, mla).items()), (src, dst)
        ranks = release_keys(model.with_shard(0, dtp, 0, dpp, dpart), src)
        assert set(ranks) == set(reads_of)  # the release covers exactly what was read


def test_refusals_name_the_field():
    model = KVLayout(num_layers=4, num_kv_heads=2, head_dim=CONTENT, dtype="float32")
    mine = layout(model.with_shard(0, 2, 0, 1), False)
    [read] = plan_loads(mine, SourceDeployment(1))
    producer = layout(model, False)
    cases = {
        "model": dataclasses.replace(producer, model="other"),
        "block_size": dataclasses.replace(producer, block_size=BLOCK * 2),
        "head_dim": layout(dataclasses.replace(model, head_dim=CONTENT * 2), False),
        "dtype": layout(dataclasses.replace(model, dtype="bfloat16"), False),
        "num_kv_heads": layout(dataclasses.replace(model, num_kv_heads=4), False),
        "tp_size": layout(model.with_shard(0, 2, 0, 1), False),
        "pp_size": layout(model.with_shard(0, 1, 0, 2), False),
        "quant": dataclasses.replace(producer, quant="FP8_PER_TOKEN_HEAD"),
    }
    for field, bad in cases.items():
        with pytest.raises(LayoutMismatch, match=field):
            check_source(mine, bad, read)
    with pytest.raises(LayoutMismatch, match="tp_size"):  # 2 KV heads cannot be split over TP 3
        plan_loads(mine, SourceDeployment(3))
    with pytest.raises(LayoutMismatch, match="kv_quant_mode"):  # pages that do not split by head
        plan_loads(dataclasses.replace(mine, quant="NVFP4"), SourceDeployment(1))
    same = dataclasses.replace(mine, quant="NVFP4")  # ... move between identical deployments only
    assert plan_loads(same, SourceDeployment(2))


def test_layer_names_and_wire():
    assert layer_index("model.layers.17.self_attn.attn") == 17 and layer_index("3.attn") == 3
    for bad in ("model.attn", "model.layers.1.experts.2"):
        with pytest.raises(BadRequest):
            layer_index(bad)
    kv = KVLayout(num_layers=5, num_kv_heads=8, head_dim=CONTENT, dtype="float32", tp_rank=3, tp_size=4,
                  pp_rank=1, pp_size=2, pp_partition="4,1")
    made = layout(kv, False)
    assert PagedKVLayout.from_wire(made.to_wire()) == made
    assert made.to_wire()["layer_range"] == [4, 5] and made.to_wire()["head_range"] == [6, 8]
    with pytest.raises(BadRequest):  # a layer outside the stage
        PagedKVLayout(made.model, ((name(0), (2, BLOCK, CONTENT), "float32"),), BLOCK, kv)
    with pytest.raises(BadRequest):  # a block with the wrong number of heads
        PagedKVLayout(made.model, ((name(4), (3, BLOCK, CONTENT), "float32"),), BLOCK, kv)
    with pytest.raises(ValueError):
        SourceDeployment.from_params({"tp_size": "2"})
