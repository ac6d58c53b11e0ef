"""The KV tier's disk level side by side (issue 43): `python -m bench --disk-tier`, or
`python -m bench.disk_tier [--quick]`.

On this machine's disk (a directory under the bench's temp dir) and on tmpfs (/dev/shm), in
alternating rounds, at 64 KiB, 512 KiB and 4 MiB pages:
- kvd's disk level, end to end: a batched cache_put of pages that all go to disk (timed until the
  disk has written them: the client's copy into the pool, then the write-behind in the daemon's
  worker threads), and a batched cache_get of the same pages from disk only (RAM pushed out by
  other pages first; the read into the pool, its checks, and the client's copy out). Per page: the
  daemon's own time for one page's file in a worker thread (open, I/O, digest), from cache_stats;
- a raw pwrite / pread of the same bytes, one file a page, one thread, into one buffer;
- "cold": on the machine's disk the page cache is dropped (sync, then POSIX_FADV_DONTNEED on every
  file) before each read, for kvd and raw alike; tmpfs has no other place to read from.
Then SGLang's HiCache `file` backend against kvd's backend with a disk level, the same host pool and
pages, reads from disk only (bench/sglang_tier.py's drivers), and the time from a daemon's start to
its first hit with 10,000 pages in its directory.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvd.testing.daemons import DaemonFactory, eventually, wait_ready

from .measure import human

SIZES = [64 << 10, 512 << 10, 4 << 20]
BATCH_BYTES = 16 << 20  # bytes per cache_put / cache_get batch
RAM = 64 << 20  # the RAM budget: what the gets read comes from disk only
Row = tuple[str, str, str, str, str, str]
Check = tuple[str, float, str, float, bool]


def media(workdir: Path) -> dict[str, Path]:
    shm = Path(tempfile.mkdtemp(prefix="kvd-disk-bench-", dir="/dev/shm"))
    return {"disk": workdir / "disk", "tmpfs": shm}


def drop_cache(directory: Path) -> None:
    """Written back, then out of the page cache: the next read goes to the device."""
    os.sync()
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def raw_round(directory: Path, nbytes: int, count: int, cold: bool) -> tuple[float, float, float]:
    """pwrite then pread `count` files of `nbytes`, one thread, into one buffer; and the same
    reads with a memcpy of each into another buffer after (a client's out): seconds of each."""
    directory.mkdir(parents=True, exist_ok=True)
    data, buf, out = os.urandom(nbytes), bytearray(nbytes), bytearray(nbytes)
    started = time.perf_counter()
    for i in range(count):
        fd = os.open(directory / f"raw-{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.pwrite(fd, data, 0)
        os.close(fd)
    write_s = time.perf_counter() - started
    times = []
    for copy in (False, True):
        if cold:
            drop_cache(directory)
        started = time.perf_counter()
        for i in range(count):
            fd = os.open(directory / f"raw-{i}", os.O_RDONLY)
            os.preadv(fd, [buf], 0)
            os.close(fd)
            if copy:
                out[:] = buf
        times.append(time.perf_counter() - started)
    assert bytes(buf) == data
    shutil.rmtree(directory)
    return write_s, times[0], times[1]


def worker_round(directory: Path, nbytes: int, count: int, cold: bool) -> tuple[float, float]:
    """The disk level's own page write and read, as its worker threads run them (page_files.write_page:
    digest, tmp file, rename; page_files.read_page: open, read into pool memory, header and digest
    checks), one thread, here: (write s, read s)."""
    import mmap

    from kvd.daemon.tier.disk import page_files
    from kvd.daemon.tier.disk.disk_format import Header

    root = directory / "tier"
    claimed = page_files.claim(str(root))
    data = os.urandom(nbytes)
    pool = mmap.mmap(-1, nbytes)
    view = memoryview(pool)
    try:
        started = time.perf_counter()
        for i in range(count):
            page_files.write_page(str(root), Header("bench", f"{i:064x}", "uint8", (nbytes,), nbytes, 0, 65536), [data])
        write_s = time.perf_counter() - started
        if cold:
            drop_cache(root)
        started = time.perf_counter()
        for i in range(count):
            page_files.read_page(str(root), "bench", f"{i:064x}", nbytes, [view])
        read_s = time.perf_counter() - started
        assert bytes(view) == data
    finally:
        view.release()
        pool.close()
        claimed.release()
        shutil.rmtree(directory)
    return write_s, read_s


def disk_stats(client) -> dict:
    return client.cache_stats()["media"]["disk"]


def settle(client) -> dict:
    def done() -> bool:
        d = disk_stats(client)
        return d["ready"] and not (d["unwritten"] or d["staged"] or d["writes_in_flight"] or d["writing"])
    eventually(done, timeout=600)
    return disk_stats(client)


def kvd_round(daemon, tier: Path, nbytes: int, count: int, round_no: int, cold: bool) -> dict:
    """Put `count` pages (all to disk), push RAM's out, get them from disk: seconds and per-page times."""
    batch = max(1, BATCH_BYTES // nbytes)
    namespace = f"bench;{nbytes};{round_no}"
    page = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    keys = [f"{round_no:02d}{i:062x}" for i in range(count)]
    with daemon.client() as client:
        before = disk_stats(client)
        started = time.perf_counter()
        for i in range(0, count, batch):
            assert all(client.cache_put(keys[i:i + batch], [page] * len(keys[i:i + batch]), namespace=namespace))
        settle(client)
        write_s = time.perf_counter() - started
        mid = disk_stats(client)
        filler = torch.zeros(1 << 20, dtype=torch.uint8)  # RAM's budget of other pages: ours on disk only
        fill = [f"fill{round_no}-{i}" for i in range(RAM >> 20)]
        for i in range(0, len(fill), 8):
            assert all(client.cache_put(fill[i:i + 8], [filler] * len(fill[i:i + 8]), namespace="filler"))
        settle(client)
        if cold:
            drop_cache(tier / "pages")
        ready = disk_stats(client)
        out = torch.empty(nbytes, dtype=torch.uint8)
        started = time.perf_counter()
        for i in range(0, count, batch):
            found = client.cache_get(keys[i:i + batch], [out] * len(keys[i:i + batch]), namespace=namespace)
            assert all(found), f"{found.count(False)} misses"
        read_s = time.perf_counter() - started
        after = disk_stats(client)
        assert torch.equal(out, page) and after["corrupt"] == before["corrupt"]
        assert after["hits"] - ready["hits"] == count, (after["hits"] - ready["hits"], count)
        client.cache_clear(namespace)
        client.cache_clear("filler")
    return {"write": write_s, "read": read_s,
            "write_page": (mid["write"]["sum_s"] - before["write"]["sum_s"]) / max(1, mid["write"]["count"]
                                                                                  - before["write"]["count"]),
            "read_page": (after["read"]["sum_s"] - ready["read"]["sum_s"]) / count}


def start(factory: DaemonFactory, name: str, tier: Path, extra: list[str] = (), wait: bool = True):
    return factory.start(name, pool_size="512MiB", wait=wait, extra=[
        "--cache-size", f"{RAM >> 20}MiB", "--cache-dir", str(tier), "--cache-disk-size", "2GiB", *extra])


def first_hit(factory: DaemonFactory, tier: Path, medium: str, pages: int = 10_000) -> dict[str, float]:
    """A daemon's start to its first hit with `pages` pages of 4 KiB in its directory (asking for the
    middle one over and over), its start to ready without a disk level beside it, and its scan."""
    small = ["--block-size", "4KiB"]
    daemon = start(factory, f"R{medium}", tier, small)
    keys = [f"{i:064x}" for i in range(pages)]
    page = torch.arange(1024, dtype=torch.float32)
    with daemon.client() as client:
        for i in range(0, pages, 1000):
            assert all(client.cache_put(keys[i:i + 1000], [page] * 1000, namespace="restart"))
        assert settle(client)["entries"] >= pages
    assert daemon.stop() == 0
    started = time.perf_counter()
    bare = factory.start(f"N{medium}", pool_size="512MiB", extra=["--cache-size", f"{RAM >> 20}MiB", *small])
    ready = time.perf_counter() - started
    bare.stop()
    out, probe = torch.empty(1024), keys[pages // 2]
    started = time.perf_counter()
    daemon = start(factory, f"R{medium}", tier, small, wait=False)
    wait_ready(daemon)
    with daemon.client() as client:
        while not client.cache_get([probe], [out], namespace="restart")[0]:
            time.sleep(0.005)
        hit = time.perf_counter() - started
        assert torch.equal(out, page)
        eventually(lambda: disk_stats(client)["ready"], timeout=300)
        scan = disk_stats(client)["scan_s"]
        client.cache_clear("restart")
    daemon.stop()
    return {"hit": hit, "ready": ready, "scan": scan}


def sglang_round(factory, sglang, medium: str, directory: Path, pages: int, cold: bool) -> dict[str, float]:
    """kvd's backend over a disk level against SGLang's file backend, both reading from `directory`'s medium."""
    from kvd.testing.sglang_pool import MHAHostPool

    from . import sglang_tier as st

    pool = MHAHostPool(layer_num=st.LAYERS, head_num=st.HEADS, head_dim=st.HEAD_DIM, page_size=st.PAGE_TOKENS,
                       pages=pages)
    pool.fill_random(seed=1)
    expected = st.digest(pool, pages)
    keys = [hashlib.sha256(f"page {i}".encode()).hexdigest() for i in range(pages)]
    indices = torch.arange(pages * st.PAGE_TOKENS)
    batch = sglang.STORAGE_BATCH_SIZE
    result = {}
    daemon = start(factory, f"S{medium}", directory / "kvd-tier", ["--cache-size", "80MiB"])
    files = directory / "sglang-file"
    files.mkdir(parents=True, exist_ok=True)
    try:
        for driver in (st.KvdDriver(sglang, daemon.socket, pool), st.FileDriver(sglang, str(files), pool)):
            driver.clear()
            page_tokens = pool.page_size
            for i in range(0, pages, batch):  # (kvd: each batch on disk before the next; a put that outruns
                # the disk loses its oldest pages past the staging's 64 MiB, and this measures reads)
                part = keys[i:i + batch]
                assert st.batched(driver, driver.put, part, indices[i * page_tokens:], batch, page_tokens) == len(part)
                if isinstance(driver, st.KvdDriver):
                    with daemon.client() as client:
                        settle(client)
            if isinstance(driver, st.KvdDriver):  # RAM's pages pushed out: the reads come from disk
                with daemon.client() as client:
                    filler = torch.zeros(1 << 20, dtype=torch.uint8)
                    for i in range(0, 96, 8):
                        client.cache_put([f"f{j}" for j in range(i, i + 8)], [filler] * 8, namespace="filler")
                    settle(client)
            if cold:
                drop_cache(directory)
            pool.kv_buffer.zero_()
            started = time.perf_counter()
            got = st.batched(driver, driver.get, keys, indices, batch, pool.page_size)
            result[driver.name.split()[0]] = time.perf_counter() - started
            assert got == pages and st.digest(pool, pages) == expected, (driver.name, got)
            driver.clear()
            driver.close()
    finally:
        daemon.stop()
    return result


def measure(quick: bool) -> dict:
    rounds = 1 if quick else 3
    total = (32 if quick else 128) << 20
    with tempfile.TemporaryDirectory(prefix="kvd-disk-bench-") as tmp:
        workdir = Path(tmp)
        where = media(workdir)
        factory = DaemonFactory(workdir, log_level="warning")
        samples: dict = {}
        try:
            daemons = {m: start(factory, m, path / "tier") for m, path in where.items()}
            for r in range(rounds):
                for medium in (list(where) if r % 2 == 0 else list(where)[::-1]):
                    for nbytes in SIZES:
                        count, cold = total // nbytes, medium == "disk"
                        sample = {"raw": raw_round(where[medium] / "raw", nbytes, count, cold),
                                  "worker": worker_round(where[medium] / "worker", nbytes, count, cold),
                                  "kvd": kvd_round(daemons[medium], where[medium] / "tier", nbytes, count, r, cold)}
                        samples.setdefault((medium, nbytes), []).append(sample)
            for d in daemons.values():
                d.stop()
            restart = {m: first_hit(factory, path / "restart", m) for m, path in where.items()}
            sglang: dict = {}
            try:
                from sglang.srt.mem_cache import hicache_storage
            except ImportError as exc:
                print(f"SGLang's file backend skipped: {exc}", file=sys.stderr)
            else:
                for r in range(rounds):
                    for medium, path in (where.items() if r % 2 == 0 else list(where.items())[::-1]):
                        got = sglang_round(factory, hicache_storage, medium, path / f"sglang{r}",
                                           100 if quick else 400, medium == "disk")
                        sglang.setdefault(medium, []).append(got)
        finally:
            factory.stop_all()
            shutil.rmtree(where["tmpfs"], ignore_errors=True)
    return {"samples": samples, "restart": restart, "sglang": sglang, "total": total, "rounds": rounds}


def section(quick: bool) -> tuple[list[Row], list[Check], list[str]]:
    run = measure(quick)
    rows: list[Row] = []
    checks: list[Check] = []
    total = run["total"]

    def rate(seconds: float) -> str:
        return f"{total / seconds / 1e9:.2f}"

    lines = ["", f"Disk level side by side (bench/disk_tier.py; {human(total)} of pages per size and round, median of "
             f"{run['rounds']} alternating rounds; 'disk' is this machine's, its page cache dropped before each read; "
             f"load average {os.getloadavg()[0]:.1f} at the end). GB/s; 'page' rows: the disk level's own page file "
             "write and read as its worker threads run them, one thread; 'cache_*': end to end through a daemon "
             "(4 read threads, 2 write threads, the client's copy into or out of the pool); raw: one thread, one "
             "buffer (+copy: and a memcpy of each page after, as a client's out).", "",
             "| medium | page | raw pwrite | page write | cache_put to disk | raw pread | page read "
             "| page read / pread | raw pread+copy | cache_get from disk | get / pread | get / (pread+copy) "
             "| us/page: write, read, get |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (medium, nbytes), runs in run["samples"].items():
        def med(key: str, i: int | str, runs: list = runs) -> float:
            return statistics.median(r[key][i] for r in runs)

        raw_w, raw_r, raw_rc = med("raw", 0), med("raw", 1), med("raw", 2)
        page_w, page_r = med("worker", 0), med("worker", 1)
        put, got = med("kvd", "write"), med("kvd", "read")
        count = total // nbytes
        lines.append(f"| {medium} | {human(nbytes)} | {rate(raw_w)} | {rate(page_w)} | {rate(put)} | {rate(raw_r)} | "
                     f"{rate(page_r)} | {raw_r / page_r:.2f}x | {rate(raw_rc)} | {rate(got)} | {raw_r / got:.2f}x | "
                     f"{raw_rc / got:.2f}x | {page_w / count * 1e6:.0f}, {page_r / count * 1e6:.0f}, "
                     f"{got / count * 1e6:.0f} |")
        rows.append((f"disk level page read (1 thread), {medium}", human(nbytes), rate(page_r),
                     f"{page_r / count * 1e3:.3f}", "", f"{raw_r / page_r:.2f}x raw pread"))
        rows.append((f"kvd cache_get from disk, {medium}", human(nbytes), rate(got), f"{got / count * 1e3:.3f}", "",
                     f"{raw_r / got:.2f}x raw pread, {raw_rc / got:.2f}x pread+copy"))
        rows.append((f"kvd cache_put to disk, {medium}", human(nbytes), rate(put), f"{put / count * 1e3:.3f}", "",
                     f"{raw_w / put:.2f}x raw pwrite"))
        if nbytes >= 512 << 10:
            ratio = raw_r / page_r
            checks.append((f"disk level page read {human(nbytes)} on {medium} vs raw pread", ratio, ">=", 0.8,
                           ratio >= 0.8))
    lines.append("")
    for medium, t in run["restart"].items():
        lines.append(f"Restart to first hit, 10,000 pages of 4 KiB on {medium}: {t['hit']:.2f} s (a daemon without a "
                     f"disk level starts to ready in {t['ready']:.2f} s here; the scan of the directory took "
                     f"{t['scan']:.2f} s, pages found by name meanwhile)")
        checks.append((f"restart to first hit, 10,000 pages, {medium} (s)", t["hit"], "<=", 2.0, t["hit"] <= 2.0))
    for medium, results in run["sglang"].items():
        kvd = statistics.median(r["kvd"] for r in results)
        file = statistics.median(r["file"] for r in results)
        lines.append(f"SGLang HiCache batch_get from {medium}, 512 KiB pages: kvd (disk level) {kvd:.3f} s, file "
                     f"backend {file:.3f} s: kvd {file / kvd:.2f}x as fast (rounds: "
                     + ", ".join(f"{r['file'] / r['kvd']:.2f}x" for r in results) + ")")
        checks.append((f"SGLang get from {medium}: kvd disk level vs file backend", file / kvd, ">=", 1.0,
                       file / kvd >= 1.0))
    return rows, checks, lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.disk_tier", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32 MiB a size, one round")
    args = parser.parse_args(argv)
    _rows, checks, lines = section(args.quick)
    print("\n".join(lines))
    for name, value, op, limit, ok in checks:
        print(f"{name}: {value:.2f} {op} {limit}: {'PASS' if ok else 'FAIL'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
