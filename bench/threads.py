"""Where the CPU goes: per-thread CPU of both daemons, per GB moved, for 256 MiB pushes and for
64 concurrent 4 MiB pushes from 4 processes (the two cases whose targets are CPU-bound here).

    python -m bench.threads [--rounds 4]

Reads utime+stime of every thread of each daemon from /proc before and after each round.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from kvd.testing.daemons import DaemonFactory

from . import baselines, cases
from .measure import thread_cpu

SIZE = 256 << 20


def per_gb(before: dict[str, float], after: dict[str, float], nbytes: int) -> dict[str, float]:
    return {name: round((after[name] - before.get(name, 0.0)) / (nbytes / 1e9), 2) for name in after
            if after[name] - before.get(name, 0.0) > 0.005}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    tcp = baselines.tcp_throughput(SIZE, 5).median
    print(f"raw TCP loopback 256MiB: {SIZE / tcp / 1e9:.2f} GB/s")
    with tempfile.TemporaryDirectory() as workdir:
        factory = DaemonFactory(Path(workdir), log_level="warning")
        a, b = factory.pair(pool_size="1GiB")
        try:
            data = torch.randint(0, 255, (SIZE,), dtype=torch.uint8)
            with a.client() as ca, b.client() as cb:
                ca.put("warm", {"x": data}, dest="B")
                cb.delete("warm")
                for i in range(args.rounds):
                    ta, tb, t0 = thread_cpu(a.pid), thread_cpu(b.pid), time.monotonic()
                    ca.put(f"r{i}", {"x": data}, dest="B")
                    elapsed = time.monotonic() - t0
                    cb.delete(f"r{i}")
                    print(f"push 256MiB: {SIZE / elapsed / 1e9:.2f} GB/s ({tcp / elapsed:.2f}x raw TCP); CPU-s/GB "
                          f"A {per_gb(ta, thread_cpu(a.pid), SIZE)} B {per_gb(tb, thread_cpu(b.pid), SIZE)}")
            cases.concurrent_pushes(a, b, processes=4, per_process=16, nbytes=4 << 20)  # warm
            for _ in range(args.rounds):
                ta, tb = thread_cpu(a.pid), thread_cpu(b.pid)
                aggregate, busy = cases.concurrent_pushes(a, b, processes=4, per_process=16, nbytes=4 << 20)
                print(f"64 x 4MiB pushes, 4 processes: {aggregate / 1e9:.2f} GB/s, machine {busy:.0%} busy "
                      f"({aggregate / SIZE * tcp:.2f}x raw TCP); CPU-s/GB A {per_gb(ta, thread_cpu(a.pid), SIZE)} "
                      f"B {per_gb(tb, thread_cpu(b.pid), SIZE)}")
        finally:
            factory.stop_all()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
