"""The disk level's file operations (daemon process): plain blocking calls, run by the worker threads
of `workers.py`, never on the event loop.

The directory holds `kvd-tier` (what it is), `lock` (held by the daemon using it), `pages/` (one
directory per namespace, `store/disk_format.py`), `tmp/` (files being written) and `trash/`
(cleared namespaces on their way out). A page is written whole into `tmp/` and renamed into place:
a write cut short (kill -9, a full disk) leaves at most a file in `tmp/`, emptied at the next start,
never a torn page under a page's name. A read checks the file against the question before a byte of
it counts: its size, its header (magic, version, digest, namespace, key, size) and the digest of
its bytes.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from kvd.errors import BadRequest

from .disk_format import (
    HEADER_SIZE,
    SUFFIX,
    BadPage,
    Header,
    check_is,
    decode,
    disk_bytes,
    encode,
    file_size,
    page_path,
    payload_digest,
)

log = logging.getLogger(__name__)

MARKER = "kvd-tier"
MARKER_TEXT = "a kvd KV tier's disk level (docs/kv-tier.md); kvd alone writes here\n"
SUBDIRS = ("pages", "tmp", "trash")
OPEN_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW


class Absent(Exception):
    """No file under the page's name."""


@dataclass
class Claimed:
    root: str
    lock_fd: int
    leftovers: int  # files of writes cut short, removed from tmp/

    def release(self) -> None:
        """Let go of the directory (once: a start that fails after the claim releases it too)."""
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1


def _check_owned(path: str, what: str) -> None:
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise BadRequest(f"--cache-dir {what} {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise BadRequest(f"--cache-dir {what} {path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}):"
                         " kvd keeps its pages only in a directory of its own")
    if st.st_mode & 0o022:
        raise BadRequest(f"--cache-dir {what} {path} may be written by others (mode {stat.S_IMODE(st.st_mode):o}): "
                         f"anyone who can write there could plant pages; chmod go-w {path}")


def claim(root: str) -> Claimed:
    """Make the directory the tier's, or say why not: it must be ours, writable by us alone, empty
    or a kvd tier's, and unused by another kvd. Empties tmp/ (writes a kill cut short)."""
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        _check_owned(root, "directory")
        entries = set(os.listdir(root))
        if entries - {"lost+found"} and MARKER not in entries:  # (a file system of its own has lost+found)
            raise BadRequest(f"--cache-dir {root} is not empty and holds no kvd tier (no {MARKER} file): give an "
                             "empty or new directory, or one a kvd made")
        lock_fd = os.open(os.path.join(root, "lock"), os.O_RDWR | os.O_CREAT | OPEN_FLAGS, 0o600)
    except OSError as exc:
        raise BadRequest(f"--cache-dir {root}: {exc.strerror or exc}") from None
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(lock_fd, 64, 0).decode(errors="replace").strip() or "?"
            raise BadRequest(f"--cache-dir {root} is used by another kvd (pid {holder}): each daemon needs its "
                             "own") from None
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
        if MARKER not in entries:
            with open(os.path.join(root, MARKER), "w") as marker:
                marker.write(MARKER_TEXT)
        for sub in SUBDIRS:
            path = os.path.join(root, sub)
            os.makedirs(path, mode=0o700, exist_ok=True)
            _check_owned(path, "subdirectory")
        leftovers = 0
        for entry in os.scandir(os.path.join(root, "tmp")):
            _remove(entry.path)
            leftovers += 1
    except BaseException as exc:
        os.close(lock_fd)
        if isinstance(exc, OSError):
            raise BadRequest(f"--cache-dir {root}: {exc.strerror or exc}") from None
        raise
    return Claimed(root, lock_fd, leftovers)


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _write_all(fd: int, pieces: list, offset: int) -> int:
    """pwritev until every piece is written (a write may stop short); returns the next offset."""
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    while views:
        written = os.pwritev(fd, views[:1024], offset)
        offset += written
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if written:
            views[0] = views[0][written:]
    return offset


def _read_all(fd: int, pieces: list, offset: int) -> int:
    """preadv until every piece is filled; returns the bytes read (fewer: the file ended)."""
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    total = 0
    while views:
        got = os.preadv(fd, views[:1024], offset)
        if got == 0:
            break
        offset += got
        total += got
        while views and got >= len(views[0]):
            got -= len(views[0])
            views.pop(0)
        if got:
            views[0] = views[0][got:]
    return total


def write_page(root: str, header: Header, pieces: list, pause: float = 0.0) -> float:
    """Write a page's file: its digest taken, header and bytes into tmp/, then renamed into place.
    Returns the seconds it took. OSError (ENOSPC, EIO, ...) leaves nothing behind. `pause`: a
    test's slow disk, halfway through the bytes."""
    started = time.perf_counter()
    header = Header(header.namespace, header.key, header.dtype, header.shape, header.nbytes, payload_digest(pieces),
                    header.block_size)
    final = os.path.join(root, page_path(header.namespace, header.key))
    tmp = os.path.join(root, "tmp", uuid.uuid4().hex)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o600)
    try:
        try:
            offset = _write_all(fd, [encode(header)], 0)
            if pause:
                half = [memoryview(p).cast("B") for p in pieces]
                first = half[0][:len(half[0]) // 2] if half else b""
                offset = _write_all(fd, [first], offset)
                time.sleep(pause)
                offset = _write_all(fd, [half[0][len(first):], *half[1:]] if half else [], offset)
            else:
                _write_all(fd, pieces, offset)
        finally:
            os.close(fd)
        os.makedirs(os.path.dirname(final), mode=0o700, exist_ok=True)
        os.rename(tmp, final)
    except BaseException:
        _remove(tmp)
        raise
    return time.perf_counter() - started


def read_page(root: str, namespace: str, key: str, nbytes: int, dest: list, pause: float = 0.0,
              probe: bool = False) -> tuple[Header, float]:
    """Read a page's file into `dest` (memoryviews of its pool blocks, nbytes in all) and check it.
    Returns its header and the seconds it took. Absent: no such file (probe: a file the index does
    not list yet, of another size than asked: left alone). BadPage: the file is not that page, or
    not whole, or its bytes fail their digest; it is removed then (nothing else writes under that
    name while a read of it runs: the index lists the page, or no write starts before the scan ends)."""
    started = time.perf_counter()
    if pause:
        time.sleep(pause)
    path = os.path.join(root, page_path(namespace, key))
    try:
        fd = os.open(path, os.O_RDONLY | OPEN_FLAGS)
    except FileNotFoundError:
        raise Absent(path) from None
    try:
        size = os.fstat(fd).st_size
        if size != file_size(nbytes) and probe:
            raise Absent(path)
        if size != file_size(nbytes):
            raise BadPage(f"{size} bytes, a page of {nbytes} takes {file_size(nbytes)}")
        head = bytearray(HEADER_SIZE)
        got = _read_all(fd, [head, *dest], 0)
        if got != size:
            raise BadPage(f"{got} of its {size} bytes read")
        header = decode(head)
        check_is(header, namespace, key, nbytes)
        if payload_digest(dest) != header.digest:
            raise BadPage("the page bytes fail their digest")
        try:
            os.utime(fd)  # when it was last used: the next start's eviction order
        except OSError:
            pass
    except BadPage:
        _remove(path)
        raise
    finally:
        os.close(fd)
    return header, time.perf_counter() - started


def probe(root: str, namespace: str, key: str) -> Header | None:
    """The header of a page's file, if the file is there, whole, and that page's (its bytes are
    checked when read); None otherwise. Removes nothing: the start's scan does."""
    try:
        fd = os.open(os.path.join(root, page_path(namespace, key)), os.O_RDONLY | OPEN_FLAGS)
    except FileNotFoundError:
        return None
    try:
        header = decode(os.pread(fd, HEADER_SIZE, 0))
        check_is(header, namespace, key)
        return header if os.fstat(fd).st_size == file_size(header.nbytes) else None
    except BadPage:
        return None
    finally:
        os.close(fd)


def unlink(root: str, relative: str) -> None:
    _remove(os.path.join(root, relative))


def clear_namespace(root: str, directory: str) -> None:
    """Move a namespace's directory to trash/ in one rename (made durable), to be emptied later: a
    clear that returned is never undone by a crash, and costs no time per page."""
    source = os.path.join(root, "pages", directory)
    target = os.path.join(root, "trash", f"{directory}.{uuid.uuid4().hex[:8]}")
    try:
        os.rename(source, target)
    except FileNotFoundError:
        return
    fd = os.open(os.path.join(root, "pages"), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def empty_trash(root: str, stop: threading.Event) -> None:
    for entry in _entries(os.path.join(root, "trash")):
        if stop.is_set():
            return
        _remove(entry.path)


@dataclass
class Found:
    namespace: str
    key: str
    nbytes: int
    size: int
    mtime: float


@dataclass
class ScanReport:
    files: int = 0
    corrupt: int = 0
    stale: int = 0
    order: list[tuple[str, str]] = field(default_factory=list)  # the pages found, least recently used first


def scan(root: str, post: Callable[[list[Found], int, int], None], stop: threading.Event, batch: int = 1000,
         progress_every: float = 2.0, pause: float = 0.0) -> ScanReport:
    """Find the pages in pages/: each file's header read and checked (not its bytes: those are
    checked when read), its name and size against it. Posts what it finds in batches as it goes
    (with the files dropped so far: corrupt, of another version); removes what is not a whole
    page of this format. Logs its progress every few seconds on a big directory."""
    report = ScanReport()
    found: list[Found] = []
    when: list[tuple[float, str, str]] = []
    started = last = time.monotonic()
    for ns_entry in _entries(os.path.join(root, "pages")):
        for fan in _entries(ns_entry.path):
            for entry in _entries(fan.path):
                if stop.is_set():
                    return report
                if pause:  # (a test's big directory)
                    time.sleep(pause)
                report.files += 1
                page = _scan_one(root, entry, report)
                if page is not None:
                    found.append(page)
                    when.append((page.mtime, page.namespace, page.key))
                if len(found) >= batch:
                    post(found, report.corrupt, report.stale)
                    found = []
                now = time.monotonic()
                if now - last >= progress_every:
                    last = now
                    log.info("disk tier: scanning %s: %d files so far (%.0f/s)", root, report.files,
                             report.files / (now - started))
    post(found, report.corrupt, report.stale)
    when.sort()
    report.order = [(ns, key) for _, ns, key in when]
    return report


def _entries(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _scan_one(root: str, entry: os.DirEntry, report: ScanReport) -> Found | None:
    try:
        if not entry.name.endswith(SUFFIX) or not entry.is_file(follow_symlinks=False):
            raise BadPage("not a page file")
        fd = os.open(entry.path, os.O_RDONLY | OPEN_FLAGS)
        try:
            st = os.fstat(fd)
            header = decode(os.pread(fd, HEADER_SIZE, 0))
        finally:
            os.close(fd)
        if os.path.relpath(entry.path, root) != page_path(header.namespace, header.key):
            raise BadPage("its name is another page's")
        if st.st_size != file_size(header.nbytes):
            raise BadPage(f"{st.st_size} bytes, its page takes {file_size(header.nbytes)}")
        return Found(header.namespace, header.key, header.nbytes, disk_bytes(header.nbytes), st.st_mtime)
    except BadPage as exc:
        if exc.stale:
            report.stale += 1
        else:
            report.corrupt += 1
        log.debug("disk tier: %s dropped: %s", entry.path, exc.reason)
    except OSError as exc:
        if exc.errno == errno.ENOENT:  # (cleared meanwhile)
            return None
        report.corrupt += 1
        log.debug("disk tier: %s unreadable, dropped: %s", entry.path, exc)
    _remove(entry.path)
    return None
