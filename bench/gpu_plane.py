"""The NIXL plane between two GPU-pool daemons on one GPU (needs a CUDA GPU, cupy and NIXL): each pool
registered as VRAM, so UCX moves the bytes GPU to GPU (`cuda_ipc`, `cuda_copy`). Pushes 16 MiB-1 GiB
bit-exact against one device-to-device copy, and says which UCX protocols the daemons' UCX chose
(UCX_PROTO_INFO=y: its tables land in the daemons' logs).

    python -m bench.gpu_plane [--sizes-mib 16,256,1024] [--output FILE]
"""
from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

import torch

from kvd.testing.daemons import DaemonFactory, free_port, wait_ready


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", default="16,256,1024")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    pool = f"{max(sizes) * 2 + 64}MiB"
    factory = DaemonFactory(Path(tempfile.mkdtemp(prefix="kvd-gpu-plane-")), log_level="info")
    env = {"UCX_PROTO_INFO": "y"}
    port_a, port_b = free_port(), free_port()
    flags = ["--device", "cuda:0", "--data-plane", "nixl"]
    a = factory.start("A", port=port_a, pool_size=pool, extra=flags, env=env, wait=False,
                      peers={"B": f"tcp://127.0.0.1:{port_b}"})
    b = factory.start("B", port=port_b, pool_size=pool, extra=flags, env=env,
                      peers={"A": f"tcp://127.0.0.1:{port_a}"})
    lines = ["| size | d2d copy GB/s | kvd push over NIXL GB/s | push / d2d |", "|---|---|---|---|"]
    try:
        wait_ready(a)
        with a.client() as ca, b.client() as cb:
            for mib in sizes:
                n = mib << 20
                src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
                dst = torch.empty_like(src)
                dst.copy_(src)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                dst.copy_(src)
                torch.cuda.synchronize()
                d2d = time.perf_counter() - t0
                pushes = []
                for i in range(3):
                    t0 = time.perf_counter()
                    ca.put(f"p{mib}-{i}", {"x": src}, dest="B")
                    pushes.append(time.perf_counter() - t0)
                    got = cb.get(f"p{mib}-{i}", timeout=60)["x"]
                    assert torch.equal(got.to(src.device), src), f"{mib} MiB: bytes differ"
                push = sorted(pushes)[1]
                lines.append(f"| {mib} MiB | {n / d2d / 1e9:.1f} | {n / push / 1e9:.1f} | {d2d / push:.2f}x |")
            lines.append(f"\nplane: A {ca.stats()['plane']}\n")
    finally:
        factory.stop_all()
    protocols = sorted({m.group(0) for d in (a, b) for m in re.finditer(r"(cuda_ipc|cuda_copy|gdr_copy|rc_mlx5|"
                                                                         r"rc_verbs|tcp|cma|posix|sysv)/\S+", d.log())})
    lines.append(f"UCX transports named in the daemons' protocol tables: {', '.join(protocols) or 'none'}")
    report = "\n".join(lines)
    print(report)
    if args.output:
        args.output.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
