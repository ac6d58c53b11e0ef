"""Paged caches: a request's scattered blocks are gathered into the pool and scattered back."""
from __future__ import annotations

import pytest
import torch

import kvd

BOTH_PLANES = True  # (tests/system/conftest.py: each test on ZeroMQ frames and on NIXL)


def paged(num_blocks=32, block_size=16, heads=4, head_dim=32, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, block_size, heads, head_dim, generator=g).to(dtype)


def test_blocks_move_between_different_block_tables(daemons):
    a, b = daemons.pair()
    layers = 4
    prefill = {f"layer.{i}.{kv}": paged(seed=i * 2 + (kv == "v")) for i in range(layers) for kv in "kv"}
    src_ids = [17, 3, 29, 8, 11]  # scattered, out of order
    dst_ids = [0, 1, 2, 30, 31]  # the decode worker's own free blocks
    decode = {name: torch.zeros_like(t) for name, t in prefill.items()}
    with a.client() as ca, b.client() as cb:
        ca.put_blocks("paged-1", prefill, src_ids, dest="B")
        cb.get_blocks("paged-1", decode, dst_ids)
        assert cb.stats()["entries"] == 0
    for name in prefill:
        got = decode[name][dst_ids].view(torch.int16)
        assert torch.equal(got, prefill[name][src_ids].view(torch.int16))
        untouched = [i for i in range(32) if i not in dst_ids]
        assert not decode[name][untouched].view(torch.int16).any()


def test_blocks_then_plain_get(client):
    cache = paged(dtype=torch.float16)
    client.put_blocks("paged-2", {"k": cache}, torch.tensor([5, 6, 7]))
    got = client.get("paged-2")["k"]
    assert got.shape == (3, 16, 4, 32) and torch.equal(got, cache[5:8])


def test_block_errors(client):
    cache = paged()
    with pytest.raises(kvd.BadRequest, match="block ids"):
        client.put_blocks("bad", {"k": cache}, [0, 99])
    with pytest.raises(kvd.BadRequest, match="non-empty"):
        client.put_blocks("bad", {"k": cache}, [])
    client.put_blocks("fit", {"k": cache}, [1, 2])
    with pytest.raises(kvd.BadRequest, match="does not fit"):
        client.get_blocks("fit", {"k": torch.zeros(8, 16, 4, 16)}, [0, 1])
    with pytest.raises(kvd.BadRequest, match="does not fit"):
        client.get_blocks("fit", {"k": torch.zeros_like(cache)}, [0, 1, 2])
    target = torch.zeros_like(cache)
    client.get_blocks("fit", {"k": target}, [4, 5])  # the failed gets gave the entry back
    assert torch.equal(target[4:6], cache[1:3])
    assert client.stats()["pool"]["used_bytes"] == 0


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.int8], ids=str)
def test_stream_writes_rows_of_a_paged_cache_straight_into_the_pool(daemons, dtype):
    a, b = daemons.pair()
    gen = torch.Generator().manual_seed(5)
    caches = {f"layer.{i}": torch.randint(0, 256, (30, 2, 16, 8 * dtype.itemsize), generator=gen,
                                          dtype=torch.uint8).view(dtype) for i in range(3)}
    ids = [29, 3, 17, 0]
    with a.client() as ca, b.client() as cb:
        layout = {name: ((len(ids), 2, 16, 8), dtype) for name in caches}
        with ca.put_stream("rows", layout, dest="B") as stream:
            for name, cache in caches.items():
                stream.write({name: kvd.Rows(cache, ids)})
        got = cb.get("rows")
        for name, cache in caches.items():
            assert torch.equal(got[name].view(torch.uint8), cache[ids].view(torch.uint8))
        stream = ca.put_stream("bad", layout)
        with pytest.raises(kvd.BadRequest, match="declared"):
            stream.write({"layer.0": kvd.Rows(caches["layer.0"], ids[:3])})  # 3 rows, 4 declared
        with pytest.raises(kvd.BadRequest, match="block ids"):
            stream.write({"layer.0": kvd.Rows(caches["layer.0"], [0, 1, 2, 30])})
        stream.abort()
        assert ca.stats()["entries"] == 0


def test_get_blocks_scatters_fp8_bit_exact(daemons):
    """CPU torch has no fp8 index_copy_: the scatter runs on a byte view of the same memory."""
    a, b = daemons.pair()
    src = torch.randint(0, 256, (12, 16, 8), dtype=torch.uint8).view(torch.float8_e5m2)
    dst = torch.zeros(12, 16, 8, dtype=torch.float8_e5m2)
    with a.client() as ca, b.client() as cb:
        ca.put_blocks("fp8", {"k": src}, block_ids=[4, 1, 9], dest="B")
        cb.get_blocks("fp8", {"k": dst}, block_ids=[0, 11, 5])
    assert torch.equal(dst[[0, 11, 5]].view(torch.uint8), src[[4, 1, 9]].view(torch.uint8))
