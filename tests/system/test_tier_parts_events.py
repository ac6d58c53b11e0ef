"""Two things of the KV tier that the vLLM connector's prefix reuse needs, on a real daemon: pages
given as `Parts` (a block of every layer, each layer its own tensor: one copy each way, no
staging), and `cache_events` (what a followed namespace stored and removed, one request a poll)."""
from __future__ import annotations

import pytest
import torch

from kvd import Parts
from kvd.errors import BadRequest
from tests.system.test_kv_tier import random_page, same_bits

KIB = 1024


def layer_caches(layers: int = 3, blocks: int = 6, seed: int = 0) -> list[torch.Tensor]:
    """Paged caches [blocks, heads, tokens, content], the way an engine keeps one per layer."""
    return [random_page(torch.float16, (blocks, 2, 8, 32), seed=seed + i) for i in range(layers)]


def test_parts_store_one_page_of_every_layer_and_read_back_into_other_blocks(client):
    src, dst = layer_caches(seed=1), layer_caches(seed=50)
    before = [t.clone() for t in dst]
    pages = [Parts([cache[b] for cache in src]) for b in (4, 1)]
    assert client.cache_put(["h4", "h1"], pages, namespace="p") == [True, True]
    nbytes = sum(c[0].numel() * c[0].element_size() for c in src)
    assert client.cache_stats("p")["bytes"] == 2 * nbytes  # one page per block, every layer in it
    outs = [Parts([cache[b] for cache in dst]) for b in (0, 5)]
    assert client.cache_get(["h4", "h1"], outs, namespace="p") == [True, True]
    for s, d, b in zip(src, dst, before):
        assert same_bits(d[0], s[4]) and same_bits(d[5], s[1])
        assert same_bits(d[1:5], b[1:5])  # nothing else written
    # the page is plain bytes: a flat out of its size reads it whole, the layers end to end
    flat = torch.empty(nbytes, dtype=torch.uint8)
    assert client.cache_get(["h1"], [flat], namespace="p") == [True]
    assert same_bits(flat, torch.cat([c[1].reshape(-1) for c in src]))


def test_parts_across_segments_of_a_fragmented_pool(daemons):
    """A page bigger than a block lies in several pool segments when the pool is fragmented:
    each part's bytes are split across them and come back whole."""
    daemon = daemons.start("A", pool_size="1MiB", extra=["--cache-size", "1.0", "--block-size", "4KiB"])
    with daemon.client() as client:
        filler = torch.zeros(1024, dtype=torch.float32)  # 4 KiB: one block
        for i in range(256):  # the whole pool, blocks of namespaces "x" and "y" alternating
            assert client.cache_put([f"f{i}"], [filler], namespace="xy"[i % 2]) == [True]
        client.cache_clear("x")  # every other block free: no two free blocks touch
        parts = [random_page(torch.float32, (3, 1000), seed=i) for i in range(4)]  # 4 x 7.8 KiB
        assert client.cache_put(["big"], [Parts([p[1:] for p in parts])]) == [True]  # non-contiguous views too
        outs = [torch.empty(2, 1000) for _ in parts]
        assert client.cache_get(["big"], [Parts(outs)]) == [True]
        assert all(same_bits(o, p[1:]) for o, p in zip(outs, parts))
        assert client.cache_stats()["entries"] == 128 + 1


def test_parts_refused_clearly(client):
    with pytest.raises(BadRequest, match="Parts of no tensor"):
        client.cache_put(["k"], [Parts([])])
    with pytest.raises(BadRequest, match=r"pages\[0\]\.tensors\[1\] must be a torch.Tensor"):
        client.cache_put(["k"], [Parts([torch.zeros(2), "x"])])
    assert client.cache_exists(["k"]) == 0


def test_cache_events_tell_a_follower_what_was_stored_and_evicted(daemons):
    daemon = daemons.start("A", pool_size="16MiB", extra=["--cache-size", "256KiB"])  # 4 pages of 64 KiB
    page = torch.zeros(16 * KIB, dtype=torch.float32)
    with daemon.client() as client, daemon.client() as follower:
        start = follower.cache_events("ns")
        assert start["events"] == [] and not start["lost"]
        client.cache_put([f"k{i}" for i in range(6)], [page] * 6, namespace="ns")
        client.cache_put(["other"], [page], namespace="elsewhere")
        answer = follower.cache_events("ns", epoch=start["epoch"], since=start["next"])
        kinds = [tuple(e) for e in answer["events"]]
        # (the batch evicts nothing of its own: the first 4 fit, the rest are refused; the other
        # namespace's page evicts the least recently used of ns)
        assert kinds == [("stored", f"k{i}") for i in range(4)] + [("removed", "k0")]
        assert not answer["lost"]
        client.cache_clear("ns")
        again = follower.cache_events("ns", epoch=answer["epoch"], since=answer["next"])
        assert sorted(tuple(e) for e in again["events"]) == [("removed", f"k{i}") for i in (1, 2, 3)]
        # a cursor of another epoch (a daemon that restarted) is told it lost its place
        assert follower.cache_events("ns", epoch=answer["epoch"] + 2, since=1)["lost"]
