"""GPU benchmark (needs a CUDA GPU and cupy): pool handoff against a plain device-to-device copy,
and a peer transfer between two GPU-pool daemons against the same transfer between host pools.

    python -m bench.gpu [--size-mib 256] [--output FILE]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from kvd.testing import DaemonFactory


def timed(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return sorted(samples)[len(samples) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu")
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    n = args.size_mib << 20
    gb = n / 1e9
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    rows = [f"GPU: {torch.cuda.get_device_name(0)}, {args.size_mib} MiB", "",
            "| case | GB/s | vs baseline |", "|---|---|---|"]
    d2d = timed(lambda: dst.copy_(src))
    rows.append(f"| device-to-device copy (baseline) | {gb / d2d:.1f} | |")
    with tempfile.TemporaryDirectory() as workdir:
        factory = DaemonFactory(Path(workdir), log_level="warning")
        try:
            pool = f"{2 * args.size_mib + 64}MiB"
            g1, g2 = factory.pair(pool_size=pool, extra=["--device", "cuda:0"])
            with g1.client() as c1, g2.client() as c2:
                put = timed(lambda: (c1.delete("x"), c1.put("x", {"x": src})))
                rows.append(f"| kvd local put (CUDA IPC) | {gb / put:.1f} | {d2d / put:.2f}x d2d |")
                get = timed(lambda: c1.get("x", out={"x": dst}, keep=True))
                rows.append(f"| kvd local get(out=) (CUDA IPC) | {gb / get:.1f} | {d2d / get:.2f}x d2d |")
                c1.delete("x")
                push = timed(lambda: (c2.delete("p"), c1.put("p", {"x": src}, dest="B")))
                assert torch.equal(c2.get("p", out={"x": dst})["x"], src)
            factory.stop_all()
            factory.daemons.clear()
            h1, h2 = factory.pair(pool_size=pool)
            host = src.cpu()
            with h1.client() as c1, h2.client() as c2:
                host_push = timed(lambda: (c2.delete("p"), c1.put("p", {"x": host}, dest="B")))
            rows.append(f"| kvd push GPU pool -> GPU pool | {gb / push:.2f} | {host_push / push:.2f}x host pools |")
            rows.append(f"| kvd push host pool -> host pool | {gb / host_push:.2f} | |")
        finally:
            factory.stop_all()
    report = "\n".join(rows)
    print(report)
    if args.output:
        args.output.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
