"""The disk level's index (daemon process), pure: which pages are on disk, least recently used
first, within the disk budget (a hard cap on the bytes of their files).

A page on disk is `writing` (its file is being written; not readable yet), `visible`, or gone. A
file evicted or dropped goes on counting against the budget until the caller reports it unlinked
(`deleted`): the budget bounds what the directory holds, not only what the index lists. No write
starts before the directory's scan is over (`ready`), since until then what it holds is unknown.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

from .disk_format import disk_bytes

WRITING, VISIBLE, DELETING = "writing", "visible", "deleting"


@dataclass(slots=True, eq=False)
class DiskPage:
    namespace: str
    key: str
    nbytes: int
    size: int  # its file's bytes, as the budget counts them
    state: str = VISIBLE
    removed: bool = False  # cleared or dropped while it was written: its file is not kept


@dataclass(slots=True)
class DiskCounts:
    hits: int = 0  # pages read back for a get
    misses: int = 0  # pages a get asked of the disk (missing in RAM) that it did not give
    evictions: int = 0  # files deleted for the budget
    corrupt: int = 0  # files dropped: their digest, key, namespace or size did not match, or unreadable
    stale: int = 0  # files of another format version, dropped
    spilled: int = 0  # pages written
    refused: int = 0  # pages not written: no room, the disk full or failing, the queue full
    busy: int = 0  # of the misses: the disk's read queue was full, or a read missed its deadline
    found: int = 0  # pages the start's scan found

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class NamespaceDisk:
    entries: int = 0
    bytes: int = 0


@dataclass
class Reservation:
    """What `reserve` decided: the page to write (None: not now), the files to unlink for it."""

    page: DiskPage | None
    evicted: list[DiskPage] = field(default_factory=list)
    why: str = ""  # when page is None: held, not_ready, too_big, wait (deletions pending), full


class DiskIndex:
    def __init__(self, budget: int, max_pages: int) -> None:
        self.budget = budget
        self.max_pages = max_pages
        self.ready = False  # the scan is over
        self.used = 0  # bytes of the files listed (writing, visible) and of those being deleted
        self.deleting = 0  # of used: files evicted or dropped, not unlinked yet
        self._pages: dict[tuple[str, str], DiskPage] = {}  # writing and visible
        # evicted, dropped or cleared, their file not unlinked yet: no new file of the key is written
        # before that (its unlink would take the new one)
        self._doomed: dict[tuple[str, str], DiskPage] = {}
        self._lru: collections.OrderedDict[tuple[str, str], DiskPage] = collections.OrderedDict()  # visible
        self._by_ns: dict[str, dict[str, DiskPage]] = {}  # namespace -> key -> page (writing and visible)
        self._ns_counts: dict[str, NamespaceDisk] = {}  # namespace -> its visible pages
        self.counts = DiskCounts()
        self.bytes = 0  # page bytes of the visible pages

    # --- looking up ------------------------------------------------------------------------------

    def lookup(self, namespace: str, key: str) -> DiskPage | None:
        """The visible page of a key, or None."""
        page = self._pages.get((namespace, key))
        return page if page is not None and page.state == VISIBLE else None

    def writing(self, namespace: str, key: str) -> DiskPage | None:
        page = self._pages.get((namespace, key))
        return page if page is not None and page.state == WRITING else None

    def touch(self, page: DiskPage) -> None:
        """The page was used: it goes last in the eviction order."""
        if page.state == VISIBLE and self._lru.get((page.namespace, page.key)) is page:
            self._lru.move_to_end((page.namespace, page.key))

    @property
    def entries(self) -> int:
        return len(self._lru)

    def namespace(self, namespace: str) -> NamespaceDisk:
        return self._ns_counts.get(namespace, NamespaceDisk())

    def keys(self, namespace: str) -> list[str]:
        return [key for key, page in self._by_ns.get(namespace, {}).items() if page.state == VISIBLE]

    # --- writing -------------------------------------------------------------------------------------

    def reserve(self, namespace: str, key: str, nbytes: int) -> Reservation:
        """Room for a page's file within the budget, evicting least recently used files for it."""
        if not self.ready:
            return Reservation(None, why="not_ready")
        if (namespace, key) in self._pages:
            return Reservation(None, why="held")
        if (namespace, key) in self._doomed:
            return Reservation(None, why="wait")
        size = disk_bytes(nbytes)
        if size > self.budget:
            return Reservation(None, why="too_big")
        evicted: list[DiskPage] = []
        # (files being deleted will give their room back: count them as gone before evicting more)
        while (self.used - self.deleting + size > self.budget or len(self._pages) >= self.max_pages) and self._lru:
            evicted.append(self._evict_oldest())
        if self.used - self.deleting + size > self.budget or len(self._pages) >= self.max_pages:
            return Reservation(None, evicted, why="full")  # the rest is being written
        if self.used + size > self.budget:
            return Reservation(None, evicted, why="wait")  # once the unlinks are done
        page = DiskPage(namespace, key, nbytes, size, WRITING)
        self._list(page)
        self.used += size
        return Reservation(page, evicted)

    def written(self, page: DiskPage, ok: bool) -> bool:
        """Its write is over (ok: the file is in place). Returns whether it is now visible; if not,
        and ok, the caller unlinks the file, then calls `deleted`."""
        assert page.state == WRITING
        if ok and not page.removed:
            page.state = VISIBLE
            self._lru[(page.namespace, page.key)] = page
            self._visible(page, +1)
            self.counts.spilled += 1
            return True
        self._unlist(page)
        if ok:  # (removed while written: the file is there, and goes)
            self._doom(page)
        else:  # (the file is not there)
            page.state = "gone"
            self.used -= page.size
        return False

    def found(self, namespace: str, key: str, nbytes: int, size: int) -> DiskPage | None:
        """A file the scan found (listed most recent, unless the key is listed already: then None)."""
        if (namespace, key) in self._pages or (namespace, key) in self._doomed:
            return None
        page = DiskPage(namespace, key, nbytes, size, VISIBLE)
        self._list(page)
        self._lru[(namespace, key)] = page
        self._visible(page, +1)
        self.used += size
        self.counts.found += 1
        return page

    def order(self, idents: list[tuple[str, str]]) -> None:
        """Put these listed pages last, in this order (the scan's files by modification time)."""
        for ident in idents:
            if ident in self._lru:
                self._lru.move_to_end(ident)

    def trim(self) -> list[DiskPage]:
        """Evict until the budget and the page count hold (the scan found more than they allow)."""
        evicted = []
        while (self.used - self.deleting > self.budget or len(self._pages) > self.max_pages) and self._lru:
            evicted.append(self._evict_oldest())
        return evicted

    # --- removal --------------------------------------------------------------------------------------

    def drop(self, page: DiskPage) -> bool:
        """Unlist a visible page (its file failed a check, or is gone); True if it was listed. The
        caller unlinks the file, then calls `deleted`."""
        if page.state != VISIBLE or self._pages.get((page.namespace, page.key)) is not page:
            return False
        self._unlist(page)
        self._doom(page)
        return True

    def deleted(self, page: DiskPage) -> None:
        """The file of an evicted, dropped or cleared page is unlinked: its bytes are free."""
        assert page.state == DELETING
        page.state = "gone"
        self.used -= page.size
        self.deleting -= page.size
        ident = (page.namespace, page.key)
        if self._doomed.get(ident) is page:
            del self._doomed[ident]

    def clear(self, namespace: str) -> tuple[int, list[DiskPage]]:
        """Unlist a namespace: returns how many visible pages it had, and those pages (their files
        go with the namespace's directory; the caller calls `deleted` for each once it is gone).
        Pages being written are marked removed: their write does not make them visible."""
        pages = list(self._by_ns.get(namespace, {}).values())
        gone = []
        for page in pages:
            if page.state == WRITING:
                page.removed = True
                continue
            self._unlist(page)
            self._doom(page)
            gone.append(page)
        return len(gone), gone

    def _evict_oldest(self) -> DiskPage:
        _, page = next(iter(self._lru.items()))
        self._unlist(page)
        self._doom(page)
        self.counts.evictions += 1
        return page

    def _doom(self, page: DiskPage) -> None:
        page.state = DELETING
        self.deleting += page.size
        self._doomed[(page.namespace, page.key)] = page

    def _list(self, page: DiskPage) -> None:
        self._pages[(page.namespace, page.key)] = page
        self._by_ns.setdefault(page.namespace, {})[page.key] = page

    def _unlist(self, page: DiskPage) -> None:
        ident = (page.namespace, page.key)
        del self._pages[ident]
        keys = self._by_ns[page.namespace]
        del keys[page.key]
        if not keys:
            del self._by_ns[page.namespace]
        if page.state == VISIBLE:
            del self._lru[ident]
            self._visible(page, -1)

    def _visible(self, page: DiskPage, sign: int) -> None:
        counts = self._ns_counts.setdefault(page.namespace, NamespaceDisk())
        counts.entries += sign
        counts.bytes += sign * page.nbytes
        self.bytes += sign * page.nbytes
        if not counts.entries:
            del self._ns_counts[page.namespace]

    # --- reading the state ------------------------------------------------------------------------------

    def stats(self) -> dict:
        return {**self.counts.as_dict(), "entries": self.entries, "bytes": self.bytes, "used_bytes": self.used,
                "deleting_bytes": self.deleting, "budget": self.budget, "max_pages": self.max_pages,
                "writing": len(self._pages) - len(self._lru), "ready": self.ready}

    def check_invariants(self) -> None:
        """For tests: the counts agree with the pages, the budget holds (once the scan is over)."""
        listed = list(self._pages.values())
        assert {(p.namespace, p.key) for p in listed if p.state == VISIBLE} == set(self._lru)
        assert all(p.state in (WRITING, VISIBLE) for p in listed)
        assert all(p.state == DELETING for p in self._doomed.values())
        assert self.used == sum(p.size for p in listed) + self.deleting
        assert self.deleting == sum(p.size for p in self._doomed.values())
        if self.ready:
            assert self.used <= self.budget and len(self._pages) <= self.max_pages
        assert self.bytes == sum(p.nbytes for p in self._lru.values())
        assert {(ns, k) for ns, keys in self._by_ns.items() for k in keys} == set(self._pages)
        assert sum(c.entries for c in self._ns_counts.values()) == len(self._lru)
