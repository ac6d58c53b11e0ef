"""SGLang HiCache L3 backends side by side (issue 32 item 4): kvd's KvdHiCacheStorage against
SGLang's own `file` backend (HiCacheFile) on tmpfs, on the same host pool, in alternating rounds.

    python -m bench.sglang_tier            # 2,000 pages of 512 KiB, 3 rounds each
    python -m bench.sglang_tier --quick    # 400 pages, 2 rounds

Each backend is driven as SGLang's HiCacheController drives it, in batches of STORAGE_BATCH_SIZE
(128) pages: kvd through the zero-copy v1 path it is attached with (`interface_v1`: batch_set_v1,
batch_get_v1 between host-pool page views and kvd's pool, one copy each way); `file` through the
generic path SGLang uses for it (get_data_page -> batch_set; batch_get into dummy flat pages ->
set_from_flat_data_page). Every round starts from an empty store, writes all pages, reads them all
into the zeroed host pool and checks every byte against a digest taken before.

Also: batch_exists of 10,000 keys that all hit (one call, and SGLang's batches of 128), and one
page's set and get alone. The host pool is kvd.testing.sglang_pool.MHAHostPool, page_first,
bf16 (SGLang's own class needs torchvision to import; see kvd/testing/sglang_pool.py).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvd.testing.daemons import DaemonFactory
from kvd.testing.sglang_pool import MHAHostPool

PAGE_TOKENS = 32
LAYERS, HEADS, HEAD_DIM = 16, 2, 128  # 2 x 16 x 32 x 2 x 128 x 2 B = 512 KiB a page
EXISTS_KEYS = 10_000
SMALL = dict(layer_num=1, head_num=1, head_dim=64)  # 8 KiB pages for the 10,000-key exists


def config(hicache_storage, extra: dict, model: str = "bench/model"):
    return hicache_storage.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name=model, extra_config=extra)


class KvdDriver:
    """kvd's backend as SGLang attaches it (dynamic, interface_v1): the v1 path."""

    name = "kvd (v1)"

    def __init__(self, sglang, socket: str, pool: MHAHostPool) -> None:
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        extra = {"backend_name": "kvd", "module_path": "kvd.integrations.sglang", "class_name": "KvdHiCacheStorage",
                 "interface_v1": 1, "kvd_socket": socket}
        self.backend = StorageBackendFactory.create_backend("dynamic", config(sglang, extra), pool)
        self.backend.register_mem_pool_host(pool)
        self.pool = pool

    def put(self, keys, indices) -> bool:
        return all(self.backend.batch_set_v1(keys, indices))

    def get(self, keys, indices) -> int:
        return sum(self.backend.batch_get_v1(keys, indices))

    def exists(self, keys) -> int:
        return self.backend.batch_exists(keys)

    def clear(self) -> None:
        self.backend.clear()

    def close(self) -> None:
        self.backend.close()


class FileDriver:
    """SGLang's HiCacheFile on tmpfs, through the generic path HiCacheController uses for it."""

    name = "file (tmpfs)"

    def __init__(self, sglang, directory: str, pool: MHAHostPool) -> None:
        self.backend = sglang.HiCacheFile(config(sglang, {"file_storage_path": directory}))
        self.backend.register_mem_pool_host(pool)
        self.pool = pool

    def put(self, keys, indices) -> bool:  # HiCacheController._generic_page_set
        data = [self.pool.get_data_page(int(indices[i * self.pool.page_size])) for i in range(len(keys))]
        return self.backend.batch_set(keys, data)

    def get(self, keys, indices) -> int:  # HiCacheController._generic_page_get
        dummies = [self.pool.get_dummy_flat_data_page() for _ in keys]
        pages = self.backend.batch_get(keys, dummies)
        count = 0
        for i, page in enumerate(pages):
            if page is None:
                break
            self.pool.set_from_flat_data_page(int(indices[i * self.pool.page_size]), page)
            count += 1
        return count

    def exists(self, keys) -> int:
        return self.backend.batch_exists(keys)

    def clear(self) -> None:
        self.backend.clear()

    def close(self) -> None:
        pass


def digest(pool: MHAHostPool, pages: int) -> str:
    # page_first: the first `pages` pages are kv_buffer[:, :pages * page_size] (K and V halves)
    h = hashlib.blake2b(digest_size=16)
    for half in pool.kv_buffer[:, :pages * pool.page_size]:
        h.update(half.contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def batched(driver, op, keys, indices, batch: int, page: int):
    ok = 0
    for i in range(0, len(keys), batch):
        result = op(keys[i:i + batch], indices[i * page:(i + batch) * page])
        ok += len(keys[i:i + batch]) if result is True else int(result)
    return ok


def one_round(driver, keys, indices, pool, batch, expected) -> dict:
    driver.clear()
    page = pool.page_size
    started = time.perf_counter()
    stored = batched(driver, driver.put, keys, indices, batch, page)
    put_s = time.perf_counter() - started
    pool.kv_buffer.zero_()
    started = time.perf_counter()
    got = batched(driver, driver.get, keys, indices, batch, page)
    get_s = time.perf_counter() - started
    if stored != len(keys) or got != len(keys) or digest(pool, len(keys)) != expected:
        raise SystemExit(f"{driver.name}: stored {stored}, read {got} of {len(keys)} pages, bytes "
                         f"{'equal' if digest(pool, len(keys)) == expected else 'DIFFERENT'}")
    return {"put": put_s, "get": get_s}


def single_page(driver, key, index, repeats: int) -> tuple[float, float]:
    puts, gets = [], []
    for _ in range(repeats):
        driver.clear()
        started = time.perf_counter()
        driver.put([key], index)
        puts.append(time.perf_counter() - started)
        started = time.perf_counter()
        driver.get([key], index)
        gets.append(time.perf_counter() - started)
    return statistics.median(puts), statistics.median(gets)


def exists_round(driver, keys, batch) -> tuple[float, float]:
    started = time.perf_counter()
    assert driver.exists(keys) == len(keys), driver.name
    whole = time.perf_counter() - started
    started = time.perf_counter()
    for i in range(0, len(keys), batch):
        assert driver.exists(keys[i:i + batch]) == len(keys[i:i + batch])
    return whole, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sglang_tier", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="400 pages, 2 rounds")
    parser.add_argument("--pages", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    pages = args.pages or (400 if args.quick else 2000)
    rounds = args.rounds or (2 if args.quick else 3)
    from sglang.srt.mem_cache import hicache_storage as sglang

    batch = sglang.STORAGE_BATCH_SIZE
    pool = MHAHostPool(layer_num=LAYERS, head_num=HEADS, head_dim=HEAD_DIM, page_size=PAGE_TOKENS, pages=pages)
    page_bytes = pool.get_data_page(0).numel() * pool.dtype.itemsize
    pool.fill_random(seed=1)
    expected = digest(pool, pages)
    keys = [hashlib.sha256(f"page {i}".encode()).hexdigest() for i in range(pages)]
    indices = torch.arange(pages * PAGE_TOKENS)
    load = os.getloadavg()[0]
    print(f"{pages} pages of {page_bytes >> 10} KiB ({pages * page_bytes / 2**30:.2f} GiB), batches of {batch}, "
          f"{rounds} alternating rounds; load {load:.1f} on {os.cpu_count()} CPUs", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="kvd-sglang-bench-"))
    shm = tempfile.mkdtemp(prefix="kvd-sglang-file-", dir="/dev/shm")
    factory = DaemonFactory(workdir, log_level="warning")
    pool_mib = (pages * page_bytes >> 20) + 64
    try:
        daemon = factory.start("A", pool_size=f"{pool_mib}MiB", extra=["--cache-size", "1.0"])
        drivers = [KvdDriver(sglang, daemon.socket, pool), FileDriver(sglang, shm, pool)]
        samples: dict[str, list[dict]] = {d.name: [] for d in drivers}
        for r in range(rounds):
            for driver in (drivers if r % 2 == 0 else drivers[::-1]):
                samples[driver.name].append(one_round(driver, keys, indices, pool, batch, expected))
        single = {d.name: single_page(d, keys[0], indices[:PAGE_TOKENS], 50) for d in drivers}
        for d in drivers:
            d.clear()
        # 10,000 small pages, on a daemon of small blocks (a tier page takes whole blocks: 64 KiB by default)
        small_daemon = factory.start("B", pool_size="128MiB", extra=["--cache-size", "1.0", "--block-size", "8KiB"])
        small_pool = MHAHostPool(**SMALL, page_size=PAGE_TOKENS, pages=EXISTS_KEYS)
        small_keys = [hashlib.sha256(f"small {i}".encode()).hexdigest() for i in range(EXISTS_KEYS)]
        small = [KvdDriver(sglang, small_daemon.socket, small_pool), FileDriver(sglang, shm, small_pool)]
        small_indices = torch.arange(EXISTS_KEYS * PAGE_TOKENS)
        for d in small:
            assert batched(d, d.put, small_keys, small_indices, batch, PAGE_TOKENS) == EXISTS_KEYS
        exists = {d.name: [exists_round(d, small_keys, batch) for _ in range(3)] for d in small}
        for d in drivers + small:
            d.close()
    finally:
        factory.stop_all()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)

    total = pages * page_bytes
    print(f"\n| backend | batch_set GB/s | batch_get GB/s | set µs/page | get µs/page | 1-page set µs | "
          f"1-page get µs | exists 10k keys ms (one call / batches of {batch}) |")
    print("|---|---|---|---|---|---|---|---|")
    medians = {}
    for name, rs in samples.items():
        put = statistics.median(s["put"] for s in rs)
        get = statistics.median(s["get"] for s in rs)
        medians[name] = (put, get)
        whole = statistics.median(e[0] for e in exists[name])
        split = statistics.median(e[1] for e in exists[name])
        print(f"| {name} | {total / put / 1e9:.2f} | {total / get / 1e9:.2f} | {put / pages * 1e6:.0f} | "
              f"{get / pages * 1e6:.0f} | {single[name][0] * 1e6:.0f} | {single[name][1] * 1e6:.0f} | "
              f"{whole * 1e3:.1f} / {split * 1e3:.1f} |")
    (kp, kg), (fp, fg) = medians["kvd (v1)"], medians["file (tmpfs)"]
    print(f"\nkvd / file: batch_set {fp / kp:.2f}x, batch_get {fg / kg:.2f}x as fast "
          f"(median of {rounds} rounds each; every page checked bit-exact); load {os.getloadavg()[0]:.1f} after")
    for name, rs in samples.items():
        print(f"  {name} rounds: set " + ", ".join(f"{total / s['put'] / 1e9:.2f}" for s in rs) +
              " GB/s; get " + ", ".join(f"{total / s['get'] / 1e9:.2f}" for s in rs) + " GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
