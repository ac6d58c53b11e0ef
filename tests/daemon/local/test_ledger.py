"""kvd.daemon.local.ledger: the local side's core without sockets (the test process).

The ledger runs against the real pure Store and page store on one shared pool, as in the daemon.
Scenarios first (each step's actions asserted); then a Hypothesis state machine with interleaved
clients that reserve, write, commit, abort, read, borrow scratch, put and get tier pages, hang up,
and let leases run out, calling `validate()` (and the stores' own checks) after every step.
"""
from __future__ import annotations

import itertools
import typing

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from kvd.daemon.local import events as ev
from kvd.daemon.local.books import MAX_WAITS_PER_CONNECTION
from kvd.daemon.local.ledger import ON, LocalLedger
from kvd.daemon.local.reservation import WriteState
from kvd.daemon.store.entries import Entry, State, Store
from kvd.daemon.store.page_store import CacheStore, SharedPool
from kvd.errors import BadRequest, KvdError, NotFound, PoolFull
from kvd.wire.layout import TensorSpec

BLOCK = 4096
BLOCKS = 64
LEASE = 30.0  # seconds: the lease timeout the ledger is given
NS = "ns"


def make() -> tuple[LocalLedger, Store, CacheStore]:
    pool = SharedPool(BLOCKS)
    pages = CacheStore(pool, BLOCK, 24 * BLOCK)
    store = Store(pool, BLOCK, None)
    return LocalLedger(store, pages, LEASE), store, pages


def reserve(ledger: LocalLedger, store: Store, conn: bytes, request_id: str, nbytes: int = 3 * BLOCK,
            stream: bool = False, req: int = 7) -> Entry:
    entry = store.reserve(request_id, [TensorSpec("x", "uint8", (nbytes,))], None, None, State.WRITING, LEASE)
    assert ledger.handle(ev.Reserved(conn, entry, req, stream)) == []
    return entry


def used(store: Store) -> int:
    return store.allocator.used_blocks


def page_put(ledger: LocalLedger, pages: CacheStore, conn: bytes, key: str, deadline: float = LEASE) -> int:
    token, results = pages.reserve(NS, [key], [["uint8", [2 * BLOCK]]])
    assert pages.writing(token), results
    ledger.handle(ev.PagesReserved(conn, token, deadline))
    return token


# --- scenarios ------------------------------------------------------------------------------------------


def test_every_event_has_a_handler():
    assert set(ON) == set(typing.get_args(ev.Event))


def test_a_put_is_written_committed_and_published():
    ledger, store, _ = make()
    entry = reserve(ledger, store, b"c1", "r1")
    assert ledger.handle(ev.Wrote(b"c1", entry.token, "r1")) == [ev.Copied(entry)]
    ledger.validate()
    assert ledger.holds_any(b"c1")
    assert ledger.handle(ev.Commit(b"c1", entry.token, "r1")) == [ev.Publish(entry)]
    store.publish(entry)
    ledger.validate()
    assert not ledger.holds_any(b"c1") and entry.writer is False


def test_a_token_is_only_its_connections():
    ledger, store, pages = make()
    entry = reserve(ledger, store, b"c1", "r1")
    for event in (ev.Wrote(b"c2", entry.token, "r1"), ev.Commit(b"c2", entry.token, "r1"),
                  ev.Commit(b"c1", entry.token, "other-id"), ev.Release(b"c2", entry.token, True)):
        with pytest.raises(NotFound):
            ledger.handle(event)
    assert ledger.handle(ev.Abort(b"c2", entry.token, "r1")) == [ev.Answer(False)]
    token = page_put(ledger, pages, b"c1", "k")
    assert ledger.handle(ev.PagesCommit(b"c2", token, True)) == [ev.Answer(None)]
    ledger.handle(ev.PagesRelease(b"c2", token))  # (ignored)
    assert ledger.hold(b"c1", entry.token).write.state is WriteState.WRITING and pages.writing(token)
    ledger.validate()


def test_a_put_removed_under_its_writer_keeps_its_blocks_until_the_writer_lets_go():
    ledger, store, _ = make()
    entry = reserve(ledger, store, b"c1", "r1", req=41)
    why = NotFound("deleted")
    assert ledger.handle(ev.Remove(entry, why)) == [ev.Tell(b"c1", 41, why), ev.Ended(entry, why, True)]
    ledger.validate()
    assert entry.removed and entry.writer and used(store) == 3  # parked for the writer
    assert ledger.handle(ev.Wrote(b"c1", entry.token, "r1")) == []  # told already: its write is ignored
    assert ledger.handle(ev.Commit(b"c1", entry.token, "r1")) == [ev.Fail(why)]
    ledger.validate()
    assert used(store) == 0 and not ledger.holds_any(b"c1")


def test_a_writer_that_hangs_up_drops_its_put_and_its_reads_go_back():
    ledger, store, _ = make()
    entry = reserve(ledger, store, b"c1", "r1")
    done = reserve(ledger, store, b"c2", "r2")
    ledger.handle(ev.Commit(b"c2", done.token, "r2"))
    store.publish(done)
    lease = store.lease(done, consume=True, deadline=LEASE)
    ledger.handle(ev.LeaseGiven(b"c1", lease.token, "r2"))
    actions = ledger.handle(ev.ConnectionLost(b"c1"))
    ended = next(a for a in actions if isinstance(a, ev.Ended))
    assert ended.entry is entry and ended.readers and ev.Abandoned(entry) in actions
    assert ev.LeaseEnded(lease) in actions and actions[-1] == ev.GaveBack(1, 1)
    assert done.state is State.READY and "r1" not in store.entries and used(store) == 3
    ledger.validate()
    assert ledger.handle(ev.ConnectionLost(b"c1")) == []


def test_a_write_whose_lease_ran_out_is_told_and_parked():
    ledger, store, _ = make()
    entry = reserve(ledger, store, b"c1", "r1", stream=True, req=3)
    _, abandoned, _ = store.sweep(LEASE + 1)
    assert abandoned == [entry]
    (tell, ended) = ledger.handle(ev.WriteExpired(entry))
    assert isinstance(tell, ev.Tell) and tell.req == 3 and "stream's lease expired" in tell.error.message
    assert ended == ev.Ended(entry, tell.error, True)
    ledger.validate()
    assert used(store) == 3
    ledger.handle(ev.Abort(b"c1", entry.token, "r1"))  # the writer gives up: the blocks go
    assert used(store) == 0
    ledger.validate()


def test_a_failed_push_ends_a_stream_still_written_and_a_refused_one_ends_unheard():
    ledger, store, _ = make()
    entry = reserve(ledger, store, b"c1", "r1", stream=True, req=5)
    why = KvdError("the peer went away")
    assert ledger.handle(ev.PushEnded(entry, why)) == [ev.Tell(b"c1", 5, why), ev.Ended(entry, why, True)]
    assert ledger.handle(ev.PushEnded(entry, why)) == []  # (removed already)
    refused = reserve(ledger, store, b"c1", "r2", stream=True)
    assert ledger.handle(ev.PushRefused(refused, b"c1")) == []
    assert ledger.hold(b"c1", refused.token) is None and "r2" not in store.entries
    ledger.validate()


def test_a_tier_reservation_whose_lease_ran_out_parks_its_blocks_for_the_late_writer():
    """The tier integrity defect: a writer paused past its lease still copies into its blocks when it
    runs again, so they must not be anyone else's by then."""
    ledger, _, pages = make()
    late = page_put(ledger, pages, b"c1", "k", deadline=1.0)
    (slot,) = [page.extents for page in pages.pending(late)]
    assert ledger.handle(ev.LeaseTick(2.0)) == [ev.PagesExpired(1, 1)]
    ledger.validate()
    assert pages.stats()["entries"] == 0 and pages.parked_blocks == 2
    again = page_put(ledger, pages, b"c2", "k")  # the key is free again, in other blocks
    assert [page.extents for page in pages.pending(again)] != [slot]
    assert ledger.handle(ev.PagesCommit(b"c2", again, True))[0].published == [True]
    ledger.validate()
    assert ledger.handle(ev.PagesCommit(b"c1", late, True)) == [ev.Answer(None)]  # told: not stored
    assert pages.parked_blocks == 0 and pages.blocks == 2
    ledger.validate()


def test_tier_pins_end_with_their_reader():
    ledger, _, pages = make()
    token = page_put(ledger, pages, b"c1", "k")
    ledger.handle(ev.PagesCommit(b"c1", token, True))
    pin, found = pages.lease(NS, ["k"], [2 * BLOCK])
    assert found[0] is not None
    ledger.handle(ev.PagesPinned(b"c2", pin))
    assert ledger.in_use(b"c2") and not ledger.in_use(b"c1")
    with pytest.raises(NotFound):  # a pin is not a reservation: nothing changes
        ledger.handle(ev.PagesCommit(b"c2", pin, True))
    assert pages.clear(NS) == 1 and pages.parked_blocks == 2  # cleared under its reader: parked
    ledger.validate()
    ledger.handle(ev.ConnectionLost(b"c2"))
    assert pages.parked_blocks == 0 and not ledger.in_use(b"c2")
    ledger.validate()


def test_waits_are_bounded_per_connection_and_called_off_when_it_goes():
    ledger, _, _ = make()
    waits = [object() for _ in range(MAX_WAITS_PER_CONNECTION)]
    for wait in waits:
        ledger.admit_wait(b"c1")
        ledger.handle(ev.WaitStarted(b"c1", wait))
    with pytest.raises(BadRequest):
        ledger.admit_wait(b"c1")
    ledger.admit_wait(b"c2")  # (another connection's are its own)
    assert ledger.waits_any(b"c1") and not ledger.holds_any(b"c1") and ledger.waiting == len(waits)
    ledger.handle(ev.WaitEnded(b"c1", waits[0]))
    ledger.handle(ev.WaitEnded(b"c1", waits[0]))  # (twice: the second is ignored)
    ledger.validate()
    assert ledger.handle(ev.ConnectionLost(b"c1")) == [ev.CallOff(tuple(waits[1:]))]
    assert ledger.waiting == 0 and not ledger.waits_any(b"c1")
    ledger.handle(ev.WaitEnded(b"c1", waits[1]))  # (a task cancelled by the call-off ends later: ignored)
    ledger.validate()


# --- the state machine ------------------------------------------------------------------------------------

SIZES = st.sampled_from([0, 1, BLOCK, 3 * BLOCK + 5, 8 * BLOCK])
KEYS = st.sampled_from(["a", "b", "c", "d"])


class Ledger(RuleBasedStateMachine):
    """Clients as the shell would serve them: each rule is a client message (or a hang-up, or time
    passing) turned into the event the shell feeds the ledger, and its actions carried out on the
    stores as the shell would (publish, release)."""

    conns = Bundle("conns")

    def __init__(self) -> None:
        super().__init__()
        self.ledger, self.store, self.pages = make()
        self.clock = 0.0
        self.ids = itertools.count()
        self.live: set[bytes] = set()
        self.writes: dict[int, tuple[bytes, Entry]] = {}  # reservations clients think they hold
        self.reads: dict[int, bytes] = {}  # read leases
        self.loans: dict[int, bytes] = {}
        self.page_writes: dict[int, bytes] = {}
        self.pins: dict[int, bytes] = {}
        self.waits: dict[object, bytes] = {}  # gets waiting for their entry (the shell's handles)

    def _carry(self, actions: list[ev.Action]) -> None:
        for action in actions:
            if isinstance(action, ev.Publish):
                self.store.publish(action.entry)

    @rule(target=conns)
    def connect(self) -> bytes:
        conn = f"c{next(self.ids)}".encode()
        self.live.add(conn)
        return conn

    @rule(conn=conns, size=SIZES, stream=st.booleans())
    def put_alloc(self, conn: bytes, size: int, stream: bool) -> None:
        if conn not in self.live:
            return
        try:
            entry = self.store.reserve(f"r{next(self.ids)}", [TensorSpec("x", "uint8", (size,))], None, None,
                                       State.WRITING, self.clock + LEASE)
        except PoolFull:
            return
        self.ledger.handle(ev.Reserved(conn, entry, 1, stream))
        self.writes[entry.token] = (conn, entry)

    @precondition(lambda self: self.writes)
    @rule(data=st.data())
    def put_part(self, data: st.DataObject) -> None:
        token = data.draw(st.sampled_from(sorted(self.writes)))
        conn, entry = self.writes[token]
        self.ledger.handle(ev.Wrote(conn, token, entry.request_id))

    @precondition(lambda self: self.writes)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        token = data.draw(st.sampled_from(sorted(self.writes)))
        conn, entry = self.writes.pop(token)
        self._carry(self.ledger.handle(ev.Commit(conn, token, entry.request_id)))

    @precondition(lambda self: self.writes)
    @rule(data=st.data(), commit=st.booleans())
    def intruder(self, data: st.DataObject, commit: bool) -> None:
        """Another connection names a token: refused, nothing changes."""
        token = data.draw(st.sampled_from(sorted(self.writes)))
        request_id = self.writes[token][1].request_id
        with pytest.raises(NotFound):
            self.ledger.handle((ev.Commit if commit else ev.Wrote)(b"intruder", token, request_id))

    @precondition(lambda self: self.writes)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        if self.writes:
            token = data.draw(st.sampled_from(sorted(self.writes)))
            conn, entry = self.writes.pop(token)
            self.ledger.handle(ev.Abort(conn, token, entry.request_id))

    @precondition(lambda self: self.store.entries)
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        if self.store.entries:
            request_id = data.draw(st.sampled_from(sorted(self.store.entries)))
            self.ledger.handle(ev.Remove(self.store.entries[request_id], NotFound("deleted")))

    @rule(conn=conns, data=st.data(), consume=st.booleans())
    def get(self, conn: bytes, data: st.DataObject, consume: bool) -> None:
        ready = sorted(r for r, e in self.store.entries.items() if e.state is State.READY)
        if conn not in self.live or not ready:
            return
        entry = self.store.entries[data.draw(st.sampled_from(ready))]
        lease = self.store.lease(entry, consume=consume, deadline=self.clock + LEASE)
        self.ledger.handle(ev.LeaseGiven(conn, lease.token, entry.request_id))
        self.reads[lease.token] = conn

    @precondition(lambda self: self.reads)
    @rule(data=st.data(), consume=st.booleans())
    def get_done(self, data: st.DataObject, consume: bool) -> None:
        if self.reads:
            token = data.draw(st.sampled_from(sorted(self.reads)))
            (released,) = self.ledger.handle(ev.Release(self.reads.pop(token), token, consume))
            assert isinstance(released, ev.Released)

    @rule(conn=conns, blocks=st.integers(1, 4))
    def lend(self, conn: bytes, blocks: int) -> None:
        if conn in self.live:
            try:
                token, _ = self.store.lend_scratch(blocks)
            except PoolFull:
                return
            self.ledger.handle(ev.Lent(conn, token, blocks))
            self.loans[token] = conn

    @precondition(lambda self: self.loans)
    @rule(data=st.data(), use=st.booleans())
    def use_or_return_loan(self, data: st.DataObject, use: bool) -> None:
        if not self.loans:
            return
        token = data.draw(st.sampled_from(sorted(self.loans)))
        conn = self.loans.pop(token)
        if not use:
            self.ledger.handle(ev.LoanReturned(conn, token))
            return
        self.ledger.handle(ev.LoanUsed(conn, token))  # a one-round-trip put: the loan becomes its entry
        entry = self.store.reserve_in_scratch(token, f"r{next(self.ids)}", [TensorSpec("x", "uint8", (1,))],
                                              None, None, State.WRITING, None)
        self.store.publish(entry)

    @rule(conn=conns, key=KEYS)
    def cache_put(self, conn: bytes, key: str) -> None:
        if conn in self.live:
            token, _ = self.pages.reserve(NS, [key], [["uint8", [2 * BLOCK]]])
            if self.pages.writing(token):
                self.ledger.handle(ev.PagesReserved(conn, token, self.clock + LEASE))
                self.page_writes[token] = conn

    @precondition(lambda self: self.page_writes)
    @rule(data=st.data(), ok=st.sampled_from([True, True, True, False]))  # (mostly: pages to read)
    def cache_commit(self, data: st.DataObject, ok: bool) -> None:
        if self.page_writes:
            token = data.draw(st.sampled_from(sorted(self.page_writes)))
            self.ledger.handle(ev.PagesCommit(self.page_writes.pop(token), token, ok))

    @rule(conn=conns, keys=st.lists(KEYS, min_size=1, max_size=3, unique=True))
    def cache_get(self, conn: bytes, keys: list[str]) -> None:
        if conn in self.live:
            token, found = self.pages.lease(NS, keys, [2 * BLOCK] * len(keys))
            if any(page is not None for page in found):
                self.ledger.handle(ev.PagesPinned(conn, token))
                self.pins[token] = conn

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def cache_release(self, data: st.DataObject) -> None:
        if self.pins:
            token = data.draw(st.sampled_from(sorted(self.pins)))
            self.ledger.handle(ev.PagesRelease(self.pins.pop(token), token))

    @rule(conn=conns)
    def wait(self, conn: bytes) -> None:
        if conn in self.live:
            self.ledger.admit_wait(conn)
            handle = object()
            self.ledger.handle(ev.WaitStarted(conn, handle))
            self.waits[handle] = conn

    @precondition(lambda self: self.waits)
    @rule(data=st.data())
    def wait_ends(self, data: st.DataObject) -> None:
        handle = data.draw(st.sampled_from(list(self.waits)))
        self.ledger.handle(ev.WaitEnded(self.waits.pop(handle), handle))

    @rule()
    def cache_clear(self) -> None:
        self.pages.clear(NS)

    @rule(conn=consumes(conns))
    def hang_up(self, conn: bytes) -> None:
        self.live.discard(conn)
        actions = self.ledger.handle(ev.ConnectionLost(conn))
        mine = [w for w, owner in self.waits.items() if owner == conn]
        assert (actions[0] == ev.CallOff(tuple(mine))) if mine else not any(isinstance(a, ev.CallOff) for a in actions)
        for table in (self.reads, self.loans, self.page_writes, self.pins, self.waits):
            for token in [t for t, owner in table.items() if owner == conn]:
                del table[token]
        for token in [t for t, (owner, _) in self.writes.items() if owner == conn]:
            del self.writes[token]

    @rule(seconds=st.sampled_from([1.0, LEASE / 2, LEASE + 1]))
    def time_passes(self, seconds: float) -> None:
        """The housekeeping sweep: leases and writes that ran out end (their blocks stay parked
        for whoever may still touch them)."""
        self.clock += seconds
        _, abandoned, _ = self.store.sweep(self.clock)
        for entry in abandoned:
            self.ledger.handle(ev.WriteExpired(entry))
        self.ledger.handle(ev.LeaseTick(self.clock))

    @invariant()
    def valid(self) -> None:
        self.ledger.validate()
        self.pages.check_invariants()
        self.store.allocator.check_invariants()
        # nothing leaks: every writer pin is a reservation some live connection holds
        writing = {t for books in self.ledger._books.values() for t, h in books.held.items() if h.entry is not None}
        for entry in [*self.store.entries.values(), *self.store._zombies]:
            assert not entry.writer or entry.token in writing, f"{entry.request_id} pinned for nobody"
        for conn in self.ledger._books:
            assert conn in self.live, f"the books of a lost connection {conn!r} are kept"

    def teardown(self) -> None:
        """Everyone hangs up, every lease runs out: the pool is whole again, but for pages the tier keeps."""
        for conn in list(self.live):
            self.hang_up(conn)
        self.time_passes(LEASE + 1)
        for token in list(self.store._leases):  # (read leases the shell's watch would give back)
            self.store.release(token, success=False)
        self.ledger.validate()
        assert not self.ledger._books and self.store.scratch_blocks == 0
        assert self.store.allocator.used_blocks == self.pages.blocks + sum(
            n for e in self.store.entries.values() for _, n in e.extents)


TestLedger = Ledger.TestCase
TestLedger.settings = settings(max_examples=300, stateful_step_count=60, deadline=None,
                               suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
