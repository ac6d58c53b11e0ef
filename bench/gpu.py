"""GPU benchmark (needs a CUDA GPU and cupy): pool handoff against a plain device-to-device copy,
paged gather/scatter (put_blocks/get_blocks) against torch's own index_select/index_copy_, and a
peer transfer between two GPU-pool daemons against the same transfer between host pools.

    python -m bench.gpu [--sizes-mib 1,256,1024,4096] [--push-mib 1024] [--output FILE]

Each section runs on its own: one that fails prints its error and its daemons' log tails, and
the others still report (device time is scarce: one run must say as much as it can).
"""
from __future__ import annotations

import argparse
import tempfile
import time
import traceback
from pathlib import Path

import torch

from kvd.testing.daemons import DaemonFactory


def timed(fn, repeats: int = 5, setup=None) -> float:
    """Median seconds of fn(), synchronized; setup() runs before each call, untimed (a delete that
    makes room for the next put must not count against kvd beside a bare copy)."""
    if setup is not None:
        setup()
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return sorted(samples)[len(samples) // 2]


def rate(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.1f}"


def handoff_rows(client, mib: int) -> list[str]:
    """Local put and get(out=) through the pool's CUDA IPC mapping against one d2d copy."""
    n = mib << 20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    d2d = timed(lambda: dst.copy_(src))
    put = timed(lambda: client.put("x", {"x": src}), setup=lambda: client.delete("x"))
    get = timed(lambda: client.get("x", out={"x": dst}, keep=True))
    client.delete("x")
    assert torch.equal(dst, src)
    return [f"| {mib} MiB: device-to-device copy (baseline) | {rate(n, d2d)} | {d2d * 1e3:.3f} ms |",
            f"| {mib} MiB: kvd local put (CUDA IPC) | {rate(n, put)} | {d2d / put:.2f}x d2d, {put * 1e3:.3f} ms |",
            f"| {mib} MiB: kvd local get(out=) (CUDA IPC) | {rate(n, get)} | {d2d / get:.2f}x d2d, "
            f"{get * 1e3:.3f} ms |"]


def paged_rows(client, mib: int) -> list[str]:
    """A vLLM-shaped paged cache (K and V per layer, [blocks, 16 tokens, 8 heads, 128] bf16), one
    request's scattered blocks worth `mib` in all: kvd's gather into the pool and scatter out of
    it, against the same index_select / index_copy_ between two tensors of one process."""
    layers, shape = 16, (16, 8, 128)
    block_bytes = 2 * layers * 2 * 16 * 8 * 128
    count = max(1, (mib << 20) // block_bytes)
    caches = {f"{kind}{i}": torch.randn(4 * count, *shape, device="cuda", dtype=torch.bfloat16)
              for i in range(layers) for kind in "kv"}
    targets = {name: torch.zeros_like(t) for name, t in caches.items()}
    ids = torch.randperm(4 * count, device="cuda")[:count]
    id_list = ids.tolist()
    staged = {name: torch.empty(count, *shape, device="cuda", dtype=torch.bfloat16) for name in caches}
    moved = count * block_bytes

    def torch_gather():
        for name, t in caches.items():
            torch.index_select(t, 0, ids, out=staged[name])

    def torch_scatter():
        for name, t in targets.items():
            t.index_copy_(0, ids, staged[name])

    gather = timed(torch_gather)
    scatter = timed(torch_scatter)
    put = timed(lambda: client.put_blocks("paged", caches, id_list), setup=lambda: client.delete("paged"))
    get = timed(lambda: client.get_blocks("paged", targets, id_list, keep=True))
    client.delete("paged")
    for name in caches:
        assert torch.equal(targets[name][ids].view(torch.int16), caches[name][ids].view(torch.int16))
    title = f"{count} blocks x {2 * layers} tensors, {moved / 1e6:.0f} MB"
    return [f"| paged, {title}: torch index_select gather (baseline) | {rate(moved, gather)} | |",
            f"| paged: kvd put_blocks (gather into the pool) | {rate(moved, put)} | {gather / put:.2f}x index_select |",
            f"| paged: torch index_copy_ scatter (baseline) | {rate(moved, scatter)} | |",
            f"| paged: kvd get_blocks (scatter from the pool) | {rate(moved, get)} | "
            f"{scatter / get:.2f}x index_copy_ |"]


def push_seconds(pair, src: torch.Tensor, out: torch.Tensor | None) -> float:
    a, b = pair
    with a.client() as ca, b.client() as cb:
        seconds = timed(lambda: ca.put("p", {"x": src}, dest="B"), setup=lambda: cb.delete("p"))
        got = cb.get("p", out={"x": out} if out is not None else None)["x"]
        assert torch.equal(got.to(src.device), src)
    return seconds


def section(rows: list[str], name: str, factory: DaemonFactory, fn) -> None:
    try:
        rows += fn()
    except Exception:  # report and go on: the other sections still say something
        print(f"--- section {name} FAILED:\n{traceback.format_exc()}")
        for d in factory.daemons:
            print(f"--- daemon {d.node_id} log tail:\n{d.log()[-3000:]}")
        rows.append(f"| {name} | FAILED | see the log |")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu")
    parser.add_argument("--sizes-mib", default="1,256,1024,4096", help="handoff sizes, comma-separated")
    parser.add_argument("--paged-mib", type=int, default=1024)
    parser.add_argument("--push-mib", type=int, default=1024)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    props = torch.cuda.get_device_properties(0)
    rows = [f"GPU: {props.name}, {props.total_memory >> 30} GiB, torch {torch.__version__} (CUDA {torch.version.cuda})",
            "", "| case | GB/s | vs baseline |", "|---|---|---|"]
    biggest = max([*sizes, args.paged_mib, args.push_mib])
    pool = f"{2 * biggest + 64}MiB"
    with tempfile.TemporaryDirectory() as workdir:
        factory = DaemonFactory(Path(workdir), log_level="info")
        try:
            gpu_pair = factory.pair(pool_size=pool, extra=["--device", "cuda:0"])
            with gpu_pair[0].client() as c1:
                assert c1.info.device == "cuda:0", c1.info
                for mib in sizes:
                    section(rows, f"handoff {mib} MiB", factory, lambda mib=mib: handoff_rows(c1, mib))
                section(rows, "paged", factory, lambda: paged_rows(c1, args.paged_mib))
            src = torch.randint(0, 256, (args.push_mib << 20,), dtype=torch.uint8, device="cuda")
            pushes: dict[str, float] = {}

            def gpu_push() -> list[str]:
                pushes["gpu"] = push_seconds(gpu_pair, src, torch.empty_like(src))
                return []

            section(rows, "push GPU pool -> GPU pool", factory, gpu_push)
            factory.stop_all()
            factory.daemons.clear()
            host_pair = factory.pair(pool_size=f"{2 * args.push_mib + 64}MiB")  # (only the push runs there)

            def host_push() -> list[str]:
                pushes["host"] = push_seconds(host_pair, src.cpu(), None)
                return []

            section(rows, "push host pool -> host pool", factory, host_push)
            n = args.push_mib << 20
            if "gpu" in pushes:
                ratio = f"{pushes['host'] / pushes['gpu']:.2f}x host pools" if "host" in pushes else ""
                rows.append(f"| {args.push_mib} MiB: kvd push GPU pool -> GPU pool | {rate(n, pushes['gpu'])} "
                            f"| {ratio} |")
            if "host" in pushes:
                rows.append(f"| {args.push_mib} MiB: kvd push host pool -> host pool | {rate(n, pushes['host'])} | |")
        except Exception:
            for d in factory.daemons:
                print(f"--- daemon {d.node_id} log tail:\n{d.log()[-3000:]}")
            raise
        finally:
            factory.stop_all()
    report = "\n".join(rows)
    print(report)
    if args.output:
        args.output.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
