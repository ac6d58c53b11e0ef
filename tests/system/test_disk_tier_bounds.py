"""The disk level's bounds on real daemons: a full disk (a small tmpfs) refuses spills and the daemon
works on; the disk budget holds under a flood; /healthz and RAM hits stay fast while the disk is
saturated; a directory that is not the daemon's alone is refused at start; in a cluster a home
answers other nodes from its disk, and their clear clears it; SGLang's backend sees disk hits as hits."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch

from kvd.client.connection import ask
from kvd.daemon.tier.disk.disk_format import disk_bytes
from kvd.testing.daemons import eventually, free_port
from kvd.wire import protocol as p
from tests.cluster.conftest import start_or_skip
from tests.cluster.servers import stop_server
from tests.system.test_disk_tier import BLOCK, ONE_BLOCK, disk_of, exact, flags, get, pages_for, put, settled


def mount_tmpfs(directory: Path, size: str) -> None:
    """A tmpfs of its own (root only): a disk that fills up, and whose use statvfs tells at once."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    directory.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(directory)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


def used(directory: Path) -> int:
    st = os.statvfs(directory)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@pytest.fixture
def tmpfs(tmp_path):
    mounted = []

    def mount(size: str) -> Path:
        directory = tmp_path / f"tmpfs{len(mounted)}"
        mount_tmpfs(directory, size)
        mounted.append(directory)
        return directory

    yield mount
    for directory in mounted:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def healthz_seconds(port: int) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as answer:
        assert answer.status == 200
    return time.perf_counter() - started


def test_a_full_disk_refuses_spills_and_the_daemon_works_on(daemons, tmpfs):
    small = tmpfs("2m")
    port = free_port()
    daemon = daemons.start("A", pool_size="16MiB", extra=[*flags(small / "tier", disk="64MiB"),
                                                           "--metrics-port", str(port)])
    keys = [f"f{i:03d}" for i in range(80)]  # 5 MiB of pages for a 2 MiB file system
    pages = pages_for(keys)
    with daemon.client() as client:
        assert put(client, keys, pages)
        eventually(lambda: disk_of(client)["refused"] > 0, timeout=20)
        assert healthz_seconds(port) < 1.0
        found, outs = get(client, keys, pages)  # whatever it has, RAM's and the disk's, exact
        assert exact(found, outs, pages) and sum(found) >= 16
        assert put(client, ["after"], pages_for(["after"], seed=9))  # it takes new pages
        found, outs = get(client, ["after"], pages_for(["after"], seed=9))
        assert found == [True] and exact(found, outs, pages_for(["after"], seed=9))
        assert disk_of(client)["used_bytes"] <= 2 << 20
    assert "the disk is full" in daemon.log()


def test_the_disk_budget_holds_under_a_flood(daemons, tmpfs):
    disk, budget = tmpfs("64m"), 2 << 20  # the budget: 30 pages of 64 KiB (with their headers)
    daemon = daemons.start("A", pool_size="16MiB", extra=flags(disk / "tier", disk="2MiB"))
    base = used(disk)  # (the marker and the lock: directories cost a tmpfs nothing)
    seen, stop, stored = [], threading.Event(), []

    def watch() -> None:  # what the file system holds, at once: pages, files being written, files not unlinked
        while not stop.is_set():
            seen.append(used(disk) - base)

    def flood(worker: int) -> None:
        with daemon.client() as client:
            keys = [f"w{worker}-{i:03d}" for i in range(150)]
            stored.append(put(client, keys, pages_for(keys, seed=worker * 1000)))

    threads = [threading.Thread(target=watch)] + [threading.Thread(target=flood, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    try:
        for t in threads[1:]:
            t.join()
        with daemon.client() as client:
            d = settled(client)
    finally:
        stop.set()
        threads[0].join()
    assert stored == [True, True]
    assert len(seen) > 10 and max(seen) <= budget, (len(seen), max(seen))
    assert d["used_bytes"] <= budget and d["entries"] == budget // disk_bytes(BLOCK) and d["evictions"] > 200
    files = list((disk / "tier" / "pages").rglob("*.kvp"))
    assert len(files) == d["entries"] and sum(disk_bytes(f.stat().st_size - 4096) for f in files) <= budget
    with daemon.client() as client:  # the 30 pages on disk (and RAM's 16) read back, exact
        keys = [f"w{w}-{i:03d}" for w in range(2) for i in range(150)]
        pages = pages_for(keys[:150], seed=0) + pages_for(keys[150:], seed=1000)
        found, outs = get(client, keys, pages)
        assert 30 <= sum(found) <= 46 and exact(found, outs, pages)


def test_healthz_and_ram_hits_stay_fast_while_the_disk_is_saturated(daemons, tmp_path):
    port = free_port()
    slow = {"KVD_TEST_DISK_READ_PAUSE": "0.3", "KVD_TEST_DISK_WRITE_PAUSE": "0.3"}  # a disk at its limit
    daemon = daemons.start("A", pool_size="32MiB", env=slow, extra=[
        *flags(tmp_path / "tier", ram="4MiB", disk="64MiB"), "--metrics-port", str(port)])
    keys = [f"s{i:03d}" for i in range(160)]
    pages = pages_for(keys)
    with daemon.client() as client:
        eventually(lambda: disk_of(client)["ready"])
        assert put(client, keys[:88], pages[:88])  # RAM holds 64: 24 on disk only, once written
        eventually(lambda: disk_of(client)["entries"] >= 24, timeout=60)
    stop, answered = threading.Event(), []

    def saturate() -> None:  # puts that queue writes, gets that queue reads, without a pause
        with daemon.client() as client:
            i = 88
            while not stop.is_set():
                put(client, keys[i % 160:i % 160 + 4], pages[i % 160:i % 160 + 4])
                started = time.perf_counter()
                client.cache_get(keys[:24], [torch.empty(ONE_BLOCK) for _ in range(24)])
                answered.append(time.perf_counter() - started)
                i += 4

    load = threading.Thread(target=saturate)
    load.start()
    try:
        eventually(lambda: len(answered) >= 2, timeout=30)
        health = [healthz_seconds(port) for _ in range(40)]
        with daemon.client() as client:
            assert put(client, ["hot"], pages_for(["hot"], seed=5))  # (reads take half of RAM at most)
            ram = []
            for _ in range(20):
                started = time.perf_counter()
                assert client.cache_get(["hot"], [torch.empty(ONE_BLOCK)]) == [True]
                ram.append(time.perf_counter() - started)
            d = disk_of(client)
    finally:
        stop.set()
        load.join()
    assert statistics.median(health) < 0.05 and max(health) < 0.5, health
    assert statistics.median(ram) < 0.05 and max(ram) < 0.5, ram
    assert d["reads_in_flight"] + d["writes_in_flight"] > 0 or d["busy"] > 0  # the disk was saturated
    assert max(answered) < 1.0 + 1.5  # a get waits for the disk READ_TIMEOUT at most (and its copies)


def test_a_directory_not_the_daemons_alone_is_refused_at_start(daemons, tmp_path):
    def refused(directory: Path, why: str, extra: list[str] = ()) -> None:
        daemon = daemons.start("X", pool_size="16MiB", wait=False, extra=[*flags(directory), *extra])
        assert daemon.proc.wait(30) != 0
        assert why in daemon.log(), daemon.log()

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o775)
    refused(shared, "may be written by others (mode 775)")
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes").write_text("mine")
    refused(home, "not empty and holds no kvd tier")
    first = daemons.start("A", pool_size="16MiB", extra=flags(tmp_path / "tier"))
    refused(tmp_path / "tier", f"used by another kvd (pid {first.pid})")
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        refused(theirs, "belongs to uid 65534")
    done = subprocess.run([sys.executable, "-m", "kvd", "serve", "--cache-dir", str(tmp_path / "t2")],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "KVD_METRICS_PORT": "0"})
    assert done.returncode != 0 and "cache_dir needs cache_disk_size" in done.stderr


def tier_nodes(daemon) -> list[str]:
    return sorted(n["node_id"] for n in ask(p.ClusterNodes(req=1), daemon.socket) if n.get("cache_bytes", 0) > 0)


@pytest.fixture(scope="module", params=["etcd", "redis"])
def registry(request):
    server = start_or_skip(request.param)
    yield server
    stop_server(server)


def test_a_home_answers_from_its_disk_and_a_clear_clears_it(daemons, registry, tmp_path):
    cluster = ["--registry", registry.url, "--cluster", f"c{uuid.uuid4().hex[:8]}", "--registry-ttl", "2s"]
    home = daemons.start("B", pool_size="16MiB", extra=[*cluster, *flags(tmp_path / "tier")])
    asker = daemons.start("A", pool_size="16MiB", extra=[*cluster, "--cache-size", "0"])  # keeps no pages: B is home
    keys = [f"{i:064x}" for i in range(40)]
    pages = pages_for(keys)
    with home.client() as on_b, asker.client() as on_a:
        eventually(lambda: all(tier_nodes(d) == ["B"] for d in (home, asker)), timeout=15)
        assert put(on_b, keys, pages, namespace="ns")
        assert settled(on_b)["entries"] == 40  # 16 in B's RAM, all 40 on its disk
        assert on_a.cache_exists(keys, namespace="ns") == 40
        found, outs = get(on_a, keys, pages, namespace="ns")
        assert found == [True] * 40 and exact(found, outs, pages)
        assert disk_of(on_b)["hits"] >= 24 and on_a.cache_stats()["cluster"]["fetched"] == 40
        assert on_a.cache_clear("ns") == 40
        assert on_b.cache_exists(keys, namespace="ns") == 0 and disk_of(on_b)["entries"] == 0


def test_sglang_sees_disk_hits_as_hits(daemons, tmp_path):
    from tests.system.test_sglang_tier import PAGE, backup, make_backend, page_bytes, page_keys, prefetch, token_indices

    try:
        import types

        from sglang.srt.mem_cache import hicache_storage, utils
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    except ImportError as error:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"sglang is not installed: {error}")
    from kvd.testing.sglang_pool import MHAHostPool

    sglang = types.SimpleNamespace(storage=hicache_storage, factory=StorageBackendFactory, utils=utils)
    daemon = daemons.start("A", pool_size="16MiB", extra=flags(tmp_path / "tier"))
    pages = 48  # 16 KiB pages, one block each: 16 fit in RAM
    writer_pool = MHAHostPool(layer_num=4, head_num=2, head_dim=128, page_size=PAGE, pages=pages, layout="page_first")
    writer_pool.fill_random(seed=3)
    keys = page_keys(sglang, seed=7, pages=pages)
    writer = make_backend(sglang, daemon.socket, writer_pool)
    for i in range(0, pages, 8):  # (SGLang's batches are of 128 pages: here, of less than RAM's budget)
        assert backup(sglang, writer, keys[i:i + 8], token_indices(list(range(i, i + 8)))) == 8
    writer.close()
    with daemon.client() as client:
        assert settled(client)["entries"] == pages
    reader_pool = MHAHostPool(layer_num=4, head_num=2, head_dim=128, page_size=PAGE, pages=pages, layout="page_first")
    reader = make_backend(sglang, daemon.socket, reader_pool)
    assert prefetch(sglang, reader, keys, token_indices(list(range(pages)))) == pages
    assert all(torch.equal(page_bytes(writer_pool, i * PAGE), page_bytes(reader_pool, i * PAGE)) for i in range(pages))
    reader.close()
    with daemon.client() as client:
        assert disk_of(client)["hits"] >= pages - 16
