"""The local ledger's invariants (daemon process; tests call them after every step through
`Ledger.validate`). Pure: it reads the ledger, the Store and the page store, and changes nothing.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvd.wire.layout import Extent

from ..store.entries import Store
from ..store.page_store import CacheStore
from .books import LIVE, MAX_WAITS_PER_CONNECTION, Books, Hold, PageHold
from .reservation import WriteState


@dataclass(frozen=True)
class Ledger:
    """What the audit reads of a Ledger (its books, as they are)."""

    books: dict[bytes, Books]
    writers: dict[int, bytes]
    page_owner: dict[int, bytes]
    waiting: int
    store: Store
    pages: CacheStore | None


def audit(ledger: Ledger) -> None:
    """What must hold between two events (tests call it after every step):
    - every token is one connection's: a live reservation's writer is the connection holding it;
    - a write whose writer may still copy (writing, or ended under it) pins its blocks: its entry
      keeps its writer pin, its tier pages stay reserved to it; a live handoff's entry is listed;
    - a tier reservation has a deadline while it is live, none once it ended;
    - every lent scratch block is one connection's loan, and the pool lends no other;
    - the blocks held for writers, loans and pins are allocated, and no two of them overlap."""
    owners: dict[tuple[bool, int], bytes] = {}  # (a tier token?, token): the Store and the page store count apart
    blocks: list[Extent] = []
    for conn, books in ledger.books.items():
        assert not books.empty(), f"empty books kept for {conn!r}"
        for key in [*((False, t) for t in [*books.held, *books.loans]), *((True, t) for t in books.pages)]:
            assert owners.setdefault(key, conn) == conn, f"token {key[1]} held by two connections"
        for token, hold in books.held.items():
            _hold(ledger, conn, token, hold, blocks)
        for token, held in books.pages.items():
            assert ledger.page_owner.get(token) == conn, f"tier token {token} is not {conn!r}'s"
            _pages(ledger, token, held, blocks)
        for token in books.loans:
            blocks += ledger.store._scratch[token]  # (KeyError: a loan the store does not know)
    assert set(ledger.page_owner) == {t for b in ledger.books.values() for t in b.pages}
    assert ledger.waiting == sum(len(books.waits) for books in ledger.books.values()), "waits miscounted"
    assert all(len(books.waits) <= MAX_WAITS_PER_CONNECTION for books in ledger.books.values())
    assert all(ledger.books.get(c) and t in ledger.books[c].held for t, c in ledger.writers.items())
    lent = sum(n for books in ledger.books.values() for n in books.loans.values())
    assert lent == ledger.store.scratch_blocks, f"{ledger.store.scratch_blocks} scratch blocks lent, {lent} accounted"
    _blocks(ledger, blocks)

def _hold(ledger: Ledger, conn: bytes, token: int, hold: Hold, blocks: list[Extent]) -> None:
    assert hold.token == token
    entry, write = hold.entry, hold.write
    if entry is None or write is None:
        return  # a read lease: the Store keeps it (a stream reader's may have been ended by the watch)
    assert entry.token == token and write.state in LIVE, f"a {write.state.value} write still held"
    assert (ledger.writers.get(token) == conn) == (write.state is WriteState.WRITING), \
        f"reservation {token}: its writer pairing does not match its {write.state.value} write"
    assert entry.writer, f"a {write.state.value} write whose blocks are not pinned for its writer"
    if write.state is WriteState.WRITING:
        assert not entry.removed and ledger.store.entries.get(entry.request_id) is entry
    write.validate(pinned=entry.writer, removed=entry.removed)
    assert entry.extents or not entry.total_bytes, f"the blocks of {entry.request_id!r} were freed under its writer"
    blocks += entry.extents

def _pages(ledger: Ledger, token: int, held: PageHold, blocks: list[Extent]) -> None:
    pages = ledger.pages
    assert pages is not None, "tier tokens in a ledger without a page store"
    if held.write is None:
        assert all(page.extents is not None for page in pages.leased(token)), "a pinned page was freed"
        return
    assert held.write.state in LIVE and pages.writing(token), f"tier reservation {token} lost its pages"
    held.write.validate(pinned=True, removed=held.deadline is None)
    for page in pages.pending(token):
        assert page.writing == token and page.extents is not None, "a page freed under its writer"
        if pages.pool is ledger.store.allocator:  # (one pool for both, as the daemon has it)
            blocks += page.extents

def _blocks(ledger: Ledger, held: list[Extent]) -> None:
    """No two holders share a block, and none of them is free."""
    free = ledger.store.allocator._free
    spans = sorted([(start, count, True) for start, count in held] + [(s, n, False) for s, n in free])
    for (a, n, _), (b, _, _) in itertools.pairwise(spans):
        assert a + n <= b, f"blocks {b}.. are held twice (or held and free)"
