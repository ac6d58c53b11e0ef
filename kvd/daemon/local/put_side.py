"""Local puts (daemon process): reservations, their writes and commits, one-round-trip puts into
lent scratch blocks, and a put with a destination as one push fed as the client writes.

What happens to a write when its writer writes, commits, aborts or hangs up, or when its entry
is removed under it, is decided by the local ledger (`ledger.py`, with each write's machine in
`reservation.py`); this module tells it what happened and carries its actions out on the entry
watch and the transfers (`carry`). `LocalHandlers` dispatches the messages here and owns the replies.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeGuard

from kvd.errors import InternalError, KvdError
from kvd.wire import protocol as p
from kvd.wire.layout import TensorSpec, blocks_needed

from ..metrics import Metrics
from ..peer.transfers import Push, Transfers
from ..store.entries import Entry, State, Store
from . import events as ev
from .ledger import LocalLedger
from .watch import EntryWatch

# loans of scratch blocks one connection may hold: one per small put it has in flight, up to this
LOANS_PER_CONNECTION = 16

Reply = Callable[[bytes, p.Message], bool]  # send to a client; False if it has gone
ErrorReply = Callable[[p.Message, Exception], p.Error]  # an exception as the error reply to msg, counted


@dataclass(frozen=True)
class PutSettings:
    node_id: str
    block_size: int
    lease_timeout: float  # a put's copy must be committed within this of its reservation (--lease-timeout)
    scratch_max: int  # puts up to this size get blocks lent ahead (--scratch-max); 0 = off


class LocalPuts:
    def __init__(self, settings: PutSettings, store: Store, watch: EntryWatch, transfers: Transfers,
                 metrics: Metrics, ledger: LocalLedger, is_connected: Callable[[bytes], bool], reply: Reply,
                 error: ErrorReply) -> None:
        self.settings = settings
        self.store, self.watch, self.transfers, self.metrics, self.ledger = store, watch, transfers, metrics, ledger
        self._is_connected, self._reply, self._error = is_connected, reply, error
        self._pushes: dict[int, Push] = {}  # entry token -> its push (to a peer), until committed

    # --- the writer's messages ----------------------------------------------------------------------

    def alloc(self, rid: bytes, msg: p.PutAlloc) -> p.PutSlots:
        self.ledger.handle(ev.LoanReturned(rid, msg.give_back))
        specs = [TensorSpec.from_wire(t) for t in msg.tensors]
        entry = self.store.reserve(msg.request_id, specs, msg.ttl, msg.meta, State.WRITING,
                                   time.monotonic() + self.settings.lease_timeout)
        self.ledger.handle(ev.Reserved(rid, entry, msg.req, msg.stream))
        if msg.stream and self._is_remote(msg.dest):
            self._start_push(entry, msg.dest, sealed=False, rid=rid)
        if msg.stream:
            self.watch.wake(entry.request_id)  # get_stream readers may start now
        return p.PutSlots(req=msg.req, token=entry.token, segments=entry.segments(self.settings.block_size))

    def part(self, rid: bytes, msg: p.PutPart) -> None:
        for action in self.ledger.handle(ev.Wrote(rid, msg.token, msg.request_id)):
            assert isinstance(action, ev.Copied)  # (none: the writer was told why the put ended)
            self._copied(action.entry, msg.tensors)

    def _copied(self, entry: Entry, tensors: list[int]) -> None:
        entry.write_deadline = time.monotonic() + self.settings.lease_timeout  # a stream that writes is alive
        self._written(entry, entry.mark_tensors(tensors), tensors)

    def commit(self, rid: bytes, msg: p.PutCommit) -> p.PutOk | None:
        (action,) = self.ledger.handle(ev.Commit(rid, msg.token, msg.request_id))
        if isinstance(action, ev.Fail):  # the put ended under its writer (who let go of the blocks now)
            raise action.error
        assert isinstance(action, ev.Publish)
        entry = action.entry
        push = self._pushes.get(entry.token)
        written = entry.mark_rest()
        if push is None and self._is_remote(msg.dest):
            push = self._start_push(entry, msg.dest, sealed=True)  # every byte is in: it goes whole
        self._written(entry, *written)  # (to a streamed push, and stream readers)
        self.transfers.entry_committed(entry)
        return self._publish(rid, msg, entry, push)

    def in_scratch(self, rid: bytes, msg: p.Put) -> p.PutOk | None:
        """A one-round-trip put: the client filled blocks lent to it, and says what they hold."""
        self.ledger.handle(ev.LoanUsed(rid, msg.scratch))  # (NotFound: not lent to it)
        try:
            specs = [TensorSpec.from_wire(t) for t in msg.tensors]
        except BaseException:
            self.store.return_scratch(msg.scratch)
            raise
        entry = self.store.reserve_in_scratch(msg.scratch, msg.request_id, specs, msg.ttl, msg.meta,
                                              State.WRITING, time.monotonic() + self.settings.lease_timeout)
        written = entry.mark_rest()
        push = self._start_push(entry, msg.dest, sealed=True) if self._is_remote(msg.dest) else None
        self._written(entry, *written)
        return self._publish(rid, msg, entry, push)

    def abort(self, rid: bytes, msg: p.Delete, token: int) -> p.Ok:
        """A writer gives up its own reservation (a delete with its token, msg.token): True if it was live."""
        answer = self.carry(self.ledger.handle(ev.Abort(rid, token, msg.request_id)))
        return p.Ok(req=msg.req, value=answer)

    def carry(self, actions: list[ev.Action]) -> object:
        """Carry out what the ledger decided about handoffs; returns the value of an Answer."""
        answer = None
        for action in actions:
            match action:
                case ev.Tell():  # on its put_alloc's req: its next write fails at once, and it lets go
                    self._reply(action.conn, p.error_reply(action.req, action.error, self.settings.node_id))
                case ev.Ended():
                    if action.readers:
                        self.watch.on_dropped(action.entry, action.error)  # stream readers
                    # a push being written or committed, a pull served, an arrival
                    self.transfers.abort_entry(action.entry, action.error)
                case ev.Abandoned():
                    self.metrics.abandoned.inc()
                case ev.LeaseEnded():
                    self.watch.drop_reader(action.lease.token)
                    self.watch.lease_expired(action.lease)
                case ev.Answer():
                    answer = action.value
                case _:
                    raise InternalError(f"the put side cannot carry out {action}")
        return answer

    # --- pushes -------------------------------------------------------------------------------------

    def _start_push(self, entry: Entry, dest: str, sealed: bool, rid: bytes | None = None) -> Push:
        """Push entry to dest as its bytes are written (the offer goes as soon as the link is up).
        A push that cannot start (an unknown peer) drops the put: its client gets the error."""
        lease = self.store.lease(entry, consume=True, deadline=None, incomplete=True)
        try:
            push = self.transfers.push(entry, lease.token, dest, sealed=sealed)
        except BaseException:
            self.ledger.handle(ev.PushRefused(entry, rid))  # (its request gets the error)
            raise
        self._pushes[entry.token] = push

        def ended(outcome: asyncio.Future[None]) -> None:
            self._pushes.pop(entry.token, None)
            error = None if outcome.cancelled() else outcome.exception()
            if error is not None:  # (a stream's push that failed before its commit ends the put)
                why = error if isinstance(error, KvdError) else InternalError(str(error))
                self.carry(self.ledger.handle(ev.PushEnded(entry, why)))

        self.transfers.outcome(push).add_done_callback(ended)
        return push

    def _written(self, entry: Entry, ranges: list[tuple[int, int]], indices: list[int]) -> None:
        """A local producer wrote these tensors: tell stream readers, ship them to the peer."""
        self.watch.on_progress(entry, indices)
        self.transfers.entry_written(entry, ranges)

    def _publish(self, rid: bytes, msg: p.PutCommit | p.Put, entry: Entry, push: Push | None) -> p.PutOk | None:
        """Every byte of a local put is written: publish it, or answer once the push is over."""
        self.store.publish(entry)
        self.metrics.tally["puts"] += 1
        self.metrics.local_bytes.labels("in").inc(entry.total_bytes)
        # every byte is in: stream readers here finish, even when the push owns the entry from now on
        self.watch.on_published(entry)
        if push is None:
            self.metrics.duration.labels("local_put").observe(time.time() - entry.created)
            return self._put_ok(rid, msg, entry.total_bytes)
        # answered as the push ends, not from a task nor a future's callback (each costs a turn of
        # the loop, more than the rest of a small push's handling here)
        self.ledger.handle(ev.AnswerOwed(rid))
        self.transfers.when_ended(push, lambda error: self._push_ended(rid, msg, entry, error))
        return None

    def _push_ended(self, rid: bytes, msg: p.PutCommit | p.Put, entry: Entry, error: KvdError | None) -> None:
        self.ledger.handle(ev.AnswerOwed(rid, -1))
        if error is None:
            self._reply(rid, self._put_ok(rid, msg, entry.total_bytes))
            return
        # the caller still has its tensors and gets the error; the local copy goes
        # (its blocks return once the transfer lets go of its lease)
        self.store.remove(entry)
        self._reply(rid, self._error(msg, error))

    def _put_ok(self, rid: bytes, msg: p.PutCommit | p.Put, total_bytes: int) -> p.PutOk:
        """The reply to a finished put; lends the connection blocks for its next put when it
        was small, so that one takes a single round trip (the client fills them, then asks).

        Lent blocks are taken back only when the connection ends or the client uses or returns
        them (never from under a client that may be writing into them), so lending is bounded
        instead: each loan sized to this put rounded up to a power of two blocks, only while the
        pool is less than half full, at most 1/16 of it in all and 1/64 of it to one connection,
        in at most LOANS_PER_CONNECTION loans (a client with that many puts in flight takes one
        round trip for each)."""
        reply = p.PutOk(req=msg.req)
        if isinstance(msg, p.PutCommit) and not msg.lend:
            return reply
        loans = self.ledger.loans(rid)
        if len(loans) >= LOANS_PER_CONNECTION or not 0 < total_bytes <= self.settings.scratch_max:
            return reply
        if not self._is_connected(rid):
            return reply
        block_size = self.settings.block_size
        blocks = min(1 << (blocks_needed(total_bytes, block_size) - 1).bit_length(),
                     max(1, self.settings.scratch_max // block_size))
        pool = self.store.allocator
        if (self.store.scratch_blocks + blocks > pool.num_blocks // 16
                or (loans and sum(loans.values()) + blocks > pool.num_blocks // 64)
                or pool.free_blocks - blocks < pool.num_blocks // 2):
            return reply
        reply.scratch, extents = self.store.lend_scratch(blocks)
        reply.extents = [list(extent) for extent in extents]
        self.ledger.handle(ev.Lent(rid, reply.scratch, blocks))
        return reply

    # --- entries that end without their writer -------------------------------------------------------

    def remove(self, entry: Entry, error: KvdError) -> None:
        """Remove an entry in any state, ending whatever is still at work on it (its writer is
        told, its blocks parked for it)."""
        self.carry(self.ledger.handle(ev.Remove(entry, error)))

    def write_expired(self, entry: Entry) -> None:
        """A reservation's lease ran out (the housekeeping sweep removed it)."""
        self.carry(self.ledger.handle(ev.WriteExpired(entry)))

    def _is_remote(self, peer: str | None) -> TypeGuard[str]:
        """Whether peer names another node (so it is not None)."""
        return peer is not None and peer != self.settings.node_id
