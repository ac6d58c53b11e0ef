"""The KV tier's disk level on real daemons and a real directory (issue 43): pages spilled from RAM
read back bit-exact for every dtype; a restart (SIGTERM, kill -9, another block size) keeps them; a
damaged, truncated, renamed, foreign or older page is a miss and never wrong bytes, found at the
start's scan or at a read; a kill -9 mid-write serves no torn page; two namespaces never mix;
cache_clear clears the disk for good; the figures by medium in cache_stats, /metrics and `kvd status`."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import torch

from kvd.daemon.tier.disk.disk_format import HEADER_SIZE, VERSION, Header, encode, namespace_dir, page_path
from kvd.testing.daemons import eventually, free_port
from kvd.wire.dtypes import DTYPE_ITEMSIZE
from tests.system.test_kv_tier import random_page, same_bits

BLOCK = 64 << 10
ONE_BLOCK = BLOCK // 4  # float32 elements of a one-block page


def flags(directory: Path, ram: str = "1MiB", disk: str = "16MiB") -> list[str]:
    return ["--cache-size", ram, "--cache-dir", str(directory), "--cache-disk-size", disk]


def disk_of(client) -> dict:
    return client.cache_stats()["media"]["disk"]


def settled(client, timeout: float = 20.0) -> dict:
    """Wait until the disk has the scan behind it and nothing left to write or unlink."""
    def done() -> bool:
        d = disk_of(client)
        return (d["ready"] and not d["unwritten"] and not d["staged"] and not d["writes_in_flight"]
                and not d["writing"] and not d["deleting_bytes"])
    eventually(done, timeout=timeout)
    return disk_of(client)


def pages_for(keys: list[str], seed: int = 0) -> list[torch.Tensor]:
    return [random_page(torch.float32, (ONE_BLOCK,), seed=seed + i) for i, _ in enumerate(keys)]


def put(client, keys: list[str], pages: list, namespace: str = "") -> bool:
    """In batches of 4 (a batch never evicts its own pages: each smaller than the budget)."""
    return all(all(client.cache_put(keys[i:i + 4], pages[i:i + 4], namespace=namespace))
               for i in range(0, len(keys), 4))


def fill(client, count: int, namespace: str = "filler") -> None:
    """Push everything else out of a 1 MiB RAM budget: `count` one-block pages of their own."""
    keys = [f"fill-{i}" for i in range(count)]
    assert put(client, keys, pages_for(keys, seed=10_000), namespace=namespace)


def get(client, keys: list[str], like: list[torch.Tensor], namespace: str = "") -> tuple[list[bool], list]:
    outs = [torch.empty_like(t) for t in like]
    found = client.cache_get(keys, outs, namespace=namespace)
    return found, outs


def exact(found: list[bool], outs: list, pages: list) -> bool:
    """Every hit bit-exact (a miss is allowed; a wrong byte never is)."""
    return all(same_bits(o, p) for f, o, p in zip(found, outs, pages) if f)


def test_spill_and_read_back_bit_exact_for_every_dtype_with_figures_by_medium(daemons, tmp_path):
    port = free_port()
    daemon = daemons.start("A", pool_size="16MiB", extra=[*flags(tmp_path / "tier", ram="4MiB"),
                                                           "--metrics-port", str(port)])
    dtypes = [getattr(torch, name) for name in DTYPE_ITEMSIZE]
    pages = [random_page(dt, (4, 16, 256), seed=i) for i, dt in enumerate(dtypes)]  # 16-128 KiB each
    wide = random_page(torch.bfloat16, (64, 512), seed=99)
    pages += [wide[:, ::2], random_page(torch.float16, (3, 5, 7), seed=98)]  # a non-contiguous view, a small page
    keys = [f"page-{i}" for i in range(len(pages))]
    with daemon.client() as client:
        assert client.cache_put(keys, pages, namespace="t") == [True] * len(pages)
        fill(client, 80)  # RAM holds 64 blocks: the pages above are on disk only now
        before = settled(client)
        assert before["entries"] >= len(pages) + 64 and before["corrupt"] == 0
        assert client.cache_exists(keys, namespace="t") == len(pages)
        found, outs = get(client, keys, pages, namespace="t")
        assert found == [True] * len(pages) and exact(found, outs, pages)
        media = client.cache_stats()["media"]
        assert media["disk"]["hits"] == len(pages) and media["disk"]["read"]["count"] == len(pages)
        assert media["ram"]["misses"] >= len(pages) and media["disk"]["spilled"] >= len(pages) + 64
        # read back into RAM (they take less than half its budget): the next get is RAM's
        found, outs = get(client, keys, pages, namespace="t")
        assert found == [True] * len(pages) and exact(found, outs, pages)
        assert client.cache_stats()["media"]["disk"]["hits"] == len(pages)
        assert client.cache_stats("t")["disk"]["entries"] == len(pages)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert f'kvd_cache_medium_hits_total{{medium="disk"}} {float(len(pages))}' in metrics
    assert 'kvd_cache_medium_pages{medium="ram"}' in metrics and "kvd_cache_disk_read_seconds_bucket" in metrics
    status = subprocess.run([sys.executable, "-m", "kvd", "status", "--socket", daemon.socket],
                            capture_output=True, text=True, timeout=30)
    assert status.returncode == 0, status.stderr
    assert "  ram " in status.stdout and "  disk " in status.stdout and f"{len(pages)} hits" in status.stdout


def test_a_restart_keeps_the_pages_sigterm_kill_9_and_another_block_size(daemons, tmp_path):
    tier = tmp_path / "tier"
    keys = [f"k{i:03d}" for i in range(40)]
    pages = pages_for(keys)
    a = daemons.start("A", pool_size="16MiB", extra=flags(tier))
    with a.client() as client:
        assert put(client, keys, pages)  # 16 stay in RAM, written behind; 24 evicted, on disk
    assert a.stop() == 0  # (SIGTERM writes out what RAM holds and the disk does not)
    b = daemons.start("A", pool_size="16MiB", extra=flags(tier))
    with b.client() as client:
        assert settled(client)["found"] == 40
        found, outs = get(client, keys, pages)
        assert found == [True] * 40 and exact(found, outs, pages)
        more = [f"m{i}" for i in range(8)]
        assert all(client.cache_put(more, pages_for(more, seed=500)))
        settled(client)  # written behind
    b.kill()  # kill -9: what the disk has survives
    c = daemons.start("A", pool_size="16MiB", extra=[*flags(tier), "--block-size", "16KiB"])
    with c.client() as client:  # pages are their own bytes: another block size reads them as they are
        settled(client)
        found, outs = get(client, keys + more, pages + pages_for(more, seed=500))
        assert found == [True] * 48 and exact(found, outs, pages + pages_for(more, seed=500))


def test_pages_serve_hits_at_once_while_the_start_scan_runs_and_a_clear_then_holds(daemons, tmp_path):
    tier = tmp_path / "tier"
    keys = [f"{i:064x}" for i in range(20)]
    pages, others = pages_for(keys), pages_for(keys, seed=77)
    a = daemons.start("A", pool_size="16MiB", extra=flags(tier))
    with a.client() as client:
        assert put(client, keys, pages, namespace="ns") and put(client, keys, others, namespace="gone")
        settled(client)
    assert a.stop() == 0
    # a directory the scan takes 20 s to list (a second a file): its pages are found by their names meanwhile
    b = daemons.start("A", pool_size="16MiB", extra=flags(tier), env={"KVD_TEST_DISK_SCAN_PAUSE": "0.5"})
    with b.client() as client:
        assert client.cache_exists(keys, namespace="ns") == 20
        found, outs = get(client, keys, pages, namespace="ns")
        assert found == [True] * 20 and exact(found, outs, pages)
        assert client.cache_exists(keys, namespace="gone") == 20
        assert client.cache_clear("gone") == 20  # (listed by the exists above)
        assert client.cache_exists(keys, namespace="gone") == 0
        assert client.cache_get(keys[:2], [torch.empty(ONE_BLOCK)] * 2, namespace="gone") == [False, False]
        assert not disk_of(client)["ready"]  # (all of it before the scan was over)
        settled(client, timeout=60)
        assert client.cache_exists(keys, namespace="gone") == 0  # the scan's late news of them are stale
        found, outs = get(client, keys, pages, namespace="ns")
        assert found == [True] * 20 and exact(found, outs, pages)


def damage(tier: Path, namespace: str, keys: list[str]) -> None:
    """Five ways a file goes wrong: a flipped byte of the page, a truncated file, a file renamed over
    another key's (both lost), another namespace's file under this one's name, an older format."""
    path = {key: tier / page_path(namespace, key) for key in keys}
    with open(path[keys[0]], "r+b") as f:
        f.seek(HEADER_SIZE + 1234)
        byte = f.read(1)[0]
        f.seek(HEADER_SIZE + 1234)
        f.write(bytes([byte ^ 0x20]))
    os.truncate(path[keys[1]], HEADER_SIZE + BLOCK // 2)
    os.replace(path[keys[2]], path[keys[3]])
    shutil.copy(tier / page_path("other", keys[4]), path[keys[4]])
    with open(path[keys[5]], "r+b") as f:  # a whole header, digests right: only its version differs
        f.write(encode(Header(namespace, keys[5], "float32", (ONE_BLOCK,), BLOCK, 0, BLOCK, version=VERSION - 1)))


def test_damaged_files_are_misses_never_wrong_bytes_at_the_scan_and_at_a_read(daemons, tmp_path):
    tier = tmp_path / "tier"
    keys = [f"d{i}" for i in range(10)]
    pages, theirs = pages_for(keys), pages_for(keys, seed=300)
    daemon = daemons.start("A", pool_size="16MiB", extra=flags(tier))
    with daemon.client() as client:
        assert put(client, keys, pages, namespace="ns")
        assert put(client, keys, theirs, namespace="other")
        fill(client, 20)
        settled(client)
        # while it runs: the checks of a read
        damage(tier, "ns", keys)
        found, outs = get(client, keys, pages, namespace="ns")
        assert found == [False] * 6 + [True] * 4 and exact(found, outs, pages)
        d = disk_of(client)
        assert d["corrupt"] == 4 and d["stale"] == 1  # (d2's file is gone: a plain miss)
        assert not any((tier / page_path("ns", k)).exists() for k in keys[:6])  # dropped
        found, outs = get(client, keys, theirs, namespace="other")  # the other namespace is whole
        assert found == [True] * 10 and exact(found, outs, theirs)
        assert put(client, keys[:6], pages[:6], namespace="ns")  # put again; then on disk only
        fill(client, 20, namespace="filler2")
        settled(client)
    assert daemon.stop() == 0
    assert "dropped" in daemon.log() and "(a miss;" in daemon.log()
    # while it is down: the checks of the scan (and of the read, for the flipped byte)
    damage(tier, "ns", keys)
    again = daemons.start("A", pool_size="16MiB", extra=flags(tier))
    with again.client() as client:
        d = settled(client)
        assert d["corrupt"] == 3 and d["stale"] == 1  # (a flipped byte of the page is found when read)
        assert client.cache_exists(keys, namespace="ns") == 1  # d0: its header is whole
        found, outs = get(client, keys, pages, namespace="ns")
        assert found == [False] * 6 + [True] * 4 and exact(found, outs, pages)
        assert disk_of(client)["corrupt"] == 4


def test_kill_9_mid_write_serves_no_torn_page_after_the_restart(daemons, tmp_path):
    tier = tmp_path / "tier"
    whole, torn = ["whole"], ["torn"]
    a = daemons.start("A", pool_size="16MiB", extra=flags(tier))
    with a.client() as client:
        assert client.cache_put(whole, pages_for(whole)) == [True]
        settled(client)
    assert a.stop() == 0
    # each write now stops halfway through its page's bytes, for long: kill it there
    b = daemons.start("A", pool_size="16MiB", extra=flags(tier), env={"KVD_TEST_DISK_WRITE_PAUSE": "60"})
    with b.client() as client:
        eventually(lambda: disk_of(client)["ready"])
        assert client.cache_put(torn, pages_for(torn, seed=7)) == [True]
    half = HEADER_SIZE + BLOCK // 2
    eventually(lambda: [f.stat().st_size for f in (tier / "tmp").iterdir()] == [half], timeout=10)
    b.kill()
    c = daemons.start("A", pool_size="16MiB", extra=flags(tier))
    with c.client() as client:
        settled(client)
        found, outs = get(client, whole + torn, pages_for(whole) + pages_for(torn, seed=7))
        assert found == [True, False] and exact(found, outs, pages_for(whole) + pages_for(torn, seed=7))
    assert list((tier / "tmp").iterdir()) == []  # the cut-short write is gone
    assert "files of writes cut short" in c.log()
    on_disk = [f for f in (tier / "pages").rglob("*.kvp")]
    assert len(on_disk) == 1 and on_disk[0].stat().st_size == HEADER_SIZE + BLOCK


def test_two_namespaces_never_mix(daemons, tmp_path):
    tier = tmp_path / "tier"
    keys = [f"{i:064x}" for i in range(20)]
    mine, yours = pages_for(keys, seed=1), pages_for(keys, seed=2)
    a = daemons.start("A", pool_size="16MiB", extra=flags(tier))
    with a.client() as client:
        assert put(client, keys, mine, namespace="mine")
        assert put(client, keys, yours, namespace="yours")
        fill(client, 20)
        settled(client)
    assert a.stop() == 0
    b = daemons.start("A", pool_size="16MiB", extra=flags(tier))
    with b.client() as client:
        settled(client)
        for namespace, pages in (("mine", mine), ("yours", yours)):
            found, outs = get(client, keys, pages, namespace=namespace)
            assert found == [True] * 20 and exact(found, outs, pages)
        assert client.cache_exists(keys, namespace="neither") == 0
        assert client.cache_clear("mine") == 20
        found, outs = get(client, keys, yours, namespace="yours")
        assert found == [True] * 20 and exact(found, outs, yours)


def test_cache_clear_clears_the_disk_for_good_even_with_writes_in_flight(daemons, tmp_path):
    tier = tmp_path / "tier"
    keys = [f"c{i}" for i in range(30)]
    pages = pages_for(keys)
    a = daemons.start("A", pool_size="16MiB", extra=flags(tier))
    with a.client() as client:
        assert put(client, keys, pages, namespace="gone")
        assert put(client, keys[:5], pages[:5], namespace="kept")
        settled(client)  # 16 + 5 in RAM (and on disk), 14 of "gone" on disk only
        assert client.cache_clear("gone") == 30  # each page once, wherever it was
        assert client.cache_exists(keys, namespace="gone") == 0
        assert not (tier / "pages" / namespace_dir("gone")).exists()
        assert client.cache_get(keys[:1], [torch.empty(ONE_BLOCK)], namespace="gone") == [False]
    assert a.stop() == 0
    # writes in flight when the clear comes: it waits for them, and their files go too
    b = daemons.start("A", pool_size="16MiB", extra=flags(tier), env={"KVD_TEST_DISK_WRITE_PAUSE": "0.5"})
    with b.client() as client:
        eventually(lambda: disk_of(client)["ready"])
        found, _ = get(client, keys[:5], pages[:5], namespace="kept")
        assert found == [True] * 5
        assert put(client, keys, pages, namespace="gone")
        assert disk_of(client)["writes_in_flight"] > 0
        assert client.cache_clear("gone") == 30
        eventually(lambda: disk_of(client)["writes_in_flight"] == 0)  # (the writes it waited for, done)
    b.kill()  # no shutdown flush: what is on disk is what the clear left
    c = daemons.start("A", pool_size="16MiB", extra=flags(tier))
    with c.client() as client:
        settled(client)
        assert client.cache_exists(keys, namespace="gone") == 0
        found, outs = get(client, keys[:5], pages[:5], namespace="kept")
        assert found == [True] * 5 and exact(found, outs, pages[:5])
