"""What a KV tier page costs (the benchmark's process, with one daemon): batched cache_put and
cache_get of N pages through kvd.Client, per page and in GB/s, for 64 KiB and 512 KiB pages in
alternating rounds in one run; and the leading-hit cache_exists over the same keys.

    python -m bench.kv_tier                 # 1,000 pages each, 3 rounds
    python -m bench.kv_tier --pages 2000 --rounds 5

A put is two messages per batch (reserve, commit) and one copy per page into the pool; a get
one message (and a release without reply) and one copy out, into preallocated tensors.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvd.testing.daemons import DaemonFactory

SIZES = [64 << 10, 512 << 10]


def one_round(client, nbytes: int, pages: int, round_no: int) -> dict:
    """One batch put, get and exists of `pages` pages. The batch is one page tensor repeated under
    distinct keys, and one out tensor for every key (each page still copied once each way): only
    the pool holds the batch's bytes, so the run fits a small host. A sample is checked bit-exact."""
    namespace = f"bench;size={nbytes};round={round_no}"
    page = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    out = torch.empty(nbytes, dtype=torch.uint8)
    keys = [f"{round_no:02d}{i:062x}" for i in range(pages)]  # 64 hex chars, like SGLang's SHA-256 keys
    t0 = time.perf_counter()
    stored = client.cache_put(keys, [page] * pages, namespace=namespace)
    t1 = time.perf_counter()
    found = client.cache_get(keys, [out] * pages, namespace=namespace)
    t2 = time.perf_counter()
    hits = client.cache_exists(keys, namespace=namespace)
    t3 = time.perf_counter()
    assert all(stored) and all(found) and hits == pages, (sum(stored), sum(found), hits)
    check = torch.zeros(nbytes, dtype=torch.uint8)
    assert client.cache_get(keys[pages // 2:pages // 2 + 1], [check], namespace=namespace) == [True]
    assert torch.equal(check, page)
    client.cache_clear(namespace)
    return {"put": t1 - t0, "get": t2 - t1, "exists": t3 - t2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    pool = max(SIZES) * args.pages * 10 // 9 + (64 << 20)
    with tempfile.TemporaryDirectory() as tmp:
        factory = DaemonFactory(Path(tmp), log_level="warning")
        daemon = factory.start("A", pool_size=str(pool), extra=["--cache-size", "0.9"])
        try:
            results: dict[int, list[dict]] = {size: [] for size in SIZES}
            with daemon.client() as client:
                one_round(client, SIZES[0], 50, 99)  # warm up (the pool's pages, the code paths)
                for r in range(args.rounds):
                    for size in SIZES:  # alternating: A, B, A, B, ...
                        results[size].append(one_round(client, size, args.pages, r))
        finally:
            factory.stop_all()
    print(f"load average {os.getloadavg()[0]:.1f}; {args.pages} pages a batch, {args.rounds} rounds (median)")
    print(f"{'page':>8} {'put us/page':>12} {'put GB/s':>9} {'get us/page':>12} {'get GB/s':>9} {'exists us/key':>14}")
    for size, rounds in results.items():
        put = statistics.median(r["put"] for r in rounds)
        get = statistics.median(r["get"] for r in rounds)
        exists = statistics.median(r["exists"] for r in rounds)
        total = size * args.pages
        print(f"{size >> 10:>6}Ki {put / args.pages * 1e6:>12.1f} {total / put / 1e9:>9.2f} "
              f"{get / args.pages * 1e6:>12.1f} {total / get / 1e9:>9.2f} {exists / args.pages * 1e6:>14.2f}")


if __name__ == "__main__":
    main()
