"""The disk level under the KV tier's RAM (daemon process): pages written out to `--cache-dir` within
`--cache-disk-size`, read back into the pool when a get misses RAM, found again after a restart.

What is written, and when (docs/kv-tier.md, "the disk level"): every page RAM publishes, whose home
is this node, is written behind its put, the oldest first, by worker threads straight from its pool
blocks (pinned meanwhile); so a page evicted from RAM is usually on disk already, and evicting it
costs nothing. One evicted before its turn (the disk behind) is copied out of the pool at once, up
to STAGING_BYTES, and written first; past that it is lost (a refused spill). A hit on disk reserves
pool room (evicting as a put would, or past the budget for one reader), reads the file straight into
it, checks it, and publishes it as any page; the get is then served from RAM.

Never on the event loop: the reads (READ_THREADS), the writes (WRITE_THREADS), the unlinks and
renames (one thread), the start's scan and the trash (one more). Each queue is bounded: past
READS_IN_FLIGHT reads wait their turn on the loop, past WRITES_IN_FLIGHT pages wait in RAM; a get
waits READ_TIMEOUT for the disk at most. A slow or full disk costs misses and refused spills.
"""
from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvd.throttle import Throttle
from kvd.units import format_size
from kvd.wire.layout import physical_segments

from ...store.page_store import CacheStore, Page
from . import page_files
from .disk_format import Header, namespace_dir, page_path
from .disk_index import DiskIndex, DiskPage
from .latency import Latency
from .readback import READ_TIMEOUT, READS_IN_FLIGHT, ReadBack, Staged

log = logging.getLogger(__name__)

READ_THREADS = 4
WRITE_THREADS = 2
WRITES_IN_FLIGHT = 4  # page writes queued or running (each pins its page's blocks)
STAGING_BYTES = 64 << 20  # pages evicted before they were written, copied out and waiting for the disk
__all__ = ["READS_IN_FLIGHT", "READ_TIMEOUT", "DiskSettings", "DiskTier"]
FULL_BACKOFF = 1.0  # seconds without writes after the disk said it is full or failing
WRITE_PAUSE_ENV = "KVD_TEST_DISK_WRITE_PAUSE"  # tests: each write stops this long halfway through its bytes
READ_PAUSE_ENV = "KVD_TEST_DISK_READ_PAUSE"  # tests: each read waits this long first (a saturated disk)
SCAN_PAUSE_ENV = "KVD_TEST_DISK_SCAN_PAUSE"  # tests: the start's scan waits this long a file (a big directory)

Ident = tuple[str, str]


@dataclass(frozen=True)
class DiskSettings:
    root: str
    budget: int
    max_pages: int
    block_size: int


class DiskTier(ReadBack):
    def __init__(self, settings: DiskSettings, store: CacheStore, pool: memoryview,
                 claimed: page_files.Claimed) -> None:
        self.settings = settings
        self.root = settings.root
        self.store = store
        self.pool = pool
        self.index = DiskIndex(settings.budget, settings.max_pages)
        self.claimed = claimed  # (page_files.claim: the directory checked and locked, before the pool's prefault)
        self._read_pool = ThreadPoolExecutor(READ_THREADS, "kvd-disk-read")
        self._write_pool = ThreadPoolExecutor(WRITE_THREADS, "kvd-disk-write")
        self._admin = ThreadPoolExecutor(1, "kvd-disk-admin")  # unlinks, renames
        self._background = ThreadPoolExecutor(1, "kvd-disk-scan")  # the scan, the trash
        self._stop = threading.Event()
        self._dirty: collections.OrderedDict[Ident, Page] = collections.OrderedDict()  # in RAM, not on disk
        self._staged: collections.OrderedDict[Ident, Staged] = collections.OrderedDict()
        self.staged_bytes = 0
        self._writes: dict[Ident, asyncio.Future] = {}  # page writes in flight
        self._reads = 0  # page reads in flight
        self._read_waiters: collections.deque[asyncio.Future] = collections.deque()  # reads waiting their turn
        self._read_blocks = 0
        self._loading: dict[Ident, asyncio.Task] = {}
        self._clearing: dict[str, int] = {}  # namespaces being cleared: none of their pages is written
        self._cleared_writes: dict[str, list[DiskPage]] = {}  # written while their namespace was cleared
        self._cleared_in_scan: set[str] = set()  # what the scan still posts of these is stale
        self._tasks: set[asyncio.Task] = set()
        self._jobs: set[asyncio.Future] = set()  # every job in the threads: awaited before the pool goes
        self._seen = (0, 0)  # the scan's drops counted so far (corrupt, stale)
        self._pause_until = 0.0
        self._pump_soon = False
        self._closing = False
        self._loop: asyncio.AbstractEventLoop  # (from start())
        self._started = False
        self.is_home: Callable[[str, str], bool] = lambda namespace, key: True  # (from start())
        self.read_latency, self.write_latency = Latency(), Latency()
        self.scan_seconds: float | None = None
        self._throttle = Throttle()
        self._write_pause = float(os.environ.get(WRITE_PAUSE_ENV) or 0)
        self._read_pause = float(os.environ.get(READ_PAUSE_ENV) or 0)

    def start(self, is_home: Callable[[str, str], bool] | None = None) -> None:
        """On the loop: hear of the store's pages from now on, and find the pages the directory holds
        (in the background: they count as found). is_home(namespace, key), with a registry: is this
        node the page's home (a page is written by its home, which answers other nodes from its disk
        too: homes.TierPeers is given this level when it is built)."""
        self.store.follow(self._published, self._evicted, self._unlisted)
        if is_home is not None:
            self.is_home = is_home
        self._loop = asyncio.get_running_loop()
        self._started = True
        started = time.monotonic()

        def post(found: list, corrupt: int, stale: int) -> None:
            self._loop.call_soon_threadsafe(self._found, found, corrupt, stale)

        self._job(self._background, page_files.scan, self.root, post, self._stop, 1000, 2.0,
                  float(os.environ.get(SCAN_PAUSE_ENV) or 0)).add_done_callback(
            lambda fut: self._scanned(fut, started))
        self._job(self._background, page_files.empty_trash, self.root, self._stop)

    def _job(self, executor: ThreadPoolExecutor, fn, *args) -> asyncio.Future:
        fut = self._loop.run_in_executor(executor, fn, *args)
        self._jobs.add(fut)
        fut.add_done_callback(self._jobs.discard)
        return fut

    def spawn(self, coro) -> asyncio.Task:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- the start's scan ------------------------------------------------------------------------

    def _found(self, found: list, corrupt: int, stale: int) -> None:
        for page in found:
            if page.namespace not in self._cleared_in_scan:
                self.index.found(page.namespace, page.key, page.nbytes, page.size)
        self.index.counts.corrupt += corrupt - self._seen[0]
        self.index.counts.stale += stale - self._seen[1]
        self._seen = (corrupt, stale)

    def _scanned(self, fut: asyncio.Future, started: float) -> None:
        self.scan_seconds = time.monotonic() - started
        if self._closing:  # (cut short by the shutdown: nothing to decide on half a directory)
            return
        try:
            report = fut.result()
        except BaseException as exc:  # (a disk that fails its scan: what was found serves, the rest is unknown)
            log.error("disk tier: the scan of %s failed: %s", self.root, exc)
            report = page_files.ScanReport()
        self.index.order([ident for ident in report.order if ident[0] not in self._cleared_in_scan])
        self._cleared_in_scan.clear()
        self.index.ready = True
        evicted = self.index.trim()
        self._unlink(evicted)
        log.info("disk tier: %d pages (%s) found in %s in %.2fs (%d files; %d dropped as corrupt, %d of another "
                 "format version)%s; budget %s", self.index.entries, format_size(self.index.bytes), self.root,
                 self.scan_seconds, report.files, report.corrupt, report.stale,
                 f", {len(evicted)} evicted to fit" if evicted else "", format_size(self.index.budget))
        self._kick()

    # --- the store's hooks: what RAM publishes, evicts, drops -----------------------------------------

    def _published(self, page: Page) -> None:
        if not page.on_disk and self.is_home(page.namespace, page.key):
            self._dirty[(page.namespace, page.key)] = page
            self._kick()

    def _unlisted(self, page: Page) -> None:
        self._dirty.pop((page.namespace, page.key), None)

    def _evicted(self, page: Page) -> None:
        """RAM evicts a page (its blocks still hold its bytes): on disk already, it is now the disk's
        most recent; else it is copied out to be written, room permitting."""
        ident = (page.namespace, page.key)
        if page.on_disk:
            if (held := self.index.lookup(*ident)) is not None:
                self.index.touch(held)
            return
        if self._closing or ident in self._staged or not self.is_home(*ident):
            return
        if self.staged_bytes + page.nbytes > STAGING_BYTES or page.namespace in self._clearing:
            self.index.counts.refused += 1
            if self._throttle.allow("staging"):
                log.warning("disk tier: a page evicted from RAM before the disk took it is lost (%s waiting for "
                            "the disk already); %d refused so far", format_size(self.staged_bytes),
                            self.index.counts.refused)
            return
        data = bytearray(page.nbytes)
        pos = 0
        for off, n in self._segments(page):
            data[pos:pos + n] = self.pool[off:off + n]
            pos += n
        self._staged[ident] = Staged(page.dtype, page.shape, data)
        self.staged_bytes += page.nbytes
        self._kick()

    def _segments(self, page: Page) -> list:
        assert page.extents is not None  # (pinned, or reserved: its blocks are there)
        return physical_segments(page.extents, self.settings.block_size, 0, page.nbytes)

    # --- writing out ---------------------------------------------------------------------------------

    def _kick(self) -> None:
        if not self._pump_soon and self._started:
            self._pump_soon = True
            self._loop.call_soon(self._pump)

    def _pump(self) -> None:
        self._pump_soon = False
        if not self.index.ready or self._closing:
            return
        wait = self._pause_until - time.monotonic()
        if wait > 0:
            self._loop.call_later(wait, self._kick)
            return
        while len(self._writes) < WRITES_IN_FLIGHT and self._start_next():
            pass

    def _start_next(self) -> bool:
        """Start one write: a staged page first (its only copy), else the oldest page of RAM not on
        disk. False: nothing to start now."""
        for queue in (self._staged, self._dirty):
            for ident, item in queue.items():
                if ident[0] in self._clearing:
                    continue
                booked = self.index.reserve(ident[0], ident[1], item.nbytes)
                self._unlink(booked.evicted)
                if booked.page is None and booked.why == "wait":
                    return False  # the unlinks give the room back, and kick
                del queue[ident]
                if queue is self._staged:
                    self.staged_bytes -= item.nbytes
                if booked.page is not None:
                    self._write(booked.page, item)
                elif booked.why == "held" and self.index.lookup(*ident) is not None and isinstance(item, Page):
                    item.on_disk = True  # (put again after it was evicted to disk: the file is there)
                elif booked.why != "held":
                    self.index.counts.refused += 1
                return True
        return False

    def _write(self, target: DiskPage, item: Page | Staged) -> None:
        ident = (target.namespace, target.key)
        if isinstance(item, Page):
            self.store.pin(item)
            pieces: list = [self.pool[off:off + n] for off, n in self._segments(item)]
        else:
            pieces = [item.data]
        header = Header(target.namespace, target.key, item.dtype, tuple(item.shape), item.nbytes, 0,
                        self.settings.block_size)
        fut = self._job(self._write_pool, page_files.write_page, self.root, header, pieces, self._write_pause)
        self._writes[ident] = fut
        fut.add_done_callback(lambda done: self._written(done, target, item))

    def _written(self, fut: asyncio.Future, target: DiskPage, item: Page | Staged) -> None:
        del self._writes[(target.namespace, target.key)]
        if isinstance(item, Page):
            self.store.pin(item, -1)
        ok = not fut.cancelled() and fut.exception() is None
        if not ok and not fut.cancelled():
            self._write_failed(fut.exception(), target)
        if not self.index.written(target, ok):
            if not ok:
                self.index.counts.refused += 1
            else:  # (its namespace was cleared meanwhile: the file goes with the namespace's directory)
                self._cleared_writes.setdefault(target.namespace, []).append(target)
        else:
            self.write_latency.observe(fut.result(), target.nbytes)
            if isinstance(item, Page) and not item.removed:
                item.on_disk = True
        self._kick()

    def _write_failed(self, exc: BaseException | None, target: DiskPage) -> None:
        self._pause_until = time.monotonic() + FULL_BACKOFF
        full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
        if self._throttle.allow("full" if full else "write"):
            log.warning("disk tier: %s (%s): writes pause for %gs, pages wait in RAM meanwhile; %d refused so far",
                        "the disk is full" if full else "a write failed", exc, FULL_BACKOFF,
                        self.index.counts.refused + 1)

    def _unlink(self, pages: list[DiskPage]) -> None:
        for page in pages:
            fut = self._job(self._admin, page_files.unlink, self.root, page_path(page.namespace, page.key))
            fut.add_done_callback(self._unlinked(page))

    def _unlinked(self, page: DiskPage) -> Callable[[asyncio.Future], None]:
        def done(_: asyncio.Future) -> None:
            self.index.deleted(page)
            self._kick()
        return done

    # --- clearing -------------------------------------------------------------------------------------

    def clear(self, namespace: str, in_ram: Callable[[str], bool]) -> tuple[int, asyncio.Task]:
        """Drop a namespace from the disk: unlisted at once (call it before RAM's clear; `in_ram`
        tells the pages RAM holds too, counted there). Returns the pages only the disk held, and a
        task that ends once the files are gone for good: the namespace's directory renamed away
        (durably) after the writes in flight for it end."""
        self._clearing[namespace] = self._clearing.get(namespace, 0) + 1
        _, gone = self.index.clear(namespace)
        only_here = sum(1 for page in gone if not in_ram(page.key))
        for ident in [ident for ident in self._staged if ident[0] == namespace]:
            self.staged_bytes -= self._staged.pop(ident).nbytes
            only_here += 1
        if not self.index.ready:
            self._cleared_in_scan.add(namespace)
        writes = [fut for ident, fut in self._writes.items() if ident[0] == namespace]
        return only_here, self.spawn(self._finish_clear(namespace, gone, writes))

    async def _finish_clear(self, namespace: str, gone: list[DiskPage], writes: list) -> None:
        try:
            if writes:
                await asyncio.wait(writes)
            await self._job(self._admin, page_files.clear_namespace, self.root, namespace_dir(namespace))
        finally:
            for page in gone + self._cleared_writes.pop(namespace, []):
                self.index.deleted(page)
            self._clearing[namespace] -= 1
            if not self._clearing[namespace]:
                del self._clearing[namespace]
            if not self._closing:
                self._job(self._background, page_files.empty_trash, self.root, self._stop)
            self._kick()

    # --- the end ---------------------------------------------------------------------------------------

    async def close(self, flush_for: float) -> None:
        """Write out what RAM holds and the disk does not (within flush_for seconds), wait for the
        threads to be done with the pool, let go of the directory."""
        deadline = time.monotonic() + flush_for
        while self.index.ready and (self._dirty or self._staged) and time.monotonic() < deadline:
            self._pump()
            busy = list(self._writes.values()) or list(self._jobs)
            if not busy:
                break
            await asyncio.wait(busy, timeout=max(0.0, deadline - time.monotonic()),
                               return_when=asyncio.FIRST_COMPLETED)
        if self._dirty or self._staged:
            log.warning("disk tier: %d pages not written out at shutdown", len(self._dirty) + len(self._staged))
        self._closing = True
        self._stop.set()
        while self._tasks or self._jobs:  # (a thread may still copy into or out of the pool)
            await asyncio.wait(self._tasks | self._jobs)
        for executor in (self._read_pool, self._write_pool, self._admin, self._background):
            executor.shutdown(wait=False)
        self.claimed.release()

    def namespace_stats(self, namespace: str) -> dict:
        counts = self.index.namespace(namespace)
        return {"entries": counts.entries, "bytes": counts.bytes}

    def stats(self) -> dict:
        return {**self.index.stats(), "dir": self.root, "staged_bytes": self.staged_bytes, "staged": len(self._staged),
                "unwritten": len(self._dirty), "writes_in_flight": len(self._writes), "reads_in_flight": self._reads,
                "read": self.read_latency.as_dict(), "write": self.write_latency.as_dict(),
                "scan_s": None if self.scan_seconds is None else round(self.scan_seconds, 3)}


def claim_disk(config) -> page_files.Claimed | None:
    """--cache-dir checked and locked (a cheap check, before the pool's prefault), or None without one."""
    if not config.cache_dir:
        return None
    claimed = page_files.claim(config.cache_dir)
    if claimed.leftovers:
        log.info("disk tier: %d files of writes cut short (a kill, a crash) removed from %s/tmp", claimed.leftovers,
                 config.cache_dir)
    return claimed


def disk_tier_for(config, claimed: page_files.Claimed | None, store: CacheStore, memory) -> DiskTier | None:
    if claimed is None:
        return None
    settings = DiskSettings(config.cache_dir, config.cache_disk_size, config.cache_max_pages, config.block_size)
    return DiskTier(settings, store, memory.host_view(), claimed)
