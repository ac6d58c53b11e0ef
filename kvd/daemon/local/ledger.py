"""The local side's core (daemon process): who holds what on this node, and what follows when
something happens to it. Pure: no sockets, no loop; events in, actions out (`events.py`).

A local client connection holds reservations it writes into (a handoff between put_slots and its
commit, or a batch of tier pages between cache_slots and its cache_commit, each with its
`LocalWrite`), read leases (a get between get_slots and get_done), pins of tier pages (a cache_get
until its cache_release), loans of scratch blocks (one per small put it may have in flight), and
answers it is owed. Tokens are bound to their connection: another connection naming one finds
nothing. It also keeps each connection's gets that wait for their entry (bounded per connection),
called off when it goes. `LocalLedger.handle(event)` is the only way its books change; it frees and parks blocks in
the Store and the page store itself (pure bookkeeping too) and returns what the shell must carry
out (`put_side`, `handlers`, `tier/service`). `validate()` checks the invariants between events.

The rule that matters most: a block a writer may still write into is never freed. A reservation
removed under its writer (deleted, its lease ran out, its push failed) ends, but its blocks stay
parked until the writer commits, gives up or hangs up; handoffs and tier pages follow the same
machine (`reservation.py`), so the tier's late writer cannot come back.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvd.errors import BadRequest, KvdError, NotFound, Timeout

from ..store.entries import Store
from ..store.entry import Entry, State
from ..store.page_store import CacheStore
from . import events as ev
from .audit import Ledger, audit
from .books import MAX_WAITS_PER_CONNECTION, Books, Hold, PageHold
from .reservation import LocalWrite, WriteAction, WriteEvent

PRUNE_AT = 1024  # per connection: holds tracked before ended ones are pruned


class LocalLedger:
    def __init__(self, store: Store, pages: CacheStore | None, lease_timeout: float) -> None:
        self.store = store
        self.pages = pages  # the KV tier's page store (None: a ledger of handoffs only)
        self.lease_timeout = lease_timeout
        self._books: dict[bytes, Books] = {}  # connection -> what it holds (only while it holds anything)
        self._writers: dict[int, bytes] = {}  # live reservation token -> the connection writing it
        self._page_owner: dict[int, bytes] = {}  # open tier token -> the connection it was given to
        self.expired_pages = 0  # tier reservations whose lease ran out before their commit
        self.waiting = 0  # gets waiting for their entry, on every connection

    # --- queries -------------------------------------------------------------------------------------

    def holds_any(self, conn: bytes) -> bool:
        """The connection holds something or waits for an answer (it is not idle)."""
        books = self._books.get(conn)
        if books is None:
            return False
        return bool(books.owed or books.loans or books.pages) or any(self._is_live(h) for h in books.held.values())

    def waits_any(self, conn: bytes) -> bool:
        books = self._books.get(conn)
        return books is not None and bool(books.waits)

    def admit_wait(self, conn: bytes) -> None:
        """Refuse one more wait past the bound (before the shell starts one)."""
        books = self._books.get(conn)
        if books is not None and len(books.waits) >= MAX_WAITS_PER_CONNECTION:
            raise BadRequest(f"too many gets in flight on this connection: at most {MAX_WAITS_PER_CONNECTION} may "
                             "wait at once (let some end first, or use another connection)")

    def in_use(self, conn: bytes) -> bool:
        """The connection holds tier pages (reservations or pins)."""
        books = self._books.get(conn)
        return books is not None and bool(books.pages)

    def loans(self, conn: bytes) -> Mapping[int, int]:
        """The connection's loans of scratch blocks: token -> blocks (read only: `Lent` changes them)."""
        books = self._books.get(conn)
        return books.loans if books is not None else {}

    def hold(self, conn: bytes, token: int) -> Hold | None:
        books = self._books.get(conn)
        return books.held.get(token) if books is not None else None

    def _is_live(self, hold: Hold) -> bool:
        """Still something to give back: a lease not released, a reservation whose blocks its
        writer may still write into."""
        if hold.entry is not None:
            return hold.entry.writer
        return self.store.lease_of(hold.token) is not None

    # --- the one way in -------------------------------------------------------------------------------

    def handle(self, event: ev.Event) -> list[ev.Action]:
        """Carry out an event in the books; returns what the shell must do. A token this connection
        does not hold raises NotFound (the request is answered with it; nothing changed)."""
        return ON[type(event)](self, event)

    # --- handoffs -------------------------------------------------------------------------------------

    def _reserved(self, event: ev.Reserved) -> list[ev.Action]:
        self._add(event.conn, Hold(event.entry.token, event.entry.request_id, event.entry, event.req, event.stream))
        return []

    def _wrote(self, event: ev.Wrote) -> list[ev.Action]:
        hold = self._write_hold(event.conn, event.token, event.request_id)
        if self._step(hold, WriteEvent.WRITE) is WriteAction.NOTHING:
            return []  # the writer was told why; its next write or commit lets go of the blocks
        assert hold.entry is not None
        return [ev.Copied(hold.entry)]

    def _write_expired(self, event: ev.WriteExpired) -> list[ev.Action]:
        hold = self._stream_hold(event.entry)
        lease = f"{self.lease_timeout:g} s"
        if hold is not None and hold.stream:
            error = Timeout(f"the stream's lease expired after {lease} without a write (--lease-timeout)")
        else:
            error = Timeout(f"the put of {event.entry.request_id!r} was not committed within {lease} of its "
                            "reservation (--lease-timeout)")
        return [*self._end_write(event.entry, error), ev.Ended(event.entry, error, readers=True)]

    def _push_refused(self, event: ev.PushRefused) -> list[ev.Action]:
        if event.conn is not None:
            hold = self._forget(event.conn, event.entry.token)
            if hold is not None:
                self._step(hold, WriteEvent.REMOVED_UNHEARD)  # (its put_alloc gets the error)
        self.store.remove(event.entry)
        self.store.release_writer(event.entry)  # (the client has not written yet, or has finished)
        return []

    def _push_ended(self, event: ev.PushEnded) -> list[ev.Action]:
        entry = event.entry
        if event.error is not None and entry.state is State.WRITING and not entry.removed:
            # a stream whose push failed before its commit can never be delivered: end it now,
            # so that its writer's next write fails instead of its commit
            return self._remove(entry, event.error)
        return []

    def _lent(self, event: ev.Lent) -> list[ev.Action]:
        self._books_of(event.conn).loans[event.token] = event.blocks
        return []

    def _loan_returned(self, event: ev.LoanReturned) -> list[ev.Action]:
        if event.token is not None and self._take_loan(event.conn, event.token):
            self.store.return_scratch(event.token)
        return []

    def _loan_used(self, event: ev.LoanUsed) -> list[ev.Action]:
        if not self._take_loan(event.conn, event.token):  # used up, whatever happens next
            raise NotFound(f"scratch blocks {event.token} are not lent to this connection")
        return []

    def _lease_given(self, event: ev.LeaseGiven) -> list[ev.Action]:
        self._add(event.conn, Hold(event.token, event.request_id))
        return []

    def _undelivered(self, event: ev.Undelivered) -> list[ev.Action]:
        return self._return_lease(event.token)

    def _answer_owed(self, event: ev.AnswerOwed) -> list[ev.Action]:
        books = self._books_of(event.conn)
        books.owed = max(0, books.owed + event.count)
        self._tidy(event.conn)
        return []

    def _wait_started(self, event: ev.WaitStarted) -> list[ev.Action]:
        self._books_of(event.conn).waits[event.wait] = None
        self.waiting += 1
        return []

    def _wait_ended(self, event: ev.WaitEnded) -> list[ev.Action]:
        books = self._books.get(event.conn)
        if books is not None and event.wait in books.waits:
            del books.waits[event.wait]
            self.waiting -= 1
            self._tidy(event.conn)
        return []

    def _commit(self, event: ev.Commit) -> list[ev.Action]:
        hold = self._write_hold(event.conn, event.token, event.request_id)
        assert hold.entry is not None
        self._forget(event.conn, event.token)
        # (an ended write committed after its every copy: the parked blocks can go)
        if self._step(hold, WriteEvent.COMMIT) is WriteAction.FAIL:
            self.store.release_writer(hold.entry)
            assert hold.write is not None and hold.write.ended is not None
            return [ev.Fail(hold.write.ended)]
        entry = self.store.writing_entry(event.request_id, event.token, State.WRITING)
        return [ev.Publish(entry)]

    def _abort(self, event: ev.Abort) -> list[ev.Action]:
        """A writer gives up its own reservation: True if it was live."""
        hold = self.hold(event.conn, event.token)
        if hold is None or hold.entry is None or hold.request_id != event.request_id:
            return [ev.Answer(False)]
        self._forget(event.conn, event.token)
        actions: list[ev.Action] = []
        dropped = self._step(hold, WriteEvent.ABORT) is WriteAction.DROP
        if dropped:
            actions += self._remove(hold.entry, NotFound(f"the put of {event.request_id!r} was aborted by its writer"))
        self.store.release_writer(hold.entry)
        return [*actions, ev.Answer(dropped)]

    def _removed(self, event: ev.Remove) -> list[ev.Action]:
        return self._remove(event.entry, event.error)

    def _remove(self, entry: Entry, error: KvdError) -> list[ev.Action]:
        """Remove an entry in any state, ending whatever is still at work on it."""
        self.store.remove(entry)
        actions: list[ev.Action] = []
        if entry.state is State.WRITING:
            actions += self._end_write(entry, error)  # its writer may still be copying: park, tell it
        readers = entry.state in (State.WRITING, State.RECEIVING)
        return [*actions, ev.Ended(entry, error, readers)]

    def _end_write(self, entry: Entry, error: KvdError) -> list[ev.Action]:
        """A reservation was removed while its writer may still be copying into it: park its
        blocks and tell the writer (on its put_alloc's req), so that its next write fails at once
        and it lets go of them. Nobody left who could write: the blocks go with the entry."""
        conn = self._writers.pop(entry.token, None)
        hold = self.hold(conn, entry.token) if conn is not None else None
        if conn is None or hold is None:
            self.store.release_writer(entry)
            return []
        if self._step(hold, WriteEvent.REMOVED, error) is WriteAction.TELL:
            return [ev.Tell(conn, hold.req, error)]
        return []

    def _release(self, event: ev.Release) -> list[ev.Action]:
        hold = self.hold(event.conn, event.token)
        if hold is None or hold.entry is not None:
            # a read lease is released only by the connection it was given to (a client that
            # reconnected to a restarted daemon must not end another's by number)
            raise NotFound(f"read lease {event.token} is not held by this connection")
        self._forget(event.conn, event.token)
        lease = self.store.lease_of(event.token)
        claiming = lease is not None and lease.claiming
        # (a lease that ran out was given back already: releasing it only unpins its blocks)
        entry = self.store.release(event.token, success=event.consume)
        return [ev.Released(entry, lease, claiming, event.consume)]

    def _return_lease(self, token: int) -> list[ev.Action]:
        """Give a client's read lease back now: the entry is readable again, waiters are woken."""
        lease = self.store.lease_of(token)
        if lease is None:
            return []
        self.store.release(token, success=False)
        return [ev.LeaseEnded(lease)]

    # --- tier pages -----------------------------------------------------------------------------------

    def _pages_reserved(self, event: ev.PagesReserved) -> list[ev.Action]:
        self._own_pages(event.conn, PageHold(event.token, LocalWrite(), event.deadline))
        return []

    def _pages_pinned(self, event: ev.PagesPinned) -> list[ev.Action]:
        self._own_pages(event.conn, PageHold(event.token))
        return []

    def _pages_release(self, event: ev.PagesRelease) -> list[ev.Action]:
        if self._page_owner.get(event.token) == event.conn:  # (fire and forget: a stale token is ignored)
            self._disown_pages(event.conn, event.token)
            self._tier().release(event.token)
        return []

    def _commit_pages(self, event: ev.PagesCommit) -> list[ev.Action]:
        if self._page_owner.get(event.token) != event.conn:  # it ran out (or was never this connection's)
            return [ev.Answer(None)]
        write = self._books[event.conn].pages[event.token].write
        if write is None:  # (nothing changes: the pin stays, released by its cache_release)
            raise NotFound(f"no cache reservation {event.token} open on this connection (it is a read's)")
        self._disown_pages(event.conn, event.token)
        pages = self._tier()
        action = write.step(WriteEvent.COMMIT if event.ok else WriteEvent.ABORT)
        if action is not WriteAction.PUBLISH:  # given up, or its lease ran out: the blocks go now
            dropped = pages.commit(event.token, ok=False)
            return [ev.Answer(None if action is WriteAction.FAIL else dropped)]
        written = pages.pending(event.token)
        return [ev.PagesPublished(written, pages.commit(event.token))]

    def _tick(self, event: ev.LeaseTick) -> list[ev.Action]:
        """End the tier reservations whose writer did not commit in time: their pages are unlisted
        at once, their blocks parked until the writer lets go (its commit answers None)."""
        late = [held for token, conn in self._page_owner.items()
                if (held := self._books[conn].pages[token]).deadline is not None and held.deadline <= event.now]
        for held in late:
            held.deadline = None
            error = Timeout(f"the cache put was not committed within {self.lease_timeout:g} s (--lease-timeout)")
            # (TELL: the writer is told by its commit's answer; it has no other request open to tell it on)
            assert held.write is not None  # (only a live reservation has a deadline)
            held.write.step(WriteEvent.REMOVED, error)
            self._tier().expire(held.token)
        self.expired_pages += len(late)
        return [ev.PagesExpired(len(late), self.expired_pages)] if late else []

    def _own_pages(self, conn: bytes, held: PageHold) -> None:
        self._page_owner[held.token] = conn
        self._books_of(conn).pages[held.token] = held

    def _disown_pages(self, conn: bytes, token: int) -> PageHold:
        del self._page_owner[token]
        held = self._books[conn].pages.pop(token)
        self._tidy(conn)
        return held

    def _tier(self) -> CacheStore:
        if self.pages is None:
            raise NotFound("this ledger keeps no tier pages")
        return self.pages

    # --- a connection ends ----------------------------------------------------------------------------

    def _lost(self, event: ev.ConnectionLost) -> list[ev.Action]:
        """Its unfinished puts are dropped and its reads given back now, as they would be at lease
        expiry; its tier reservations are dropped and its pins end; blocks parked for it are free."""
        books = self._books.pop(event.conn, None)
        if books is None:
            return []
        self.waiting -= len(books.waits)
        actions: list[ev.Action] = [ev.CallOff(tuple(books.waits))] if books.waits else []  # first: now
        for token in books.loans:
            self.store.return_scratch(token)
        for token, held in books.pages.items():
            del self._page_owner[token]
            if held.write is None:
                self._tier().release(token)
            else:
                held.write.step(WriteEvent.GONE)  # (DROP or FREE: either way, nobody copies into them now)
                self._tier().commit(token, ok=False)
        for hold in books.held.values():
            if hold.entry is not None:
                self._writers.pop(hold.token, None)
        writes = reads = 0
        for hold in [h for h in books.held.values() if self._is_live(h)]:
            if hold.entry is None:
                actions += self._return_lease(hold.token)
                reads += 1
                continue
            if self._step(hold, WriteEvent.GONE) is WriteAction.DROP:
                error = NotFound(f"the writer of {hold.request_id!r} disconnected before committing")
                actions += [*self._remove(hold.entry, error), ev.Abandoned(hold.entry)]
                writes += 1
            self.store.release_writer(hold.entry)
        return [*actions, ev.GaveBack(writes, reads)] if writes or reads else actions

    # --- the books ------------------------------------------------------------------------------------

    def _books_of(self, conn: bytes) -> Books:
        books = self._books.get(conn)
        if books is None:
            books = self._books[conn] = Books({}, {}, {}, {})
        return books

    def _tidy(self, conn: bytes) -> None:
        books = self._books.get(conn)
        if books is not None and books.empty():
            del self._books[conn]

    def _add(self, conn: bytes, hold: Hold) -> None:
        held = self._books_of(conn).held
        held[hold.token] = hold
        if hold.entry is not None:
            self._writers[hold.token] = conn
        if len(held) > PRUNE_AT:  # a long-lived client whose holds ended otherwise (expiry, delete)
            for stale in [t for t, h in held.items() if not self._is_live(h)]:
                del held[stale]

    def _forget(self, conn: bytes, token: int) -> Hold | None:
        books = self._books.get(conn)
        hold = books.held.pop(token, None) if books is not None else None
        if hold is not None:
            self._writers.pop(token, None)
            self._tidy(conn)
        return hold

    def _take_loan(self, conn: bytes, token: int | None) -> bool:
        books = self._books.get(conn)
        if books is None or token is None or books.loans.pop(token, None) is None:
            return False
        self._tidy(conn)
        return True

    def _write_hold(self, conn: bytes, token: int, request_id: str) -> Hold:
        """The reservation `token` of this connection (put_part, put_commit name it)."""
        hold = self.hold(conn, token)
        if hold is None or hold.entry is None or hold.request_id != request_id:
            raise NotFound(f"the put of {request_id!r} with token {token} is not held by this connection "
                           "(committed, aborted, or another connection's)")
        return hold

    def _stream_hold(self, entry: Entry) -> Hold | None:
        conn = self._writers.get(entry.token)
        return self.hold(conn, entry.token) if conn is not None else None

    @staticmethod
    def _step(hold: Hold, event: WriteEvent, error: KvdError | None = None) -> WriteAction:
        assert hold.write is not None, "a read lease has no write"
        return hold.write.step(event, error)

    # --- invariants -----------------------------------------------------------------------------------

    def validate(self) -> None:
        """What must hold between two events (tests call it after every step): see `audit.py`."""
        audit(Ledger(self._books, self._writers, self._page_owner, self.waiting, self.store, self.pages))


# each event's handler: `handle` looks the event's type up here (a test checks every event has one)
ON: dict[type, Callable[[LocalLedger, Any], list[ev.Action]]] = {
    ev.Reserved: LocalLedger._reserved, ev.Wrote: LocalLedger._wrote, ev.Commit: LocalLedger._commit,
    ev.Abort: LocalLedger._abort, ev.Remove: LocalLedger._removed, ev.WriteExpired: LocalLedger._write_expired,
    ev.PushRefused: LocalLedger._push_refused, ev.PushEnded: LocalLedger._push_ended, ev.Lent: LocalLedger._lent,
    ev.LoanReturned: LocalLedger._loan_returned, ev.LoanUsed: LocalLedger._loan_used,
    ev.LeaseGiven: LocalLedger._lease_given, ev.Release: LocalLedger._release,
    ev.Undelivered: LocalLedger._undelivered, ev.AnswerOwed: LocalLedger._answer_owed,
    ev.WaitStarted: LocalLedger._wait_started, ev.WaitEnded: LocalLedger._wait_ended,
    ev.PagesReserved: LocalLedger._pages_reserved, ev.PagesCommit: LocalLedger._commit_pages,
    ev.PagesPinned: LocalLedger._pages_pinned, ev.PagesRelease: LocalLedger._pages_release,
    ev.ConnectionLost: LocalLedger._lost, ev.LeaseTick: LocalLedger._tick,
}
