"""The pool in host RAM (daemon process), and its mapping in a client (`map_pool`, worker process).

Host memory is a memfd by default, not a /dev/shm file: containers often cap /dev/shm at
64 MiB, a memfd is not bound by that mount, and it disappears with the daemon even on
kill -9, so nothing can leak. Clients open it as /proc/<daemon pid>/fd/<fd> (same user),
which also avoids Python 3.11's multiprocessing.shared_memory resource tracker, which
unlinks segments that a client merely attached to. `--pool-path FILE` uses a named file
instead (for a tmpfs/hugetlbfs mount shared between containers without a shared PID
namespace); the daemon creates it 0600 and unlinks it on exit.

A page of the pool that is not there kills whoever touches it with SIGBUS, the daemon
included. So the memfd is sealed at its size (a client, which must open it read-write to put,
cannot shrink or grow it), and a pool file's space is reserved at start, prefault or not (a
tmpfs that cannot hold the pool fails the start instead of the first transfer).
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import time
from typing import TYPE_CHECKING

from kvd.errors import BadRequest
from kvd.units import format_size

from .io import HostPoolIO, PoolIO

if TYPE_CHECKING:
    import ctypes  # (imported where a plane needs it)

log = logging.getLogger(__name__)
PREFAULT_LOG_BYTES = 1 << 30  # a pool this big says it is prefaulting, and how long it took (~3 s a GiB)


class HostMemory:
    """The pool in host RAM: a memfd (default) or a file the daemon owns, mmapped shared."""

    kind = "cpu"
    ipc_handle = None
    _anchor: ctypes.c_char | None = None  # the mapping exported to a one-sided plane (plane_region)

    def __init__(self, size: int, path: str = "", prefault: bool = True) -> None:
        self.size = size
        self._unlink_path = ""
        self._fd = -1
        if path:
            _check_room(path, size)
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
            try:
                self._fd = os.open(path, flags, 0o600)
            except FileExistsError:
                raise BadRequest(f"pool file {path} already exists: another daemon may own it") from None
            self._unlink_path = path
            self.client_path = os.path.abspath(path)
        else:
            self._fd = os.memfd_create("kvd-pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            self.client_path = f"/proc/{os.getpid()}/fd/{self._fd}"
        started = time.monotonic()
        loud = (prefault or bool(path)) and size >= PREFAULT_LOG_BYTES
        if loud:  # (seconds per GiB: a start that says nothing for half a minute looks hung)
            log.info("prefaulting the %s pool: every page is allocated now, which takes a few seconds per GiB "
                     "(--no-prefault skips it; the first transfers then pay for the pages instead)", format_size(size))
        try:
            os.ftruncate(self._fd, size)
            if prefault or path:
                # allocate every page now: fail at start rather than SIGBUS mid-transfer, and
                # keep first-touch page faults off the copy path (a memfd without prefault
                # takes its pages from memory as it goes: no file system to run out of)
                try:
                    os.posix_fallocate(self._fd, 0, size)
                except OSError as exc:
                    where = f"the file system of {path}" if path else "this host's shared memory"
                    raise BadRequest(f"{where} cannot hold the {format_size(size)} pool: {exc.strerror}") from None
            if not path:  # a client opens the memfd read-write: it must not be able to resize it
                fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if prefault else 0)
            self._map = mmap.mmap(self._fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        except BadRequest:
            self.close()
            raise
        except OSError as exc:
            self.close()
            raise BadRequest(f"cannot allocate a {size}-byte host pool: {exc}") from None
        self._view = memoryview(self._map)
        (log.info if loud else log.debug)("pool of %s prefaulted in %.1fs" if prefault or path else
                                          "pool of %s mapped in %.1fs", format_size(size), time.monotonic() - started)

    def host_view(self) -> memoryview:
        return self._view

    def plane_region(self) -> tuple[int, int, str, int]:
        """Where a one-sided plane registers the pool: (address, size, "DRAM", device 0)."""
        import ctypes

        if self._anchor is None:  # (an export of the mapping: released at close)
            self._anchor = ctypes.c_char.from_buffer(self._map)
        return ctypes.addressof(self._anchor), self.size, "DRAM", 0

    def io(self, chunk_size: int, window: int) -> PoolIO:
        return HostPoolIO(self._view)

    def close(self) -> None:
        self._anchor = None
        view = getattr(self, "_view", None)
        if view is not None:
            view.release()
            del self._view
        mapping = getattr(self, "_map", None)
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                log.warning("pool mapping still referenced at close; leaving it to process exit")
            del self._map
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._unlink_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._unlink_path)
            self._unlink_path = ""


RAM_MARGIN = 512 << 20  # bytes of MemAvailable a pool leaves to everything else on the host
TMPFS_MAGIC = 0x01021994  # statfs f_type of a tmpfs (/dev/shm): its pages are RAM too


def ram_available() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def in_ram(path: str) -> bool:
    """Whether a pool there takes RAM: a memfd (no path) or a file on a tmpfs."""
    if not path:
        return True
    import ctypes
    import ctypes.util

    class StatFs(ctypes.Structure):
        _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    buf = StatFs()
    directory = os.path.dirname(os.path.abspath(path)) or "/"
    if libc.statfs(os.fsencode(directory), ctypes.byref(buf)) != 0:
        return False
    return buf.f_type == TMPFS_MAGIC


def check_fits_in_ram(size: int, path: str = "", overcommit: bool = False) -> None:
    """Refuse a pool in RAM bigger than the RAM available (less RAM_MARGIN): prefaulting it would
    call the host's OOM killer, which may pick another process (memfd pages do not count in kvd's
    RSS), and without prefault the first transfers would. `overcommit` (--pool-overcommit) lets it
    start anyway, with a warning."""
    available = ram_available()
    if available is None or not in_ram(path) or size <= available - RAM_MARGIN:
        return
    what = (f"the {format_size(size)} pool is more than this host's available RAM ({format_size(available)}, "
            f"of which kvd leaves {format_size(RAM_MARGIN)} to the rest)")
    if overcommit:
        log.warning("%s: starting anyway (--pool-overcommit); the host's OOM killer may end this or another "
                    "process when the pool fills", what)
        return
    raise BadRequest(f"{what}: give a smaller --pool-size, or --pool-overcommit to start anyway")


def _check_room(path: str, size: int) -> None:
    """Refuse a pool file on a file system without room for it (before creating anything)."""
    try:
        fs = os.statvfs(os.path.dirname(os.path.abspath(path)))
    except OSError as exc:
        raise BadRequest(f"cannot use --pool-path {path}: {exc.strerror}") from None
    free = fs.f_bavail * fs.f_frsize
    if free < size:
        raise BadRequest(f"the file system of {path} cannot hold the {format_size(size)} pool "
                         f"({format_size(free)} free): make the tmpfs bigger or the pool smaller")


def map_pool(path: str, size: int) -> tuple[mmap.mmap, memoryview]:
    """Client side: map the daemon's pool by the path it announced."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        # MAP_POPULATE: take the page-table faults once, here, not on every first copy
        # (measured: first touch of a fresh mapping copies at ~1 GB/s, later ones at ~11 GB/s)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return mapping, memoryview(mapping)
