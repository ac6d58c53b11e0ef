"""Serving local clients (daemon process): put, get, streams, delete, stats, over the local socket.

Handlers that can answer at once do so inside the socket callback; those that wait (for data
to arrive, or on a peer) run as tasks this object owns, so one slow request never holds up
another. Any exception becomes an Error reply carrying its wire code. A put with a destination
is one push (`transfers.push`), fed as the client writes; a get from a source is one pull,
shared by every get of the same entry (`SharedPulls`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from kvd.errors import BadRequest, InternalError, KvdError, NotFound, ShuttingDown, Timeout
from kvd.wire import protocol as p
from kvd.wire.layout import TensorSpec, blocks_needed

from .config import Config
from .registry import Directory
from .holds import Hold, Holds
from .lifecycle import Lifecycle
from .local_server import LocalServer
from .metrics import Metrics
from .peer.transfers import Push, Transfers
from .pulls import SharedPulls
from .reads import MAX_WAIT, ConnectionWaits, Reads
from .store.entries import Entry, State, Store, validate_request_id
from .watch import EntryWatch, ParkedGet

log = logging.getLogger(__name__)

# loans of scratch blocks one connection may hold: one per small put it has in flight, up to this
LOANS_PER_CONNECTION = 16
MAX_NOTE = 512  # characters of a request id or error message kept for kvd status
# what a draining daemon still takes: it finishes or undoes work already started (a stream's
# next layers and its commit, a read's release, a delete), or only reads
ALLOWED_WHILE_DRAINING = (p.PutPart, p.PutCommit, p.GetDone, p.Delete, p.Stats, p.Hello, p.ListEntries,
                          p.ClusterNodes, p.ClusterLocate, p.CacheCommit, p.CacheRelease, p.CacheStats)


@dataclass(frozen=True)
class HelloInfo:
    """What a client needs to map the pool, as hello_ok says it."""

    node_id: str
    incarnation: int
    pool_path: str
    pool_size: int
    block_size: int
    device: str
    pool_handle: bytes | None


class LocalHandlers:
    def __init__(self, config: Config, store: Store, watch: EntryWatch, transfers: Transfers, metrics: Metrics,
                 clients: LocalServer, lifecycle: Lifecycle, hello: HelloInfo, stats: Callable[[], dict],
                 directory: Directory | None = None) -> None:
        self.config = config
        self.store = store
        self.watch = watch
        self.transfers = transfers
        self.metrics = metrics
        self.clients = clients
        self.lifecycle = lifecycle
        self.hello = hello
        self.stats = stats
        self.holds = Holds(store)
        self.pulls = SharedPulls(transfers)
        self.reads = Reads(config, store, watch, self.pulls, directory, self._reply)
        self._pushes: dict[int, Push] = {}  # entry token -> its push (to a peer), until committed
        self._tasks: set[asyncio.Task] = set()
        self.waits = ConnectionWaits(watch, metrics)  # each connection's gets still waiting
        self._owed: dict[bytes, int] = {}  # connection -> other answers it waits for (a push's put_ok, a locate)
        clients.in_use = self._in_use  # (an idle connection may be evicted at --max-clients)
        self.cache = None  # the KV tier's requests (daemon/cache.py), set by the daemon

    async def close(self) -> None:
        self.watch.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- messages in, replies out -------------------------------------------------------------------

    def on_local_message(self, frames: list) -> None:
        rid = frames[0]
        try:
            msg = p.decode(frames[1:])
        except KvdError as exc:  # answered with the req the header's first keys give, when they do
            self.metrics.report_undecodable("client", f"client {rid.decode()}", exc, log)
            reply = self._error(None, exc)
            reply.req = p.request_number(frames[1]) if len(frames) > 1 else 0
            self._reply(rid, reply)
            return
        try:
            if self.lifecycle.draining and not isinstance(msg, ALLOWED_WHILE_DRAINING):
                raise ShuttingDown(f"daemon {self.config.node_id} is shutting down")
            if hasattr(msg, "request_id"):
                validate_request_id(msg.request_id)
            reply = self._handle(rid, msg)
        except Exception as exc:
            reply = self._error(msg, exc)
        if reply is not None:
            self._reply(rid, reply)

    def _reply(self, rid: bytes, msg: p.Message) -> bool:
        """Send msg to a client; False if that client has gone (a read lease meant for it goes back)."""
        if not self.clients.is_connected(rid):
            if isinstance(msg, p.GetSlots):  # a get that waited for its entry outlived its caller
                self._return_lease(msg.token)
            return False
        if isinstance(msg, p.GetSlots):
            self.holds.hold(rid, Hold(msg.token, self.store.lease_of(msg.token).request_id))
        return self.clients.send(rid, msg)

    def _error(self, msg: p.Message | None, exc: Exception) -> p.Error:
        self.metrics.tally["errors"] += 1
        kind = msg.TYPE if msg is not None else "undecodable"
        if not isinstance(exc, KvdError):
            log.exception("internal error handling %s", kind, exc_info=exc)
        reply = p.error_reply(getattr(msg, "req", 0), exc, self.config.node_id)
        self.metrics.error(reply.code)
        request_id = getattr(msg, "request_id", None)
        self.metrics.recent_errors.append({  # (bounded: kvd status must stay small whatever a client sent)
            "time": round(time.time(), 3), "request": kind, "code": reply.code, "message": reply.message[:MAX_NOTE],
            "request_id": request_id[:MAX_NOTE] if isinstance(request_id, str) else None})
        return reply

    def _list_page(self, after: str | None, limit: int | None) -> list[dict]:
        """Entries by request id after `after`, at most LIST_PAGE (one reply must fit a header:
        the client library and `kvd ls` ask for the next page until one comes back short)."""
        count = p.LIST_PAGE if limit is None else max(0, min(limit, p.LIST_PAGE))
        ids = sorted(i for i in self.store.entries if after is None or i > after)[:count]
        return [self.store.entries[i].describe() for i in ids]

    def _later(self, rid: bytes, msg: p.Message, coro, waits: bool = False) -> None:
        """Run a handler that waits (on a peer, or for data) without holding up other clients. A
        waiting read (waits=True) ends with its client: nobody is left to answer (a get may wait an
        hour, and a client that hangs up must not leave it behind)."""
        if waits:
            try:
                self.waits.admit(rid)  # (at most so many per connection)
            except BaseException:
                coro.close()
                raise

        async def run() -> None:
            try:
                reply = await coro
            except Exception as exc:
                reply = self._error(msg, exc)
            if waits:
                self.waits.ended(rid, task)  # before the reply: the client's next call sees it ended
            else:
                self._owe(rid, -1)
            if reply is not None:
                self._reply(rid, reply)

        task = asyncio.get_running_loop().create_task(run(), name=f"{msg.TYPE}-{getattr(msg, 'request_id', '')[:64]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if waits:
            self.waits.add(rid, task)
            task.add_done_callback(lambda task: self.waits.ended(rid, task))  # (cancelled: its client left)
        else:
            self._owe(rid, 1)

    def _owe(self, rid: bytes, count: int) -> None:
        owed = self._owed.get(rid, 0) + count
        if owed > 0:
            self._owed[rid] = owed
        else:
            self._owed.pop(rid, None)

    def _park(self, rid: bytes, msg: p.Get) -> None:
        """A get that can only wait here waits in the entry watch, without a task."""
        if msg.timeout == 0:
            raise self.watch.not_here(msg.request_id)
        self.waits.admit(rid)
        self.waits.add(rid, self.watch.park(rid, msg, self._answer_parked))

    def _answer_parked(self, parked: ParkedGet, found: Entry | KvdError) -> None:
        self.waits.ended(parked.rid, parked)
        try:
            if isinstance(found, KvdError):
                raise found
            reply = self.reads.lease_for_client(parked.msg, found)
        except Exception as exc:
            reply = self._error(parked.msg, exc)
        self._reply(parked.rid, reply)

    def _in_use(self, rid: bytes) -> bool:
        """The connection holds or waits for something (it is not idle, whatever its silence)."""
        return (rid in self._owed or self.waits.holds_any(rid) or self.holds.holds_any(rid)
                or (self.cache is not None and self.cache.in_use(rid)))

    def _handle(self, rid: bytes, msg: p.Message) -> p.Message | None:
        if isinstance(msg, p.CACHE_REQUESTS) and self.cache is not None:
            return self.cache.handle(rid, msg)
        match msg:
            case p.Hello():
                h = self.hello
                return p.HelloOk(req=msg.req, node_id=h.node_id, incarnation=h.incarnation, pool_path=h.pool_path,
                                 pool_size=h.pool_size, block_size=h.block_size, device=h.device,
                                 pool_handle=h.pool_handle)
            case p.PutAlloc():
                return self._put_alloc(rid, msg)
            case p.PutPart():
                hold = self.holds.write_hold(rid, msg.token, msg.request_id)
                if hold.ended is not None:
                    return None  # the writer was told why; its next write or commit lets go of the blocks
                entry = hold.entry
                entry.write_deadline = time.monotonic() + self.config.lease_timeout  # a stream that writes is alive
                self._written(entry, entry.mark_tensors(msg.tensors), msg.tensors)
                return None
            case p.PutCommit():
                return self._put_commit(rid, msg)
            case p.Put():
                return self._put_in_scratch(rid, msg)
            case p.GetStream():
                self._later(rid, msg, self.reads.get_stream(rid, msg), waits=True)
                return None
            case p.Get():
                if not 0 <= msg.timeout <= MAX_WAIT:
                    raise BadRequest(f"timeout must be between 0 and {MAX_WAIT:g} seconds")
                entry = self.store.ready(msg.request_id)
                if entry is not None:
                    return self.reads.lease_for_client(msg, entry)
                if self.reads.waits_here(msg):
                    self._park(rid, msg)
                else:
                    self._later(rid, msg, self.reads.get(rid, msg), waits=True)
                return None
            case p.GetDone():
                return self._get_done(rid, msg)
            case p.Delete() if msg.token is not None:  # a writer gives up its own reservation
                hold = self.holds.get(rid, msg.token)
                if hold is None or not hold.writing or hold.request_id != msg.request_id:
                    return p.Ok(req=msg.req, value=False)
                self.holds.release(rid, msg.token)
                live = hold.ended is None and not hold.entry.removed
                if live:
                    self._delete(hold.entry, NotFound(f"the put of {msg.request_id!r} was aborted by its writer"))
                self.store.release_writer(hold.entry)
                return p.Ok(req=msg.req, value=live)
            case p.Delete():
                entry = self.store.entries.get(msg.request_id)
                if entry is None:
                    return p.Ok(req=msg.req, value=False)
                self._delete(entry, NotFound(f"request {msg.request_id!r} was deleted on {self.config.node_id}"))
                return p.Ok(req=msg.req, value=True)
            case p.Stats():
                return p.Ok(req=msg.req, value=self.stats())
            case p.ClusterNodes():
                return p.Ok(req=msg.req, value=self.reads.directory().nodes())
            case p.ClusterLocate():
                self._later(rid, msg, self.reads.locate(msg))
                return None
            case p.ListEntries():
                return p.Ok(req=msg.req, value=self._list_page(msg.after, msg.limit))
            case _:
                raise BadRequest(f"{msg.TYPE} is not a client request")

    # --- puts -------------------------------------------------------------------------------------------

    def _put_alloc(self, rid: bytes, msg: p.PutAlloc) -> p.PutSlots:
        if self.holds.take_loan(rid, msg.give_back):
            self.store.return_scratch(msg.give_back)
        specs = [TensorSpec.from_wire(t) for t in msg.tensors]
        entry = self.store.reserve(msg.request_id, specs, msg.ttl, msg.meta, State.WRITING,
                                   time.monotonic() + self.config.lease_timeout)
        self.holds.hold(rid, Hold(entry.token, entry.request_id, entry, req=msg.req, stream=msg.stream))
        if msg.stream and self._is_remote(msg.dest):
            self._start_push(entry, msg.dest, sealed=False, rid=rid)
        if msg.stream:
            self.watch.wake(entry.request_id)  # get_stream readers may start now
        return p.PutSlots(req=msg.req, token=entry.token, segments=entry.segments(self.config.block_size))

    def _put_commit(self, rid: bytes, msg: p.PutCommit) -> p.PutOk | None:
        hold = self.holds.write_hold(rid, msg.token, msg.request_id)
        self.holds.release(rid, msg.token)
        if hold.ended is not None:  # committed after every copy: the parked blocks can go
            self.store.release_writer(hold.entry)
            raise hold.ended
        entry = self.store.writing_entry(msg.request_id, msg.token, State.WRITING)
        push = self._pushes.get(entry.token)
        written = entry.mark_rest()
        if push is None and self._is_remote(msg.dest):
            push = self._start_push(entry, msg.dest, sealed=True)  # every byte is in: it goes whole
        self._written(entry, *written)  # (to a streamed push, and stream readers)
        self.transfers.entry_committed(entry)
        return self._publish_put(rid, msg, entry, push)

    def _put_in_scratch(self, rid: bytes, msg: p.Put) -> p.PutOk | None:
        if not self.holds.take_loan(rid, msg.scratch):  # used up, whatever happens next
            raise NotFound(f"scratch blocks {msg.scratch} are not lent to this connection")
        try:
            specs = [TensorSpec.from_wire(t) for t in msg.tensors]
        except BaseException:
            self.store.return_scratch(msg.scratch)
            raise
        entry = self.store.reserve_in_scratch(msg.scratch, msg.request_id, specs, msg.ttl, msg.meta,
                                              State.WRITING, time.monotonic() + self.config.lease_timeout)
        written = entry.mark_rest()
        push = self._start_push(entry, msg.dest, sealed=True) if self._is_remote(msg.dest) else None
        self._written(entry, *written)
        return self._publish_put(rid, msg, entry, push)

    def _start_push(self, entry: Entry, dest: str, sealed: bool, rid: bytes | None = None) -> Push:
        """Push entry to dest as its bytes are written (the offer goes as soon as the link is up).
        A push that cannot start (an unknown peer) drops the put: its client gets the error."""
        lease = self.store.lease(entry, consume=True, deadline=None, incomplete=True)
        try:
            push = self.transfers.push(entry, lease.token, dest, sealed=sealed)
        except BaseException:
            if rid is not None:
                self.holds.release(rid, entry.token)
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
                self._delete(entry, error if isinstance(error, KvdError) else InternalError(str(error)))

        self.transfers.outcome(push).add_done_callback(ended)
        return push

    def _written(self, entry: Entry, ranges: list[tuple[int, int]], indices: list[int]) -> None:
        """A local producer wrote these tensors: tell stream readers, ship them to the peer."""
        self.watch.on_progress(entry, indices)
        self.transfers.entry_written(entry, ranges)

    def _publish_put(self, rid: bytes, msg: p.PutCommit | p.Put, entry: Entry, push: Push | None) -> p.PutOk | None:
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
        self._owe(rid, 1)
        self.transfers.when_ended(push, lambda error: self._finish_push(rid, msg, entry, error))
        return None

    def _finish_push(self, rid: bytes, msg: p.PutCommit | p.Put, entry: Entry, error: KvdError | None) -> None:
        self._owe(rid, -1)
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
        if len(loans) >= LOANS_PER_CONNECTION or not 0 < total_bytes <= self.config.scratch_max:
            return reply
        if not self.clients.is_connected(rid):
            return reply
        block_size = self.config.block_size
        blocks = min(1 << (blocks_needed(total_bytes, block_size) - 1).bit_length(),
                     max(1, self.config.scratch_max // block_size))
        pool = self.store.allocator
        if (self.store.scratch_blocks + blocks > pool.num_blocks // 16
                or loans and sum(loans.values()) + blocks > pool.num_blocks // 64
                or pool.free_blocks - blocks < pool.num_blocks // 2):
            return reply
        reply.scratch, extents = self.store.lend_scratch(blocks)
        reply.extents = [list(extent) for extent in extents]
        self.holds.lend(rid, reply.scratch, blocks)
        return reply

    # --- entries that end without their writer -------------------------------------------------------

    def _delete(self, entry: Entry, error: KvdError) -> None:
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
        if writer is None or not self.clients.is_connected(writer[0]):
            self.store.release_writer(entry)  # nobody left who could write
            return
        rid, hold = writer
        hold.ended = error
        self._reply(rid, p.error_reply(hold.req, error, self.config.node_id))

    def write_expired(self, entry: Entry) -> None:
        """A reservation's lease ran out (the housekeeping sweep removed it)."""
        hold = self.holds.stream_hold(entry)
        lease = f"{self.config.lease_timeout:g} s"
        if hold is not None and hold.stream:
            error = Timeout(f"the stream's lease expired after {lease} without a write (--lease-timeout)")
        else:
            error = Timeout(f"the put of {entry.request_id!r} was not committed within {lease} of its reservation "
                            "(--lease-timeout)")
        self._end_write(entry, error)
        self.watch.on_dropped(entry, error)
        self.transfers.abort_entry(entry, error)

    def on_client_gone(self, rid: bytes) -> None:
        """A client hung up: its unfinished puts are dropped and its reads given back now, as
        they would be at lease expiry; blocks parked for it are free at last."""
        self.pulls.leave_all(rid)
        if self.cache is not None:
            self.cache.client_gone(rid)  # its tier reservations and pins
        self.waits.drop(rid)  # every one of its waits, now
        self._owed.pop(rid, None)
        loans, holds = self.holds.gone(rid)
        for token in loans:
            self.store.return_scratch(token)
        writes = reads = 0
        for hold in holds:
            if not hold.writing:
                self._return_lease(hold.token)
                reads += 1
                continue
            if hold.ended is None and not hold.entry.removed:
                self._delete(hold.entry, NotFound(f"the writer of {hold.request_id!r} disconnected before "
                                                  "committing"))
                self.metrics.abandoned.inc()
                writes += 1
            self.store.release_writer(hold.entry)
        if writes or reads:
            log.warning("a client disconnected with %d unfinished put(s) and %d open read(s); giving them back",
                        writes, reads)

    # --- gets ---------------------------------------------------------------------------------------------

    def _get_done(self, rid: bytes, msg: p.GetDone) -> p.Ok | None:
        self.holds.read_hold(rid, msg.token)
        self.holds.release(rid, msg.token)
        lease = self.store.lease_of(msg.token)
        claiming = lease is not None and lease.claiming
        # (a lease that ran out was given back already: releasing it only unpins its blocks)
        entry = self.store.release(msg.token, success=msg.consume)
        if claiming and msg.consume:
            self.metrics.duration.labels("local_get").observe(time.monotonic() - lease.started)
            self.metrics.local_bytes.labels("out").inc(entry.total_bytes)
        if msg.token in self.watch.stream_leases:
            self.watch.drop_reader(msg.token)
            if msg.consume:
                self.store.remove(entry)
        if claiming and not msg.consume and entry is not None and not entry.removed:
            self.watch.wake(entry.request_id)  # a claim given back: the next reader may have it now
        self.metrics.tally["gets"] += 1
        return p.Ok(req=msg.req) if msg.reply else None

    def _return_lease(self, token: int) -> None:
        """Give a client's read lease back now: the entry is readable again, waiters are woken."""
        lease = self.store.lease_of(token)
        if lease is None:
            return
        self.watch.drop_reader(token)
        self.store.release(token, success=False)
        self.watch.lease_expired(lease)

    def _is_remote(self, peer: str | None) -> bool:
        return peer is not None and peer != self.config.node_id
