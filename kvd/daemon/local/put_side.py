"""Local puts (daemon process): reservations, their writes and commits, one-round-trip puts into
lent scratch blocks, and a put with a destination as one push fed as the client writes.

What happens to a write when its writer writes, commits, aborts or hangs up, or when its entry
is removed under it, is decided by `writes.LocalWrite` (the table there); this module carries
the actions out on the store, the entry watch and the transfers. `LocalHandlers` dispatches the
messages here and owns the replies.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvd.errors import InternalError, KvdError, NotFound, Timeout
from kvd.wire import protocol as p
from kvd.wire.layout import TensorSpec, blocks_needed

from ..metrics import Metrics
from ..peer.transfers import Push, Transfers
from ..store.entries import Entry, State, Store
from .ledger import Hold, Holds
from .reservation import WriteAction, WriteEvent
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
                 metrics: Metrics, holds: Holds, is_connected: Callable[[bytes], bool], reply: Reply,
                 error: ErrorReply) -> None:
        self.settings = settings
        self.store, self.watch, self.transfers, self.metrics, self.holds = store, watch, transfers, metrics, holds
        self._is_connected, self._reply, self._error = is_connected, reply, error
        self._pushes: dict[int, Push] = {}  # entry token -> its push (to a peer), until committed

    # --- the writer's messages ----------------------------------------------------------------------

    def alloc(self, rid: bytes, msg: p.PutAlloc) -> p.PutSlots:
        if self.holds.take_loan(rid, msg.give_back):
            self.store.return_scratch(msg.give_back)
        specs = [TensorSpec.from_wire(t) for t in msg.tensors]
        entry = self.store.reserve(msg.request_id, specs, msg.ttl, msg.meta, State.WRITING,
                                   time.monotonic() + self.settings.lease_timeout)
        self.holds.hold(rid, Hold(entry.token, entry.request_id, entry, req=msg.req, stream=msg.stream))
        if msg.stream and self._is_remote(msg.dest):
            self._start_push(entry, msg.dest, sealed=False, rid=rid)
        if msg.stream:
            self.watch.wake(entry.request_id)  # get_stream readers may start now
        return p.PutSlots(req=msg.req, token=entry.token, segments=entry.segments(self.settings.block_size))

    def part(self, rid: bytes, msg: p.PutPart) -> None:
        hold = self.holds.write_hold(rid, msg.token, msg.request_id)
        if hold.write.step(WriteEvent.WRITE) is WriteAction.NOTHING:
            return  # the writer was told why; its next write or commit lets go of the blocks
        entry = hold.entry
        entry.write_deadline = time.monotonic() + self.settings.lease_timeout  # a stream that writes is alive
        self._written(entry, entry.mark_tensors(msg.tensors), msg.tensors)

    def commit(self, rid: bytes, msg: p.PutCommit) -> p.PutOk | None:
        hold = self.holds.write_hold(rid, msg.token, msg.request_id)
        self.holds.release(rid, msg.token)
        # (an ended write committed after its every copy: the parked blocks can go)
        if hold.write.step(WriteEvent.COMMIT) is WriteAction.FAIL:
            self.store.release_writer(hold.entry)
            raise hold.write.ended
        entry = self.store.writing_entry(msg.request_id, msg.token, State.WRITING)
        push = self._pushes.get(entry.token)
        written = entry.mark_rest()
        if push is None and self._is_remote(msg.dest):
            push = self._start_push(entry, msg.dest, sealed=True)  # every byte is in: it goes whole
        self._written(entry, *written)  # (to a streamed push, and stream readers)
        self.transfers.entry_committed(entry)
        return self._publish(rid, msg, entry, push)

    def in_scratch(self, rid: bytes, msg: p.Put) -> p.PutOk | None:
        """A one-round-trip put: the client filled blocks lent to it, and says what they hold."""
        if not self.holds.take_loan(rid, msg.scratch):  # used up, whatever happens next
            raise NotFound(f"scratch blocks {msg.scratch} are not lent to this connection")
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

    def abort(self, rid: bytes, msg: p.Delete) -> p.Ok:
        """A writer gives up its own reservation (a delete with its token): True if it was live."""
        hold = self.holds.get(rid, msg.token)
        if hold is None or not hold.writing or hold.request_id != msg.request_id:
            return p.Ok(req=msg.req, value=False)
        self.holds.release(rid, msg.token)
        dropped = hold.write.step(WriteEvent.ABORT) is WriteAction.DROP
        if dropped:
            self.remove(hold.entry, NotFound(f"the put of {msg.request_id!r} was aborted by its writer"))
        self.store.release_writer(hold.entry)
        return p.Ok(req=msg.req, value=dropped)

    def writer_gone(self, hold: Hold) -> bool:
        """The writer of this reservation hung up: True if that dropped a live put."""
        dropped = hold.write.step(WriteEvent.GONE) is WriteAction.DROP
        if dropped:
            self.remove(hold.entry, NotFound(f"the writer of {hold.request_id!r} disconnected before committing"))
            self.metrics.abandoned.inc()
        self.store.release_writer(hold.entry)
        return dropped

    # --- pushes -------------------------------------------------------------------------------------

    def _start_push(self, entry: Entry, dest: str, sealed: bool, rid: bytes | None = None) -> Push:
        """Push entry to dest as its bytes are written (the offer goes as soon as the link is up).
        A push that cannot start (an unknown peer) drops the put: its client gets the error."""
        lease = self.store.lease(entry, consume=True, deadline=None, incomplete=True)
        try:
            push = self.transfers.push(entry, lease.token, dest, sealed=sealed)
        except BaseException:
            if rid is not None:
                hold = self.holds.get(rid, entry.token)
                self.holds.release(rid, entry.token)
                if hold is not None:
                    hold.write.step(WriteEvent.REMOVED_UNHEARD)  # (its put_alloc gets the error)
            self.store.remove(entry)
            self.store.release_writer(entry)  # (the client has not written yet, or has finished)
            raise
        self._pushes[entry.token] = push

        def ended(outcome: asyncio.Future) -> None:
            self._pushes.pop(entry.token, None)
            error = None if outcome.cancelled() else outcome.exception()
            if error is not None and entry.state is State.WRITING and not entry.removed:
                # a stream whose push failed before its commit can never be delivered: end it now,
                # so that its writer's next write fails instead of its commit
                self.remove(entry, error if isinstance(error, KvdError) else InternalError(str(error)))

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
        self.holds.owe(rid, 1)
        self.transfers.when_ended(push, lambda error: self._push_ended(rid, msg, entry, error))
        return None

    def _push_ended(self, rid: bytes, msg: p.PutCommit | p.Put, entry: Entry, error: KvdError | None) -> None:
        self.holds.owe(rid, -1)
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
        loans = self.holds.loans(rid)
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
        self.holds.lend(rid, reply.scratch, blocks)
        return reply

    # --- entries that end without their writer -------------------------------------------------------

    def remove(self, entry: Entry, error: KvdError) -> None:
        """Remove an entry in any state, ending whatever is still at work on it."""
        self.store.remove(entry)
        if entry.state is State.WRITING:
            self._end_write(entry, error)  # its writer may still be copying: park the blocks, tell it
        if entry.state in (State.WRITING, State.RECEIVING):
            self.watch.on_dropped(entry, error)  # stream readers
        self.transfers.abort_entry(entry, error)  # a push being written or committed, a pull served, an arrival

    def _end_write(self, entry: Entry, error: KvdError) -> None:
        """A reservation was removed while its writer may still be copying into it: park its
        blocks and tell the writer (on its put_alloc's req), so that its next write fails at
        once and it lets go of them."""
        writer = self.holds.writer_of(entry)
        if writer is None:
            self.store.release_writer(entry)  # nobody left who could write
            return
        rid, hold = writer
        if not self._is_connected(rid):
            hold.write.step(WriteEvent.REMOVED_UNHEARD)
            self.store.release_writer(entry)
        elif hold.write.step(WriteEvent.REMOVED, error) is WriteAction.TELL:
            self._reply(rid, p.error_reply(hold.req, error, self.settings.node_id))

    def write_expired(self, entry: Entry) -> None:
        """A reservation's lease ran out (the housekeeping sweep removed it)."""
        hold = self.holds.stream_hold(entry)
        lease = f"{self.settings.lease_timeout:g} s"
        if hold is not None and hold.stream:
            error = Timeout(f"the stream's lease expired after {lease} without a write (--lease-timeout)")
        else:
            error = Timeout(f"the put of {entry.request_id!r} was not committed within {lease} of its reservation "
                            "(--lease-timeout)")
        self._end_write(entry, error)
        self.watch.on_dropped(entry, error)
        self.transfers.abort_entry(entry, error)

    def _is_remote(self, peer: str | None) -> bool:
        return peer is not None and peer != self.settings.node_id
