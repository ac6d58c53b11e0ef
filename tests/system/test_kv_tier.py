"""The KV tier on real daemons: batched put/get/exists of evictable pages by (namespace, key),
bit-exact for every dtype, eviction under the budget, handoffs displacing pages, pages outliving
their client, two clients sharing, bad input refused, metrics on /metrics and `kvd status`."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import urllib.request

import pytest
import torch

from kvd.errors import BadRequest
from kvd.testing.daemons import eventually, free_port, raw_connection
from kvd.wire import protocol as p
from kvd.wire.dtypes import DTYPE_ITEMSIZE

KIB = 1024


def random_page(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    """Random bits of any dtype (NaN payloads, -0.0, fp8 included): built as bytes, viewed."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = 1
    for d in shape:
        count *= d
    raw = torch.randint(0, 256, (count * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).view(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def test_every_dtype_round_trips_bit_exact_and_reads_never_consume(daemon, client):
    dtypes = [getattr(torch, name) for name in DTYPE_ITEMSIZE]
    pages = [random_page(dt, (3, 5, 7), seed=i) for i, dt in enumerate(dtypes)]
    wide = random_page(torch.float32, (8, 64), seed=99)
    pages.append(wide[:, ::2])  # a non-contiguous view
    keys = [f"page-{i}" for i in range(len(pages))]
    assert client.cache_put(keys, pages, namespace="t") == [True] * len(pages)
    for _ in range(2):  # a read leaves the page there
        outs = [torch.empty_like(page) for page in pages]
        assert client.cache_get(keys, outs, namespace="t") == [True] * len(pages)
        assert all(same_bits(a, b) for a, b in zip(pages, outs))
    # the same bytes into another dtype and shape (a uint8 view of the caller's host pool)
    flat = torch.empty(pages[0].numel() * pages[0].element_size(), dtype=torch.uint8)
    assert client.cache_get(keys[:1], [flat], namespace="t") == [True]
    assert same_bits(flat, pages[0])
    # a put of a held key is a no-op success: the first bytes stay
    assert client.cache_put(keys[:1], [torch.zeros_like(pages[0])], namespace="t") == [True]
    out = torch.empty_like(pages[0])
    assert client.cache_get(keys[:1], [out], namespace="t") == [True] and same_bits(out, pages[0])
    # leading hits; another namespace is a miss; an out of the wrong size is the caller's bug, not a miss
    assert client.cache_exists([*keys[:3], "absent", *keys[3:]], namespace="t") == 3
    with pytest.raises(BadRequest, match="page 'page-0' of namespace 't' holds"):
        client.cache_get(keys[:1], [torch.empty(7)], namespace="t")
    assert client.cache_get(keys[:1], [torch.empty_like(pages[0])], namespace="other") == [False]
    stats = client.cache_stats("t")
    assert stats["entries"] == len(pages) and stats["misses"] == 1


def test_the_budget_evicts_lru_and_a_full_tier_says_false(daemons):
    daemon = daemons.start("A", pool_size="16MiB", extra=["--cache-size", "1MiB"])  # 16 blocks of 64 KiB
    with daemon.client() as client:
        pages = [torch.full((16 * KIB,), i, dtype=torch.float32) for i in range(24)]  # one block each
        for i in range(0, 24, 4):
            assert client.cache_put([f"k{j}" for j in range(i, i + 4)], pages[i:i + 4]) == [True] * 4
            client.cache_get(["k0"], [torch.empty(16 * KIB)])  # k0 stays the most recently used
        stats = client.cache_stats()
        assert stats["entries"] == 16 and stats["evictions"] == 8 and stats["used_bytes"] <= stats["budget"]
        outs = [torch.empty(16 * KIB) for _ in range(24)]
        found = client.cache_get([f"k{j}" for j in range(24)], outs)
        assert found == [True] + [False] * 8 + [True] * 15
        assert all(torch.equal(outs[j], pages[j]) for j in range(24) if found[j])
        # bigger than the whole budget: refused, not raised, and nothing evicted for it
        assert client.cache_put(["huge"], [torch.zeros(2 << 20, dtype=torch.uint8)]) == [False]
        assert client.cache_stats()["refused"] == 1 and client.cache_stats()["evictions"] == 8


def test_a_handoff_displaces_cache_pages_never_the_reverse(daemons):
    daemon = daemons.start("A", pool_size="4MiB", extra=["--cache-size", "1.0", "--scratch-max", "0"])
    with daemon.client() as client:
        pages = [torch.full((16 * KIB,), i, dtype=torch.float32) for i in range(64)]  # the whole pool
        assert client.cache_put([f"k{i}" for i in range(64)], pages) == [True] * 64
        kv = {"k": torch.arange(256 * KIB, dtype=torch.float32)}  # 1 MiB: 16 blocks
        client.put("req-1", kv)
        stats = client.cache_stats()
        assert stats["evictions"] == 16 and stats["entries"] == 48
        # the tier cannot take the handoff's blocks back: its new pages evict its own old ones
        assert client.cache_put(["new"], [pages[0]]) == [True]
        assert torch.equal(client.get("req-1")["k"], kv["k"])
        assert client.cache_exists([f"k{i}" for i in range(17, 64)]) == 47


def test_pages_outlive_their_client_and_two_clients_share(daemon):
    writer = textwrap.dedent(f"""
        import torch, kvd
        c = kvd.Client({daemon.socket!r})
        assert c.cache_put(["a", "b"], [torch.arange(1000, dtype=torch.int64), torch.ones(3, 3)],
                           namespace="model=x;tp=0/1") == [True, True]
    """)
    subprocess.run([sys.executable, "-c", writer], check=True, timeout=60)  # the engine exits
    with daemon.client() as one:
        out = torch.empty(1000, dtype=torch.int64)
        assert one.cache_get(["a"], [out], namespace="model=x;tp=0/1") == [True]
        assert torch.equal(out, torch.arange(1000, dtype=torch.int64))
        assert one.cache_put(["c"], [torch.full((4,), 7.0)], namespace="model=x;tp=0/1") == [True]

    async def other_client() -> list[bool]:
        async with daemon.async_client() as two:
            assert await two.cache_exists(["a", "b", "c"], namespace="model=x;tp=0/1") == 3
            outs = [torch.empty(3, 3), torch.empty(4)]
            found = await two.cache_get(["b", "c"], outs, namespace="model=x;tp=0/1")
            assert torch.equal(outs[0], torch.ones(3, 3)) and torch.equal(outs[1], torch.full((4,), 7.0))
            assert await two.cache_clear("model=x;tp=0/1") == 3
            return found

    assert asyncio.run(other_client()) == [True, True]


def test_bad_input_is_refused_clearly_and_loses_nothing(daemons):
    # 4 KiB blocks, so that 5,000 tiny pages (a block each) fit in the budget
    daemon = daemons.start("A", extra=["--block-size", "4KiB", "--cache-size", "0.5", "--lease-timeout", "3s"])
    client = daemon.client()
    assert client.cache_put(["keep"], [torch.ones(4)]) == [True]
    with pytest.raises(BadRequest, match="printable ASCII"):
        client.cache_put(["a key"], [torch.ones(4)])
    with pytest.raises(BadRequest, match="namespace"):
        client.cache_exists(["a"], namespace="tab\there")
    with pytest.raises(BadRequest, match="2 keys but 1 pages"):
        client.cache_put(["a", "b"], [torch.ones(4)])
    # a batch over the cap, sent raw (the client library splits big batches itself)
    conn = raw_connection(daemon.socket)
    try:
        conn.send(p.encode(p.CacheExists(req=5, namespace="", keys=["k"] * 5000)))
        reply = p.decode(conn.receive(5.0))
        assert isinstance(reply, p.Error) and "at most 4096 keys" in reply.message
        # a reservation not committed within the lease ends (its blocks wait for its writer); its late
        # commit publishes nothing and lets go of them
        conn.send(p.encode(p.CachePut(req=6, namespace="", keys=["late"], pages=[["uint8", [4096]]])))
        late = p.decode(conn.receive(5.0))
        assert isinstance(late, p.CacheSlots) and late.slots[0]
        eventually(lambda: client.cache_stats()["expired_writes"] == 1, timeout=15)
        assert client.cache_stats()["writes_open"] == 1 and client.cache_stats()["parked_bytes"] == 4096
        conn.send(p.encode(p.CacheCommit(req=7, token=late.token)))
        assert p.decode(conn.receive(5.0)) == p.Ok(req=7, value=None)
        assert client.cache_stats()["writes_open"] == 0 and client.cache_stats()["parked_bytes"] == 0
        assert client.cache_exists(["late"]) == 0
        # one whose writer hangs up goes back at once
        conn.send(p.encode(p.CachePut(req=6, namespace="", keys=["orphan"], pages=[["uint8", [4096]]])))
        assert isinstance(p.decode(conn.receive(5.0)), p.CacheSlots)
        assert client.cache_stats()["writes_open"] == 1  # (well within its 3 s lease)
    finally:
        conn.close()
    eventually(lambda: client.cache_stats()["writes_open"] == 0)
    assert client.cache_exists(["orphan"]) == 0
    # the client splits a batch bigger than the daemon's cap
    keys = [f"n{i}" for i in range(5000)]
    assert client.cache_put(keys, [torch.zeros(1, dtype=torch.uint8)] * 5000, namespace="many") == [True] * 5000
    assert client.cache_exists(keys, namespace="many") == 5000
    out = torch.empty(4)
    assert client.cache_get(["keep"], [out]) == [True] and torch.equal(out, torch.ones(4))
    client.close()


def test_metrics_and_kvd_status_show_the_tier(daemons):
    port = free_port()
    daemon = daemons.start("A", extra=["--metrics-port", str(port), "--cache-size", "8MiB"])
    with daemon.client() as client:
        client.cache_put(["a", "b"], [torch.ones(4), torch.ones(4)], namespace="tenant=1")
        client.cache_get(["a", "z"], [torch.empty(4), torch.empty(4)], namespace="tenant=1")
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "kvd_cache_budget_bytes 8.388608e+06" in page
    assert "kvd_cache_hits_total 1.0" in page and "kvd_cache_misses_total 1.0" in page
    assert 'kvd_cache_namespace_entries{namespace="tenant=1"} 2.0' in page
    status = subprocess.run([sys.executable, "-m", "kvd", "status", "--socket", daemon.socket],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "kv tier    2 pages" in status.stdout and "1 hits, 1 misses" in status.stdout
    listing = subprocess.run([sys.executable, "-m", "kvd", "ls", "--socket", daemon.socket],
                             capture_output=True, text=True, timeout=60)
    assert "namespace 'tenant=1': 2 pages" in listing.stdout


def test_a_page_being_read_is_never_evicted_under_its_reader(daemons):
    daemon = daemons.start("A", pool_size="16MiB", extra=["--cache-size", "256KiB"])  # 4 pages of a block
    with daemon.client() as client:
        page = torch.arange(16 * KIB, dtype=torch.float32)
        assert client.cache_put(["pinned"], [page]) == [True]
        conn = raw_connection(daemon.socket)  # a reader that has its slots and is still copying
        try:
            conn.send(p.encode(p.CacheGet(req=1, namespace="", keys=["pinned"], sizes=[64 * KIB])))
            slots = p.decode(conn.receive(5.0))
            assert isinstance(slots, p.CacheSlots) and slots.slots[0] is not None
            for i in range(8):  # twice the budget of newer pages: only unpinned ones go
                client.cache_put([f"new{i}"], [torch.full((16 * KIB,), float(i))])
            assert client.cache_exists(["pinned"]) == 1
            assert client.cache_stats()["evictions"] == 5
            conn.send(p.encode(p.CacheRelease(req=2, token=slots.token)))
            eventually(lambda: client.cache_stats()["reads_open"] == 0)
        finally:
            conn.close()
        client.cache_put(["last"], [page])  # now the pinned page is the least recent, and unpinned
        assert client.cache_exists(["pinned"]) == 0
