"""The KV tier's entries (daemon process): evictable pages by (namespace, key), LRU within a budget.

Pure bookkeeping beside the handoff store (`entries.py`): both take blocks from one pool
(`SharedPool`). A handoff is never evicted; when one needs blocks the pool lacks, cache
entries go first, least recently used first. Cache entries live within `budget_blocks`, a cap
(not a reservation: handoffs may squeeze the tier to nothing).

An entry is written by one client (`reserve`, then `commit`), after which it is visible and
never changes. Reads never consume it: `lease` pins the hits for one reader, `release` unpins
them. A pinned entry is never freed: eviction skips it, a clear or delete only unlists it (its
blocks parked until its last reader lets go). Tokens name one batch's reservation or lease; the
local core (`kvd.daemon.local.ledger`) ties them to the connection that got them.
"""
from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvd.errors import BadRequest, PoolFull
from kvd.wire.layout import Extent

from .allocator import BlockAllocator
from .page_names import check_batch, page_size
from .tier_events import REMOVED, STORED, TierEvents

TOP_NAMESPACES = 16  # namespaces shown by name in stats and metrics (by bytes held); the rest summed
MAX_NAMESPACES = 65536  # namespaces with counters of their own; past it, only the totals count


class SharedPool(BlockAllocator):
    """The pool's allocator, shared by handoffs and the tier: a handoff's allocation that does not
    fit asks `reclaim(blocks short)` (the tier evicts) before it is refused."""

    reclaim: Callable[[int], None] | None = None

    def allocate(self, count: int, evict: bool = True) -> list[Extent]:
        if evict and count > self.free_blocks and self.reclaim is not None:
            self.reclaim(count - self.free_blocks)
        return super().allocate(count)


@dataclass(slots=True, eq=False)
class Page:
    """One cache entry: a page's bytes, with the dtype and shape it was stored with."""

    namespace: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    extents: list[Extent] | None  # None once freed
    blocks: int
    writing: int = 0  # the reservation's token until committed; 0: committed (visible)
    readers: int = 0  # leases pinning it
    removed: bool = False
    parked: bool = False  # removed while pinned or written: its blocks wait for the reader or writer
    on_disk: bool = False  # the disk level (disk/level.py) holds it too: evicting it loses nothing
    over: bool = False  # reserved past the budget (in transit, for one reader): its blocks take no room from it


@dataclass(slots=True)
class Counts:
    """Counters of one namespace (and of all)."""

    hits: int = 0
    misses: int = 0
    stored: int = 0
    refused: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"hits": self.hits, "misses": self.misses, "stored": self.stored, "refused": self.refused,
                "evictions": self.evictions, "entries": self.entries, "bytes": self.bytes}


class CacheStore:
    def __init__(self, pool: SharedPool, block_size: int, budget_bytes: int, max_pages: int = 1 << 20,
                 namespace_pages: int = 0) -> None:
        self.pool = pool
        self.block_size = block_size
        self.budget_blocks = max(0, budget_bytes // block_size)
        # pages listed (visible or being written), in all and per namespace: each costs ~1 KB of our
        # memory beside its blocks, so a flood of tiny pages meets a count as well as the budget
        self.max_pages = max_pages
        self.namespace_pages = namespace_pages or max_pages
        self._listed: dict[str, int] = {}  # namespace -> its pages listed (no entry: none)
        self._ns_lru: dict[str, collections.OrderedDict[str, Page]] = {}  # namespace -> its visible pages, LRU first
        self.blocks = 0  # held by pages: visible, being written, or parked under a reader
        self.parked_blocks = 0  # of those: removed pages a reader still pins
        self.over_blocks = 0  # of those: pages reserved past the budget (the budget is checked without them)
        self._pages: dict[tuple[str, str], Page] = {}  # visible and being written
        self._lru: collections.OrderedDict[tuple[str, str], Page] = collections.OrderedDict()  # visible, oldest first
        self._writes: dict[int, list[Page]] = {}
        self._reads: dict[int, list[Page]] = {}
        self._tokens = itertools.count(1)
        self.clears = 0  # namespaces cleared so far (a fetch that spans one keeps nothing it brought)
        self.total = Counts()
        self._by_ns: dict[str, Counts] = {}
        self.events = TierEvents()  # pages stored and removed, for the namespaces a client follows
        pool.reclaim = self.reclaim
        self.on_published: Callable[[Page], None] | None = None  # the disk level's hooks (`follow`)
        self.on_evicted: Callable[[Page], None] | None = None  # (its blocks still hold its bytes)
        self.on_unlisted: Callable[[Page], None] | None = None

    def follow(self, on_published: Callable[[Page], None], on_evicted: Callable[[Page], None],
               on_unlisted: Callable[[Page], None]) -> None:
        """The disk level's, from its start: a page published, one about to be evicted, one unlisted."""
        self.on_published, self.on_evicted, self.on_unlisted = on_published, on_evicted, on_unlisted

    @property
    def budget_bytes(self) -> int:
        return self.budget_blocks * self.block_size

    def _counts(self, namespace: str) -> Counts:
        counts = self._by_ns.get(namespace)
        if counts is None:
            counts = Counts()
            if len(self._by_ns) < MAX_NAMESPACES:  # (any client may name any namespace)
                self._by_ns[namespace] = counts
        return counts

    # --- writing -------------------------------------------------------------------------------

    def reserve(self, namespace: str, keys: list[str], pages: list[Any], over_budget: bool = False,
                count: bool = True) -> tuple[int, list[Page | bool]]:
        """Room for a batch of pages ([dtype, shape] each): per key a Page to write (then `commit`
        the token), True (already held or being written: nothing to do) or False (refused:
        over the budget, the pool full of what cannot be evicted). BadRequest for bad input,
        before anything is reserved."""
        check_batch(namespace, keys)
        if not isinstance(pages, list) or len(pages) != len(keys):
            raise BadRequest("a cache put names one [dtype, shape] per key")
        sizes = []
        for page in pages:
            if not isinstance(page, list) or len(page) != 2:
                raise BadRequest(f"a page is described as [dtype, shape], got {str(page)[:80]}")
            sizes.append(page_size(page[0], page[1]))
        token = next(self._tokens)
        counts = self._counts(namespace)
        results: list[Page | bool] = []
        written: list[Page] = []
        for key, (dtype, shape), nbytes in zip(keys, pages, sizes, strict=True):
            if (namespace, key) in self._pages:
                results.append(True)
                continue
            blocks = max(1, -(-nbytes // self.block_size))  # (an empty page too: it costs a block, as any)
            extents = self._take(blocks, over_budget) if over_budget or self._room_for_page(namespace) else None
            if extents is None:
                counts.refused += count
                self.total.refused += count
                results.append(False)
                continue
            page = Page(namespace, key, dtype, tuple(shape), nbytes, extents, blocks, writing=token, over=over_budget)
            self.over_blocks += blocks if over_budget else 0
            self._pages[(namespace, key)] = page
            self._listed[namespace] = self._listed.get(namespace, 0) + 1
            self.blocks += blocks
            written.append(page)
            results.append(page)
        if written:
            self._writes[token] = written
        return token, results

    def _room_for_page(self, namespace: str) -> bool:
        """Room for one more page within the page counts, evicting the namespace's own least recently
        used at its cap, then the least recently used of all at the total; False if it cannot be made."""
        while self._listed.get(namespace, 0) >= self.namespace_pages:
            if not self._evict_one(namespace):
                return False
        while len(self._pages) >= self.max_pages:
            if not self._evict_one():
                return False
        return True

    def _take(self, blocks: int, over_budget: bool = False) -> list[Extent] | None:
        """Blocks for a new page within the budget, evicting LRU pages; None if it cannot fit.
        over_budget: a page in transit (fetched for one reader, dropped once read) may pass it."""
        if blocks > self.budget_blocks and not over_budget:
            return None
        while self.blocks - self.over_blocks + blocks > self.budget_blocks and not over_budget:
            if not self._evict_one():
                return None
        while True:
            try:
                return self.pool.allocate(blocks, evict=False)
            except PoolFull:  # handoffs hold the rest of the pool: make room from our own pages
                if not self._evict_one():
                    return None

    def commit(self, token: int, ok: bool = True) -> list[bool]:
        """The writer copied the batch's bytes (ok) or gave up: its pages become visible, or go.
        Returns, per page it reserved (in key order), whether it became visible (a page cleared
        meanwhile is freed, not published)."""
        published: list[bool] = []
        for page in self._writes.pop(token, ()):
            page.writing = 0
            published.append(ok and not page.removed)
            if page.removed:  # cleared while it was written: its blocks waited for this
                self._free_if_unused(page)
            elif ok:
                self._lru[(page.namespace, page.key)] = page
                self._ns_lru.setdefault(page.namespace, collections.OrderedDict())[page.key] = page
                counts = self._counts(page.namespace)
                for c in (counts, self.total):
                    c.stored += 1
                    c.entries += 1
                    c.bytes += page.nbytes
                if self.on_published is not None:
                    self.on_published(page)
                self.events.note(page.namespace, STORED, page.key)
            else:
                self._unlist(page, visible=False)
                self._free_if_unused(page)
        return published

    def expire(self, token: int) -> None:
        """A reservation's lease ran out while its writer may still be copying: its pages are
        unlisted (nobody reads them, a new put of the key reserves afresh) and their blocks stay
        parked until the writer's commit or hang-up (`commit(token, ok=False)`) lets go of them."""
        for page in self._writes.get(token, ()):
            self._remove(page)

    def writing(self, token: int) -> bool:
        return token in self._writes

    def pending(self, token: int) -> list[Page]:
        """The pages a reservation writes, in key order (what its commit answers for)."""
        return list(self._writes.get(token, ()))

    # --- reading ---------------------------------------------------------------------------------

    def lease(self, namespace: str, keys: list[str], sizes: list[int],
              count: bool = True) -> tuple[int, list[Page | None]]:
        """Pin the hits of a batch for one reader: per key its Page, or None (absent, being
        written, or not `sizes[i]` bytes). Hits become the most recently used."""
        check_batch(namespace, keys)
        if not isinstance(sizes, list) or len(sizes) != len(keys) or not all(type(s) is int for s in sizes):
            raise BadRequest("a cache get names one size in bytes (an int) per key")
        token = next(self._tokens)
        counts = self._counts(namespace)
        found: list[Page | None] = []
        pinned: list[Page] = []
        lru, pages = self._lru, self._pages
        for key, size in zip(keys, sizes, strict=True):
            page = pages.get((namespace, key))
            if page is None or page.writing or page.nbytes != size:
                found.append(None)
                continue
            lru.move_to_end((namespace, key))
            self._ns_lru[namespace].move_to_end(key)
            page.readers += 1
            pinned.append(page)
            found.append(page)
        hits = len(pinned) if count else 0
        misses = len(keys) - len(pinned) if count else 0
        counts.hits += hits
        counts.misses += misses
        self.total.hits += hits
        self.total.misses += misses
        if pinned:
            self._reads[token] = pinned
        return token, found

    def leased(self, token: int) -> list[Page]:
        return list(self._reads.get(token, ()))

    def release(self, token: int) -> bool:
        """The reader copied out (or gave up): unpin its pages. False for an unknown token."""
        pinned = self._reads.pop(token, None)
        if pinned is None:
            return False
        for page in pinned:
            page.readers -= 1
            self._free_if_unused(page)
        return True

    def exists(self, namespace: str, keys: list[str]) -> int:
        """How many keys, from the first, are held (SGLang's batch_exists). Touches nothing."""
        check_batch(namespace, keys)
        count = 0
        for key in keys:
            page = self._pages.get((namespace, key))
            if page is None or page.writing:
                break
            count += 1
        return count

    def pin(self, page: Page, by: int = 1) -> None:
        """Keep (by=1) or let go of (-1) a page's blocks for a reader without a lease (the disk level)."""
        page.readers += by
        self._free_if_unused(page)

    def held_size(self, namespace: str, key: str) -> int | None:
        """The byte size of the visible page under a key, or None (absent, or still being written)."""
        page = self._pages.get((namespace, key))
        return None if page is None or page.writing else page.nbytes

    # --- removal ----------------------------------------------------------------------------------

    def clear(self, namespace: str) -> int:
        """Drop every page of a namespace (those being written are dropped at their commit);
        returns how many visible pages went."""
        check_batch(namespace, [])
        self.clears += 1
        doomed = [page for (ns, _), page in self._pages.items() if ns == namespace]
        dropped = 0
        for page in doomed:
            dropped += not page.writing
            self._remove(page)
        return dropped

    def drop(self, page: Page) -> None:
        """Remove one page (parked while a reader pins it)."""
        self._remove(page)

    def reclaim(self, short: int) -> None:
        """A handoff needs `short` more free blocks than the pool has: evict LRU pages until it
        has them, or until nothing unpinned is left."""
        target = self.pool.free_blocks + short
        while self.pool.free_blocks < target and self._evict_one():
            pass

    def _evict_one(self, namespace: str | None = None) -> bool:
        """Evict the least recently used page nobody reads (of one namespace, or of all); False if
        there is none."""
        lru: Iterable[Page] = (self._lru.values() if namespace is None
                               else self._ns_lru.get(namespace, collections.OrderedDict()).values())
        for page in lru:
            if not page.readers:
                counts = self._counts(page.namespace)
                counts.evictions += 1
                self.total.evictions += 1
                if self.on_evicted is not None:
                    self.on_evicted(page)
                self._remove(page)
                return True
        return False

    def _remove(self, page: Page) -> None:
        if page.removed:
            return
        self._unlist(page, visible=not page.writing)
        self._free_if_unused(page)

    def _unlist(self, page: Page, visible: bool) -> None:
        page.removed = True
        ident = (page.namespace, page.key)
        if self._pages.get(ident) is page:
            del self._pages[ident]
            listed = self._listed[page.namespace] - 1
            if listed:
                self._listed[page.namespace] = listed
            else:
                del self._listed[page.namespace]
        if visible and self._lru.pop(ident, None) is page:
            by_ns = self._ns_lru[page.namespace]
            del by_ns[page.key]
            if not by_ns:
                del self._ns_lru[page.namespace]
            counts = self._counts(page.namespace)
            for c in (counts, self.total):
                c.entries -= 1
                c.bytes -= page.nbytes
            if self.on_unlisted is not None:
                self.on_unlisted(page)
            self.events.note(page.namespace, REMOVED, page.key)
        if page.readers or page.writing:  # someone may still copy: the blocks wait for them
            page.parked = True
            self.parked_blocks += page.blocks

    def _free_if_unused(self, page: Page) -> None:
        if page.removed and not page.readers and not page.writing and page.extents is not None:
            if page.parked:
                page.parked = False
                self.parked_blocks -= page.blocks
            self.pool.free(page.extents)
            page.extents = None
            self.blocks -= page.blocks
            self.over_blocks -= page.blocks if page.over else 0

    # --- reading the state -------------------------------------------------------------------------

    def stats(self, namespace: str | None = None) -> dict[str, Any]:
        """Counters: of one namespace, or of all with the biggest namespaces by name."""
        base = {"budget": self.budget_bytes, "block_size": self.block_size, "max_pages": self.max_pages,
                "namespace_pages": self.namespace_pages}
        if namespace is not None:
            check_batch(namespace, [])
            counts = self._by_ns.get(namespace, Counts())
            return {**counts.as_dict(), **base, "namespace": namespace}
        top = sorted(self._by_ns.items(), key=lambda item: (-item[1].bytes, item[0]))[:TOP_NAMESPACES]
        return {**self.total.as_dict(), **base, "used_bytes": self.blocks * self.block_size,
                "parked_bytes": self.parked_blocks * self.block_size, "namespaces": len(self._by_ns),
                "top_namespaces": {ns: counts.as_dict() for ns, counts in top},
                "writes_open": len(self._writes), "reads_open": len(self._reads)}

    def namespaces(self) -> Iterable[tuple[str, Counts]]:
        return self._by_ns.items()

    def check_invariants(self) -> None:
        """For tests: the counters agree with the pages, pinned pages are never freed."""
        visible = [p for p in self._pages.values() if not p.writing]
        assert set(self._lru) == {(p.namespace, p.key) for p in visible}
        assert self.total.entries == len(visible)
        assert self.total.bytes == sum(p.nbytes for p in visible)
        for pinned in self._reads.values():
            assert all(p.extents is not None for p in pinned)
        assert self.blocks == sum(p.blocks for p in self._pages.values()) + self.parked_blocks
        listed = collections.Counter(ns for ns, _ in self._pages)
        assert self._listed == dict(listed)
        assert len(self._pages) <= self.max_pages and all(n <= self.namespace_pages for n in listed.values())
        assert {(ns, key) for ns, pages in self._ns_lru.items() for key in pages} == set(self._lru)
