"""The disk level's file operations (kvd.daemon.tier.disk.page_files) on a real directory: the claim refuses a
directory that is not the daemon's alone, a page file round-trips through several pool segments,
and a file that is damaged, cut short, renamed over another page's, of another namespace or of
another format version is refused (and removed), never read as the page asked for."""
from __future__ import annotations

import itertools
import os
import shutil
import threading

import pytest

from kvd.daemon.tier.disk import page_files
from kvd.daemon.tier.disk.disk_format import HEADER_SIZE, VERSION, BadPage, Header, encode, page_path
from kvd.errors import BadRequest

NS, KEY = "model=m;tp=0/1", "f" * 64


def page_bytes(n: int, seed: int) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(n))


def write(root, namespace=NS, key=KEY, data=None, dtype="uint8") -> bytes:
    data = data if data is not None else page_bytes(10_000, 1)
    page_files.write_page(str(root), Header(namespace, key, dtype, (len(data),), len(data), 0, 4096), [data])
    return data


def read(root, namespace=NS, key=KEY, nbytes=10_000) -> bytes:
    """Read into three segments (as pool blocks would give them)."""
    out = bytearray(nbytes)
    view = memoryview(out)
    cuts = [0, nbytes // 3, nbytes // 2, nbytes]
    header, seconds = page_files.read_page(str(root), namespace, key, nbytes,
                                      [view[a:b] for a, b in itertools.pairwise(cuts)])
    assert header.namespace == namespace and header.key == key and seconds >= 0
    return bytes(out)


@pytest.fixture
def root(tmp_path):
    claimed = page_files.claim(str(tmp_path / "tier"))
    yield tmp_path / "tier"
    claimed.release()


def test_a_page_round_trips_and_the_tmp_directory_stays_empty(root):
    data = write(root)
    assert read(root) == data
    assert os.listdir(root / "tmp") == []
    assert os.stat(root / page_path(NS, KEY)).st_size == HEADER_SIZE + len(data)
    with pytest.raises(page_files.Absent):
        read(root, key="e" * 64)


def test_damaged_files_are_refused_removed_and_never_read(root):
    path = root / page_path(NS, KEY)
    cases = {
        "the page bytes fail their digest": lambda: _flip(path, HEADER_SIZE + 5000),
        "the header fails its digest": lambda: _flip(path, 40),
        "bytes, a page of 10000 takes": lambda: os.truncate(path, HEADER_SIZE + 9999),
    }
    for reason, damage in cases.items():
        write(root)
        damage()
        with pytest.raises(BadPage, match=reason):
            read(root)
        assert not path.exists()
    # another key's file renamed over this one's; another namespace's file copied to this one's name
    other = write(root, key="e" * 64, data=page_bytes(10_000, 2))
    os.replace(root / page_path(NS, "e" * 64), path)
    with pytest.raises(BadPage, match="the page of key 'eee"):
        read(root)
    write(root, namespace="other", data=other)
    shutil.copy(root / page_path("other", KEY), path)
    with pytest.raises(BadPage, match="namespace 'other'"):
        read(root)
    # a page of an older format version: its header whole and its digests right, never read as this one
    data = write(root)
    with open(path, "r+b") as f:
        f.write(encode(Header(NS, KEY, "uint8", (len(data),), len(data), 0, 4096, version=VERSION - 1)))
    with pytest.raises(BadPage) as caught:
        read(root)
    assert caught.value.stale


def _flip(path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))


def test_the_scan_finds_whole_pages_oldest_first_and_drops_the_rest(root):
    for i in range(5):
        write(root, key=f"{i:064x}", data=page_bytes(100 * (i + 1), i))
        os.utime(root / page_path(NS, f"{i:064x}"), (1000 + (5 - i), 1000 + (5 - i)))  # the last written is oldest
    os.truncate(root / page_path(NS, f"{0:064x}"), 200)
    target = root / page_path(NS, "e" * 64)  # named for another page
    target.parent.mkdir(exist_ok=True)
    os.replace(root / page_path(NS, f"{1:064x}"), target)
    (root / "pages" / "stray").mkdir()
    posted = []
    report = page_files.scan(str(root), lambda found, corrupt, stale: posted.extend(found), threading.Event(), batch=2)
    assert sorted(p.key for p in posted) == [f"{i:064x}" for i in (2, 3, 4)]
    assert report.files == 5 and report.corrupt == 2 and report.order == [(NS, f"{i:064x}") for i in (4, 3, 2)]
    assert {p.size for p in posted} == {8192}


def test_the_claim_refuses_what_is_not_the_daemons_alone(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    with pytest.raises(BadRequest, match="may be written by others"):
        page_files.claim(str(shared))
    busy = tmp_path / "home"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(BadRequest, match="not empty and holds no kvd tier"):
        page_files.claim(str(busy))
    first = page_files.claim(str(tmp_path / "tier"))
    try:
        with pytest.raises(BadRequest, match=f"used by another kvd \\(pid {os.getpid()}\\)"):
            page_files.claim(str(tmp_path / "tier"))
    finally:
        first.release()
    (tmp_path / "tier" / "tmp" / "cut-short").write_bytes(b"half a page")
    again = page_files.claim(str(tmp_path / "tier"))  # a kvd's directory again, its cut-short writes removed
    assert again.leftovers == 1 and os.listdir(tmp_path / "tier" / "tmp") == []
    again.release()
    if os.geteuid() == 0:  # (only root can give a directory away)
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(BadRequest, match="belongs to uid 65534"):
            page_files.claim(str(theirs))
