"""The tier's accounting cannot be escaped (issue 39, item 2): every page costs a pool block at least
and a place in the page counts, so a flood of empty or tiny pages, from a local client or through
another node, leaves the daemon's memory bounded."""
from __future__ import annotations

from pathlib import Path

import torch

FLOOD_PUTS, BATCH = 60, 4096


def anon_rss(pid: int) -> int:
    """The daemon's own memory (RssAnon: not the shared pool, which a prefault counts as RSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no RssAnon in /proc/PID/status")


def flood(client, page: torch.Tensor, namespace: str = "flood") -> None:
    for n in range(FLOOD_PUTS):
        keys = [f"p{n}-{i}" for i in range(BATCH)]
        client.cache_put(keys, [page] * BATCH, namespace=namespace)


def test_a_flood_of_empty_pages_is_held_to_the_budget(daemons):
    daemon = daemons.start("A", pool_size="16MiB", extra=["--cache-size", "1MiB"])
    with daemon.client() as c:
        c.cache_put(["warm"], [torch.ones(4)])  # (the first batch's one-off allocations before the baseline)
        before = anon_rss(daemon.pid)
        flood(c, torch.empty(0, dtype=torch.uint8))
        stats = c.cache_stats()
        grown = anon_rss(daemon.pid) - before
        print(f"{FLOOD_PUTS * BATCH} empty pages put: {stats['entries']} held, daemon memory +{grown >> 20} MiB")
        assert stats["entries"] <= 16 and stats["used_bytes"] <= 1 << 20  # 1 MiB of 64 KiB blocks
        assert grown < 48 << 20, f"the daemon grew by {grown >> 20} MiB"  # (was +207 MiB, 245,760 entries)
        assert c.cache_put(["after"], [torch.ones(4)]) == [True]  # and the tier still works


def test_a_flood_of_tiny_pages_is_held_to_the_page_count(daemons):
    daemon = daemons.start("A", pool_size="256MiB", extra=["--block-size", "4KiB", "--cache-size", "1",
                                                           "--cache-max-pages", "10000", "--pool-overcommit"])
    with daemon.client() as c:
        c.cache_put(["warm"], [torch.ones(4)])
        before = anon_rss(daemon.pid)
        flood(c, torch.ones(1, dtype=torch.uint8))
        stats = c.cache_stats()
        grown = anon_rss(daemon.pid) - before
        print(f"{FLOOD_PUTS * BATCH} one-byte pages put: {stats['entries']} held, daemon memory +{grown >> 20} MiB")
        assert stats["entries"] == 10000 and stats["max_pages"] == 10000
        assert grown < 64 << 20, f"the daemon grew by {grown >> 20} MiB"


def test_a_namespace_at_its_cap_leaves_the_others_alone(daemons):
    daemon = daemons.start("A", pool_size="64MiB", extra=["--block-size", "4KiB", "--cache-size", "1",
                                                          "--cache-namespace-pages", "1000"])
    with daemon.client() as c:
        keep = [torch.full((16,), i, dtype=torch.uint8) for i in range(100)]
        assert c.cache_put([f"k{i}" for i in range(100)], keep, namespace="tenant-a") == [True] * 100
        for n in range(10):  # tenant b floods its own namespace
            c.cache_put([f"b{n}-{i}" for i in range(1000)], [torch.ones(1, dtype=torch.uint8)] * 1000,
                        namespace="tenant-b")
        assert c.cache_stats("tenant-b")["entries"] == 1000
        outs = [torch.empty(16, dtype=torch.uint8) for _ in range(100)]
        assert c.cache_get([f"k{i}" for i in range(100)], outs, namespace="tenant-a") == [True] * 100
        assert all(torch.equal(o, k) for o, k in zip(outs, keep))
