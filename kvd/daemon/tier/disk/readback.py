"""The disk level's reads (daemon process): which pages a get may find on disk, and reading them
back into the pool, checked, as pages of RAM (`DiskTier` in tier.py is the rest of the disk level).

A hit on disk reserves pool room (evicting as a put would; past the RAM budget, for one reader,
when RAM has no room), reads the file straight into those blocks in a worker thread, checks it
(`page_files.read_page`) and publishes it; the get is then served from RAM as any hit. A read that
fails a check is a miss: counted, logged (at most once a minute), its file dropped. A get waits
READ_TIMEOUT for the disk; past READS_IN_FLIGHT reads in flight, the others wait their turn within it.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvd.errors import BadRequest
from kvd.throttle import Throttle

from ...store.page_store import CacheStore, Page
from . import page_files
from .disk_format import BadPage, disk_bytes
from .disk_index import DiskIndex, DiskPage

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from .latency import Latency

log = logging.getLogger(__name__)

READS_IN_FLIGHT = 64  # page reads queued or running; past it they wait (until their get's deadline: then a miss)
READ_TIMEOUT = 1.0  # seconds a get waits for the disk; a read later than that still lands in RAM

Ident = tuple[str, str]


@dataclass(slots=True)
class Staged:
    """A page evicted from RAM before the disk took it: its bytes, copied out."""

    dtype: str
    shape: tuple
    data: bytearray

    @property
    def nbytes(self) -> int:
        return len(self.data)


Loaded = tuple[Page, bool]  # a page read back, pinned for the get that asked; past the RAM budget


def _result(task: asyncio.Task) -> Loaded | None:
    return None if task.cancelled() or task.exception() is not None else task.result()


class ReadBack:
    """The read side of `DiskTier` (its attributes, set there)."""

    store: CacheStore
    index: DiskIndex
    pool: memoryview
    root: str
    read_latency: Latency
    _read_pool: ThreadPoolExecutor
    _staged: collections.OrderedDict[Ident, Staged]
    _writes: dict[Ident, asyncio.Future]
    _loading: dict[Ident, asyncio.Task]
    _reads: int
    _read_waiters: collections.deque[asyncio.Future]
    _read_blocks: int  # pool blocks of the pages read back within the budget, not yet let go of by their get
    staged_bytes: int
    _read_pause: float
    _closing: bool
    _clearing: dict[str, int]
    _cleared_in_scan: set[str]
    _throttle: Throttle
    if TYPE_CHECKING:  # (DiskTier's)
        def spawn(self, coro) -> asyncio.Task: ...
        def _job(self, executor: ThreadPoolExecutor, fn, *args) -> asyncio.Future: ...
        def _segments(self, page: Page) -> list: ...
        def _unlink(self, pages: list[DiskPage]) -> None: ...

    # --- reading back -------------------------------------------------------------------------------

    def _held_size(self, namespace: str, key: str) -> int | None:
        held = self.index.lookup(namespace, key) or self.index.writing(namespace, key)
        if held is not None and not held.removed:
            return held.nbytes
        staged = self._staged.get((namespace, key))
        return None if staged is None else staged.nbytes

    def held(self, namespace: str, key: str) -> bool:
        return self._held_size(namespace, key) is not None

    def probing(self, namespace: str) -> bool:
        """The start's scan is not over: a page it has not listed yet may be in its file (a read of it
        is checked as any); not for a namespace being cleared, or cleared since the start."""
        return not self.index.ready and namespace not in self._clearing and namespace not in self._cleared_in_scan

    async def probe(self, namespace: str, keys: list[str], held_here: Callable[[str], bool]) -> int:
        """How many keys, from the first, are held (`held_here`: RAM, the index) or, while the scan
        runs, in a whole file of theirs (its header read and checked; then listed)."""
        count = 0
        while count < len(keys):
            chunk = keys[count:count + READS_IN_FLIGHT]
            for found in await asyncio.gather(*(self._probe_one(namespace, key, held_here) for key in chunk)):
                if not found:
                    return count
                count += 1
        return count

    async def _probe_one(self, namespace: str, key: str, held_here: Callable[[str], bool]) -> bool:
        if held_here(key) or self.held(namespace, key):
            return True
        if not self.probing(namespace):
            return False
        try:
            header = await self._job(self._read_pool, page_files.probe, self.root, namespace, key)
        except OSError:
            return False
        if header is None or not self.probing(namespace):
            return False
        self.index.found(namespace, key, header.nbytes, disk_bytes(header.nbytes))
        return True

    def wanted(self, namespace: str, keys: list[str], sizes: list[int], indices, strict: bool = True) -> list[int]:
        """Of these indices (keys RAM misses), those the disk holds; a page held at another size than
        the get's out is the caller's bug, as it is in RAM (BadRequest; strict=False: a miss)."""
        out = []
        for i in indices:
            held = self._held_size(namespace, keys[i])
            if held is None and self.probing(namespace):  # (the scan may not have reached it yet)
                out.append(i)
            elif held is None or (held != sizes[i] and not strict):
                self.index.counts.misses += 1
            elif held != sizes[i]:
                raise BadRequest(f"cache_get: page {keys[i]!r} of namespace {namespace!r} holds {held} bytes, "
                                 f"and the out given for it has {sizes[i]}: give an out of the page's size")
            else:
                out.append(i)
        return out

    async def load(self, namespace: str, keys: list[str], sizes: list[int], indices: list[int]) -> list[Loaded]:
        """Read these pages back into RAM (within READ_TIMEOUT; later ones land there for the next get).
        Returns those this call read back, each pinned until `release`: the caller's lease takes them
        first (a batch bigger than RAM would evict its own pages otherwise). A page another call is
        reading back already is waited for, and found in RAM (not returned)."""
        own, others = [], []
        deadline = time.monotonic() + READ_TIMEOUT
        for i in indices:
            ident = (namespace, keys[i])
            task = self._loading.get(ident)
            if task is not None:
                others.append(task)
                continue
            task = self._loading[ident] = self.spawn(self._load_one(namespace, keys[i], sizes[i], deadline))
            task.add_done_callback(self._loaded(ident))
            own.append(task)
        if not own and not others:
            return []
        try:
            done, late = await asyncio.wait(own + others, timeout=READ_TIMEOUT)
        except asyncio.CancelledError:
            done, late = set(), set(own)
            raise
        finally:
            self.index.counts.busy += len(late)
            for task in late & set(own):  # (they land in RAM for the next get; their pins go then)
                task.add_done_callback(self._release_late)
        return [result for task in own if task in done and (result := _result(task)) is not None]

    def release(self, loaded: list[Loaded]) -> None:
        """The caller's lease holds them now: their pins end (a page past the budget goes with its reader)."""
        for page, transit in loaded:
            if transit:
                self.store.drop(page)
            else:
                self._read_blocks -= page.blocks
            self.store.pin(page, -1)

    def _abandon(self, page: Page, token: int, transit: bool) -> None:
        """A read that failed: its blocks go (once its thread is done with them)."""
        self.store.commit(token, ok=False)
        self._read_blocks -= 0 if transit else page.blocks

    def _release_late(self, task: asyncio.Task) -> None:
        if (result := _result(task)) is not None:
            self.release([result])

    def _loaded(self, ident: Ident) -> Callable[[asyncio.Task], None]:
        def done(task: asyncio.Task) -> None:
            if self._loading.get(ident) is task:
                del self._loading[ident]
        return done

    async def _read_slot(self, deadline: float) -> bool:
        """One of READS_IN_FLIGHT reads, first come first served, if one frees up before the deadline."""
        if self._reads < READS_IN_FLIGHT and not self._read_waiters:
            self._reads += 1
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._read_waiters.append(waiter)
        try:
            await asyncio.wait([waiter], timeout=max(0.0, deadline - time.monotonic()))
        finally:
            if not waiter.done():
                waiter.cancel()
        return not waiter.cancelled()

    def _free_slot(self) -> None:
        while self._read_waiters:  # (handed to the next waiter: the count stays)
            waiter = self._read_waiters.popleft()
            if not waiter.done():
                waiter.set_result(True)
                return
        self._reads -= 1

    async def _load_one(self, namespace: str, key: str, size: int, deadline: float) -> Loaded | None:
        ident = (namespace, key)
        if (writing := self._writes.get(ident)) is not None:
            await asyncio.wait([writing])  # its file is in place once the write is over
        if (staged := self._staged.get(ident)) is not None:
            return self._unstage(ident, staged)
        held = self.index.lookup(namespace, key)
        probe = held is None and self.probing(namespace)  # (found by its name, then listed)
        if (held is None and not probe) or (held is not None and held.nbytes != size) or self._closing:
            self.index.counts.misses += 1
            return None
        if not await self._read_slot(deadline):  # (a queue past its get's deadline: a miss)
            self.index.counts.misses += 1
            return None
        now = self.index.lookup(namespace, key)
        if probe and now is not None:  # (the scan listed it meanwhile)
            held, probe = now, False
        if now is not held or self._closing or (probe and not self.probing(namespace)):
            self._free_slot()
            self.index.counts.misses += 1
            return None
        room = self._room(namespace, key, size)
        if room is None:
            self._free_slot()
            return None
        page, token, transit = room
        dest = [self.pool[off:off + n] for off, n in self._segments(page)]
        job = self._job(self._read_pool, page_files.read_page, self.root, namespace, key, size, dest, self._read_pause,
                        probe)
        try:
            header, seconds = await asyncio.shield(job)
        except asyncio.CancelledError:  # (the blocks go only once the thread is done with them)
            job.add_done_callback(lambda _: self._abandon(page, token, transit))
            raise
        except Exception as exc:
            self._abandon(page, token, transit)
            self._read_failed(held, exc, key)
            return None
        finally:
            self._free_slot()
        page.dtype, page.shape, page.on_disk = header.dtype, header.shape, True
        if not self.store.commit(token)[0]:  # (cleared meanwhile)
            self._read_blocks -= 0 if transit else page.blocks
            return None
        self.store.pin(page)  # (for the get that asked: `release`)
        self.read_latency.observe(seconds, size)
        if held is None and self.probing(namespace):
            held = self.index.found(namespace, key, size, disk_bytes(size))
        if held is not None:
            self.index.touch(held)
        self.index.counts.hits += 1
        return page, transit

    def _room(self, namespace: str, key: str, size: int) -> tuple[Page, int, bool] | None:
        """Pool room for a page read back: within the RAM budget (evicting), else past it for one
        reader. The pages read back and not yet let go of by their get hold at most half the RAM
        budget (past it, past the budget): a slow disk must not take all of RAM's room from puts."""
        keep = self._read_blocks * 2 < self.store.budget_blocks
        for transit in (False, True) if keep else (True,):
            token, (result,) = self.store.reserve(namespace, [key], [["uint8", [size]]], over_budget=transit,
                                                  count=False)
            if isinstance(result, Page):
                self._read_blocks += 0 if transit else result.blocks
                return result, token, transit
            if result is True:  # (in RAM now, or being put there)
                return None
        self.index.counts.misses += 1
        return None

    def _unstage(self, ident: Ident, staged: Staged) -> Loaded | None:
        """A page waiting in staging comes back to RAM from there (and is written from RAM later)."""
        room = self._room(ident[0], ident[1], staged.nbytes)
        if room is None:
            return None
        page, token, transit = room
        pos = 0
        for off, n in self._segments(page):
            self.pool[off:off + n] = staged.data[pos:pos + n]
            pos += n
        if self._staged.get(ident) is staged:
            del self._staged[ident]
            self.staged_bytes -= staged.nbytes
        page.dtype, page.shape = staged.dtype, staged.shape
        if not self.store.commit(token)[0]:
            self._read_blocks -= 0 if transit else page.blocks
            return None
        self.store.pin(page)
        self.index.counts.hits += 1
        return page, transit

    def _read_failed(self, held: DiskPage | None, exc: BaseException, key: str) -> None:
        """held None: a file the scan had not listed (a probe)."""
        self.index.counts.misses += 1
        if isinstance(exc, page_files.Absent):
            if held is not None and self.index.drop(held):
                self.index.deleted(held)
            return
        if isinstance(exc, BadPage):
            if exc.stale:
                self.index.counts.stale += 1
            else:
                self.index.counts.corrupt += 1
            if held is not None and self.index.drop(held):  # (the read removed the file)
                self.index.deleted(held)
        else:  # an I/O error: the file goes too (a disk that fails a read may fail it again)
            self.index.counts.corrupt += 1
            if held is not None and self.index.drop(held):
                self._unlink([held])
        if self._throttle.allow("corrupt"):
            log.warning("disk tier: page %r dropped: %s (a miss; %d dropped so far, this message at most once a "
                        "minute)", key, getattr(exc, "reason", None) or exc,
                        self.index.counts.corrupt + self.index.counts.stale)
