"""Serving local clients: put, get, streams, delete, stats, over the daemon's local socket.

Handlers that can answer at once do so inside the socket callback; those that wait (for
data to arrive, or on a peer) run as tasks, so one slow request never holds up another.
Any exception becomes an Error reply carrying its wire code. Also owns what happens when
entries change: waking waiters, telling stream readers, shipping streamed writes.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvd.errors import BadRequest, InternalError, KvdError, NotFound, ShuttingDown, Timeout
from kvd.wire import protocol as p
from kvd.wire.layout import TensorSpec, blocks_needed

from .store.entries import Entry, Lease, State
from .streams import Producer, StreamReader

if TYPE_CHECKING:
    from .daemon import Daemon

log = logging.getLogger(__name__)

MAX_WAIT = 3600.0  # longest get timeout we accept
FINISHING_WORK = (p.PutPart, p.PutCommit, p.GetDone, p.Delete, p.Stats, p.Hello, p.ListEntries)
RECENT_ERRORS = 20  # kept for `kvd status`
HELD_PRUNE_AT = 1024  # per connection: holds tracked before ended ones are pruned


@dataclass(eq=False)
class Hold:
    """What one client connection holds: a reservation it writes into, or a read lease."""

    token: int
    request_id: str
    entry: Entry | None = None  # the reservation (None: a read lease)
    req: int = 0  # the put_alloc that made a reservation: its writer is told on it if the put ends
    stream: bool = False
    # why the reservation ended while its writer was connected (lease ran out, deleted, push
    # failed): its blocks stay parked until the writer acknowledges (commit, delete) or hangs up
    ended: KvdError | None = None

    @property
    def writing(self) -> bool:
        return self.entry is not None


class ClientService:
    def __init__(self, daemon: "Daemon") -> None:
        self.daemon = daemon
        self.config = daemon.config
        self.store = daemon.store
        self.exchange = daemon.exchange
        self.metrics = daemon.metrics
        self._waiters: dict[str, list[asyncio.Future]] = {}  # request id -> woken on any change
        self._producers: dict[int, Producer] = {}  # entry token -> push in progress
        self._readers: dict[str, list[StreamReader]] = {}  # request id -> get_stream clients
        self._stream_leases: set[int] = set()
        self._pulls: dict[tuple[str, str], asyncio.Future] = {}  # (source, request id) -> pull in flight
        # connections whose get waits on that pull: when the last one hangs up, the pull is called
        # off (the holder keeps its copy, readable by others, instead of it moving here unread)
        self._pull_readers: dict[tuple[str, str], set[bytes]] = {}
        self._held: dict[bytes, dict[int, Hold]] = {}  # connection -> what it holds, by token
        self._writers: dict[int, bytes] = {}  # reservation token -> the connection writing it
        self._scratch: dict[bytes, int] = {}  # connection -> token of the blocks lent to it (one at most)
        self.counters = {"puts": 0, "gets": 0, "errors": 0}
        self.recent_errors: collections.deque = collections.deque(maxlen=RECENT_ERRORS)

    def pushing(self) -> bool:
        """Pushes (or streams with a dest) are under way, their transfer open or still opening."""
        return bool(self._producers)

    def _wake(self, request_id: str) -> None:
        for waiter in self._waiters.pop(request_id, []):
            if not waiter.done():
                waiter.set_result(None)

    async def _wait_for(self, request_id: str, deadline: float, find) -> Entry:
        """find() -> Entry | None, retried on every change to request_id until deadline.

        Raises NotFound when told not to wait (deadline already passed), Timeout after waiting.
        """
        waited = False
        while True:
            entry = find()
            if entry is not None:
                return entry
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if waited:
                    raise Timeout(f"request {request_id!r} did not arrive within the timeout")
                raise NotFound(f"request {request_id!r} not found on {self.config.node_id}")
            waited = True
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(request_id, []).append(waiter)
            try:
                await asyncio.wait_for(waiter, remaining)
            except asyncio.TimeoutError:
                pass
            finally:
                waiters = self._waiters.get(request_id)
                if waiters and waiter in waiters:
                    waiters.remove(waiter)
                    if not waiters:
                        del self._waiters[request_id]

    async def wait_ready(self, request_id: str, deadline: float) -> Entry:
        """The READY entry for request_id, waiting for it to arrive until deadline."""
        return await self._wait_for(request_id, deadline, lambda: self.store.ready(request_id))

    def _streamable(self, request_id: str) -> Entry | None:
        entry = self.store.entries.get(request_id)
        return entry if entry is not None and entry.state is not State.CLAIMED else None

    # --- entry events: local writes, arrivals from peers -----------------------------------------

    def on_progress(self, entry: Entry, indices: list[int]) -> None:
        """Tensors of an entry still being written or received are complete."""
        if entry.state is State.RECEIVING and entry.request_id not in self._readers:
            self._wake(entry.request_id)  # a get_stream may be waiting for the entry to exist
        for reader in self._readers.get(entry.request_id, []):
            if reader.entry is entry:
                fresh = reader.news(indices)
                if fresh:
                    self._reply(reader.rid, p.TensorsReady(req=reader.req, tensors=fresh))

    def on_published(self, entry: Entry) -> None:
        readers = [r for r in self._readers.pop(entry.request_id, []) if r.entry is entry]
        for reader in readers:
            fresh = reader.news(list(range(len(entry.specs))))
            self._reply(reader.rid, p.TensorsReady(req=reader.req, tensors=fresh, complete=True))
            self.store.set_lease_deadline(reader.lease_token, time.monotonic() + self.config.lease_timeout)
        self._wake(entry.request_id)

    def on_dropped(self, entry: Entry, error: KvdError) -> None:
        """An entry failed before completion: its stream readers get the error, leases go."""
        for reader in [r for r in self._readers.pop(entry.request_id, []) if r.entry is entry]:
            self._reply(reader.rid, p.error_reply(reader.req, error, self.config.node_id))
            self._stream_leases.discard(reader.lease_token)
            try:
                self.store.release(reader.lease_token, success=False)
            except NotFound:
                pass
        producer = self._producers.get(entry.token)
        if producer is not None and producer.outbound is not None:
            self.exchange.abort(producer.outbound, error)
        elif producer is not None:
            # still connecting: the push is aborted as soon as it opens (cancelling the task here
            # could stop it before it ever ran, and then nobody would hand its lease back)
            producer.dropped = error

    # --- local clients -------------------------------------------------------------------------------

    def on_local_message(self, frames: list) -> None:
        rid = frames[0]
        try:
            msg = p.decode(frames[1:])
        except KvdError as exc:
            log.warning("undecodable client message: %s", exc)
            reply = self._error(p.Message(), exc)
            reply.req = p.request_number(frames[1]) if len(frames) > 1 else 0  # to the caller, if it can be told
            self._reply(rid, reply)
            return
        try:
            # draining refuses new work; what finishes or undoes work already started goes on
            # (a stream's next layers and its commit, a read's release, a delete)
            if self.daemon.draining and not isinstance(msg, FINISHING_WORK):
                raise ShuttingDown(f"daemon {self.config.node_id} is shutting down")
            reply = self._handle_now(rid, msg)
        except Exception as exc:
            reply = self._error(msg, exc)
        if reply is not None:
            self._reply(rid, reply)

    def _reply(self, rid: bytes, msg: p.Message) -> bool:
        """Send msg to a client; False if that client has gone (a read lease meant for it goes back)."""
        if not self.daemon.local.is_connected(rid):
            if isinstance(msg, p.GetSlots):  # a get that waited for its entry outlived its caller
                self._return_lease(msg.token)
            return False
        if isinstance(msg, p.GetSlots):
            self._hold(rid, Hold(msg.token, self.store.lease_of(msg.token).request_id))
        self.daemon.local.send_now([rid, *p.encode(msg)])
        return True

    def _return_lease(self, token: int) -> None:
        """Give a client's read lease back now: the entry is readable again, waiters are woken."""
        lease = self.store.lease_of(token)
        if lease is None:
            return
        self._drop_reader(token)
        self.store.release(token, success=False)
        self.lease_expired(lease)

    def on_client_gone(self, rid: bytes) -> None:
        """A client hung up: its unfinished puts are dropped and its reads given back now, as
        they would be at lease expiry; blocks parked for it are free at last."""
        scratch = self._scratch.pop(rid, None)
        if scratch is not None:
            self.store.return_scratch(scratch)
        for key in [k for k, readers in self._pull_readers.items() if rid in readers]:
            self._leave_pull(key, rid)
        held = self._held.pop(rid, None)
        if not held:
            return
        writes = reads = 0
        for hold in held.values():
            if not self._is_live(hold):
                continue
            if not hold.writing:
                self._return_lease(hold.token)
                reads += 1
                continue
            self._writers.pop(hold.token, None)
            if hold.ended is None and not hold.entry.removed:
                self.store.remove(hold.entry)
                self.on_dropped(hold.entry, NotFound(f"the writer of {hold.request_id!r} disconnected before "
                                                     "committing"))
                self.metrics.abandoned.inc()
                writes += 1
            self.store.release_writer(hold.entry)
        if writes or reads:
            log.warning("a client disconnected with %d unfinished put(s) and %d open read(s); giving them back",
                        writes, reads)

    def _hold(self, rid: bytes, hold: Hold) -> None:
        held = self._held.setdefault(rid, {})
        held[hold.token] = hold
        if hold.writing:
            self._writers[hold.token] = rid
        if len(held) > HELD_PRUNE_AT:  # a long-lived client whose holds ended otherwise (expiry, delete)
            for stale in [t for t, h in held.items() if not self._is_live(h)]:
                del held[stale]

    def _is_live(self, hold: Hold) -> bool:
        """Still something to give back: a lease not released, a reservation whose blocks its
        writer may still write into."""
        if hold.writing:
            return hold.entry.writer
        return self.store.lease_of(hold.token) is not None

    def _release_hold(self, rid: bytes, token: int) -> None:
        held = self._held.get(rid)
        if held is not None and held.pop(token, None) is not None:
            self._writers.pop(token, None)

    def _write_hold(self, rid: bytes, token: int, request_id: str) -> Hold:
        """The reservation `token` of connection rid (put_part, put_commit name it)."""
        hold = self._held.get(rid, {}).get(token)
        if hold is None or not hold.writing or hold.request_id != request_id:
            raise NotFound(f"the put of {request_id!r} with token {token} is not held by this connection "
                           "(committed, aborted, or another connection's)")
        return hold

    def end_write(self, entry: Entry, error: KvdError) -> None:
        """A reservation was removed while its writer may still be copying into it: park its
        blocks and tell the writer (on its put_alloc's req), so that its next write fails at
        once and it lets go of them."""
        rid = self._writers.pop(entry.token, None)
        hold = self._held.get(rid, {}).get(entry.token) if rid is not None else None
        if hold is None or not self.daemon.local.is_connected(rid):
            self.store.release_writer(entry)  # nobody left who could write
            return
        hold.ended = error
        self._reply(rid, p.error_reply(hold.req, error, self.config.node_id))

    def write_expired(self, entry: Entry) -> None:
        """A reservation's lease ran out (the sweep removed it)."""
        hold = self._held.get(self._writers.get(entry.token), {}).get(entry.token)
        lease = f"{self.config.lease_timeout:g} s"
        if hold is not None and hold.stream:
            error = Timeout(f"the stream's lease expired after {lease} without a write (--lease-timeout)")
        else:
            error = Timeout(f"the put of {entry.request_id!r} was not committed within {lease} of its reservation "
                            "(--lease-timeout)")
        self.end_write(entry, error)
        self.on_dropped(entry, error)

    def _error(self, msg: p.Message, exc: Exception) -> p.Error:
        self.counters["errors"] += 1
        if not isinstance(exc, KvdError):
            log.exception("internal error handling %s", msg.TYPE, exc_info=exc)
        reply = p.error_reply(getattr(msg, "req", 0), exc, self.config.node_id)
        self.metrics.error(reply.code)
        self.recent_errors.append({"time": round(time.time(), 3), "request": msg.TYPE,
                                   "request_id": getattr(msg, "request_id", None), "code": reply.code,
                                   "message": reply.message})
        return reply

    def lease_expired(self, lease: Lease) -> None:
        """A read lease ran out (or its client hung up): the entry is back, wake its waiters."""
        self._stream_leases.discard(lease.token)
        self._wake(lease.request_id)

    def _later(self, rid: bytes, msg: p.Message, coro) -> None:
        """Run a handler that waits (on a peer, or for data) without holding up other clients."""
        async def run() -> None:
            try:
                reply = await coro
            except Exception as exc:
                reply = self._error(msg, exc)
            if reply is not None:
                self._reply(rid, reply)

        self.daemon.spawn(run(), f"{msg.TYPE}-{getattr(msg, 'request_id', '')}")

    def _handle_now(self, rid: bytes, msg: p.Message) -> p.Message | None:
        cfg = self.config
        match msg:
            case p.Hello():
                return p.HelloOk(req=msg.req, node_id=cfg.node_id, incarnation=self.daemon.incarnation,
                                 pool_path=self.daemon.memory.client_path, pool_size=cfg.pool_size,
                                 block_size=cfg.block_size, device=cfg.device,
                                 pool_handle=self.daemon.memory.ipc_handle)
            case p.PutAlloc():
                if msg.give_back is not None and self._scratch.get(rid) == msg.give_back:
                    del self._scratch[rid]
                    self.store.return_scratch(msg.give_back)
                specs = [TensorSpec.from_wire(t) for t in msg.tensors]
                entry = self.store.reserve(msg.request_id, specs, msg.ttl, msg.meta, State.WRITING,
                                           time.monotonic() + cfg.lease_timeout)
                self._hold(rid, Hold(entry.token, entry.request_id, entry, req=msg.req, stream=msg.stream))
                if msg.stream:
                    self._wake(entry.request_id)  # get_stream readers may start now
                    if self._is_remote(msg.dest):
                        self._start_producer(entry, msg.dest, stream=True)
                return p.PutSlots(req=msg.req, token=entry.token, segments=entry.segments(cfg.block_size))
            case p.PutPart():
                hold = self._write_hold(rid, msg.token, msg.request_id)
                if hold.ended is not None:
                    return None  # the writer was told why; its next write or commit lets go of the blocks
                entry = hold.entry
                entry.write_deadline = time.monotonic() + cfg.lease_timeout  # a stream that writes is alive
                self._written(entry, entry.mark_tensors(msg.tensors), msg.tensors)
                return None
            case p.PutCommit():
                hold = self._write_hold(rid, msg.token, msg.request_id)
                self._release_hold(rid, msg.token)
                if hold.ended is not None:  # committed after every copy: the parked blocks can go
                    self.store.release_writer(hold.entry)
                    raise hold.ended
                producer = self._producers.get(msg.token)
                if producer is not None and producer.entry.request_id == msg.request_id and producer.entry.removed:
                    # every tensor was written and the peer already has them all: just report
                    self._later(rid, msg, self._finish_push(rid, producer, msg))
                    return None
                entry = self.store.writing_entry(msg.request_id, msg.token, State.WRITING)
                if producer is None and self._is_remote(msg.dest):
                    producer = self._start_producer(entry, msg.dest, stream=False)
                self._written(entry, *entry.mark_rest())
                if producer is not None and producer.stream:
                    producer.committed = True
                    if producer.outbound is not None:
                        self.exchange.seal(producer.outbound)
                return self._publish_put(rid, msg, entry, producer)
            case p.Put():
                if self._scratch.get(rid) != msg.scratch:
                    raise NotFound(f"scratch blocks {msg.scratch} are not lent to this connection")
                del self._scratch[rid]  # used up, whatever happens next
                try:
                    specs = [TensorSpec.from_wire(t) for t in msg.tensors]
                except BaseException:
                    self.store.return_scratch(msg.scratch)
                    raise
                entry = self.store.reserve_in_scratch(msg.scratch, msg.request_id, specs, msg.ttl, msg.meta,
                                                      State.WRITING, time.monotonic() + cfg.lease_timeout)
                producer = self._start_producer(entry, msg.dest, stream=False) if self._is_remote(msg.dest) else None
                self._written(entry, *entry.mark_rest())
                return self._publish_put(rid, msg, entry, producer)
            case p.GetStream():
                self._later(rid, msg, self._get_stream(rid, msg))
                return None
            case p.Get():
                if not 0 <= msg.timeout <= MAX_WAIT:
                    raise BadRequest(f"timeout must be between 0 and {MAX_WAIT:g} seconds")
                entry = self.store.ready(msg.request_id)
                if entry is not None:
                    return self._lease_for_client(msg, entry)
                self._later(rid, msg, self._get_later(rid, msg))
                return None
            case p.GetDone():
                hold = self._held.get(rid, {}).get(msg.token)
                if hold is None or hold.writing:
                    # a read lease is released only by the connection it was given to (a client
                    # that reconnected to a restarted daemon must not end another's by number)
                    raise NotFound(f"read lease {msg.token} is not held by this connection")
                self._release_hold(rid, msg.token)
                lease = self.store.lease_of(msg.token)
                claiming = lease is not None and lease.claiming
                # (a lease that ran out was given back already: releasing it only unpins its blocks)
                entry = self.store.release(msg.token, success=msg.consume)
                if claiming and msg.consume:
                    self.metrics.duration.labels("local_get").observe(time.monotonic() - lease.started)
                    self.metrics.local_bytes.labels("out").inc(entry.total_bytes)
                if msg.token in self._stream_leases:
                    self._stream_leases.discard(msg.token)
                    self._drop_reader(msg.token)
                    if msg.consume:
                        self.store.remove(entry)
                self.counters["gets"] += 1
                return p.Ok(req=msg.req) if msg.reply else None
            case p.Delete() if msg.token is not None:  # a writer gives up its own reservation
                hold = self._held.get(rid, {}).get(msg.token)
                if hold is None or not hold.writing or hold.request_id != msg.request_id:
                    return p.Ok(req=msg.req, value=False)
                self._release_hold(rid, msg.token)
                live = hold.ended is None and not hold.entry.removed
                if live:
                    self._delete(hold.entry, NotFound(f"the put of {msg.request_id!r} was aborted by its writer"))
                self.store.release_writer(hold.entry)
                return p.Ok(req=msg.req, value=live)
            case p.Delete():
                entry = self.store.entries.get(msg.request_id)
                if entry is None:
                    return p.Ok(req=msg.req, value=False)
                self._delete(entry, NotFound(f"request {msg.request_id!r} was deleted on {cfg.node_id}"))
                return p.Ok(req=msg.req, value=True)
            case p.Stats():
                return p.Ok(req=msg.req, value=self.daemon.stats())
            case p.ListEntries():
                return p.Ok(req=msg.req, value=[e.describe() for e in self.store.entries.values()])
            case _:
                raise BadRequest(f"{msg.TYPE} is not a client request")

    def _delete(self, entry: Entry, error: KvdError) -> None:
        """Remove an entry in any state, ending whatever is still at work on it."""
        self.store.remove(entry)
        if entry.state is State.WRITING:
            self.end_write(entry, error)  # its writer may still be copying: park the blocks, tell it
        if entry.state in (State.WRITING, State.RECEIVING):
            self.on_dropped(entry, error)  # stream readers, a push still being written
        self.exchange.abort_entry(entry, error)  # a committed push, a pull served, an arrival

    def _publish_put(self, rid: bytes, msg: p.PutCommit | p.Put, entry: Entry,
                     producer: Producer | None) -> p.PutOk | None:
        """Every byte of a local put is written: publish it, or answer once the push is over."""
        self.store.publish(entry)
        self.counters["puts"] += 1
        self.metrics.local_bytes.labels("in").inc(entry.total_bytes)
        # every byte is in: stream readers here finish, even when the push owns the entry from now on
        self.on_published(entry)
        if producer is None:
            self.metrics.duration.labels("local_put").observe(time.time() - entry.created)
            return self._put_ok(rid, msg, entry.total_bytes)
        self._later(rid, msg, self._finish_push(rid, producer, msg))
        return None

    def _put_ok(self, rid: bytes, msg: p.PutCommit | p.Put, total_bytes: int) -> p.PutOk:
        """The reply to a finished put; lends the connection blocks for its next put when it
        was small, so that one takes a single round trip (the client fills them, then asks).

        Lent blocks are taken back only when the connection ends or the client uses or returns
        them (never from under a client that may be writing into them), so lending is bounded
        instead: one loan per connection, sized to this put rounded up to a power of two
        blocks, only while the pool is less than half full, at most 1/16 of it in all."""
        reply = p.PutOk(req=msg.req)
        if isinstance(msg, p.PutCommit) and not msg.lend:
            return reply
        if rid in self._scratch or not 0 < total_bytes <= self.config.scratch_max:
            return reply
        if not self.daemon.local.is_connected(rid):
            return reply
        block_size = self.config.block_size
        blocks = min(1 << (blocks_needed(total_bytes, block_size) - 1).bit_length(),
                     max(1, self.config.scratch_max // block_size))
        pool = self.store.allocator
        if (self.store.scratch_blocks + blocks > pool.num_blocks // 16
                or pool.free_blocks - blocks < pool.num_blocks // 2):
            return reply
        reply.scratch, extents = self.store.lend_scratch(blocks)
        reply.extents = [list(extent) for extent in extents]
        self._scratch[rid] = reply.scratch
        return reply

    def _lease_for_client(self, msg: p.Get, entry: Entry) -> p.GetSlots:
        lease = self.store.lease(entry, consume=not msg.keep, deadline=time.monotonic() + self.config.lease_timeout)
        return p.GetSlots(req=msg.req, token=lease.token, tensors=[s.to_wire() for s in entry.specs],
                          segments=entry.segments(self.config.block_size), meta=entry.meta)

    def _is_remote(self, dest: str | None) -> bool:
        return dest is not None and dest != self.config.node_id

    def _start_producer(self, entry: Entry, dest: str, stream: bool) -> Producer:
        """Push entry to dest as its bytes are written (the Offer goes out right away)."""
        lease = self.store.lease(entry, consume=True, deadline=None, incomplete=True)
        producer = Producer(entry, lease.token, dest, stream=stream, committed=not stream)
        self._producers[entry.token] = producer

        async def run() -> None:
            producer.outbound = await self.exchange.open_push(entry, lease.token, dest, sealed=not stream)
            if producer.dropped is not None:  # deleted while we were connecting
                self.exchange.abort(producer.outbound, producer.dropped)
                raise producer.dropped
            self.exchange.queue(producer.outbound, producer.pending)
            producer.pending = []
            if stream and producer.committed:
                self.exchange.seal(producer.outbound)
            await producer.outbound.done

        def ended(task: asyncio.Task) -> None:
            # forget it once it is over, committed or not (an aborted stream never reaches _finish_push)
            self._producers.pop(entry.token, None)
            error = None if task.cancelled() else task.exception()  # (seen by _finish_push too)
            if error is not None and not producer.committed and not entry.removed:
                # a stream whose push failed before its commit can never be delivered: end it now,
                # so that its writer's next write fails instead of its commit
                self._delete(entry, error if isinstance(error, KvdError) else InternalError(str(error)))

        producer.task = self.daemon.spawn(run(), f"push-{entry.request_id}")
        producer.task.add_done_callback(ended)
        return producer

    def _written(self, entry: Entry, ranges: list[tuple[int, int]], indices: list[int]) -> None:
        """A local producer wrote these tensors: tell stream readers, ship them to the peer."""
        self.on_progress(entry, indices)
        producer = self._producers.get(entry.token)
        if producer is None or not ranges:
            return
        if producer.outbound is None:
            producer.pending.extend(ranges)
        else:
            self.exchange.queue(producer.outbound, ranges)

    async def _finish_push(self, rid: bytes, producer: Producer, msg: p.PutCommit | p.Put) -> p.Message:
        entry = producer.entry
        try:
            await asyncio.wait([producer.task])
            if producer.task.cancelled():
                raise ShuttingDown(f"daemon {self.config.node_id} stopped before {entry.request_id!r} was sent")
            producer.task.result()
            self.exchange.counters["pushes"] += 1
        except BaseException:
            # the caller still has its tensors and gets the error; the local copy goes
            # (its blocks return once the exchange lets go of its lease)
            self.store.remove(entry)
            raise
        finally:
            self._producers.pop(entry.token, None)
        return self._put_ok(rid, msg, entry.total_bytes)

    async def _get_stream(self, rid: bytes, msg: p.GetStream) -> p.Message | None:
        """Lease an entry that may still be arriving; TensorsReady messages follow the slots."""
        if not 0 <= msg.timeout <= MAX_WAIT:
            raise BadRequest(f"timeout must be between 0 and {MAX_WAIT:g} seconds")
        deadline = time.monotonic() + msg.timeout
        pull = None
        if self._is_remote(msg.source) and msg.request_id not in self.store.entries:
            pull = self._start_pull(rid, msg.source, msg.request_id, msg.timeout, msg.keep)
            pull.add_done_callback(lambda _: self._wake(msg.request_id))  # a failed pull ends the wait

        def find() -> Entry | None:
            if pull is not None and pull.done() and not pull.cancelled() and pull.exception() is not None:
                raise pull.exception()
            return self._streamable(msg.request_id)

        entry = await self._wait_for(msg.request_id, deadline, find)
        complete = entry.state is State.READY
        lease = self.store.lease(entry, consume=False, incomplete=True,
                                 deadline=time.monotonic() + self.config.lease_timeout if complete else None)
        self._stream_leases.add(lease.token)
        reader = StreamReader(rid, msg.req, entry, lease.token)
        slots = p.GetSlots(req=msg.req, token=lease.token, tensors=[s.to_wire() for s in entry.specs],
                           segments=entry.segments(self.config.block_size), meta=entry.meta)
        if not self._reply(rid, slots):
            return None  # the reader has gone; its lease went back
        ready = reader.news(entry.complete_tensors())
        if not complete:
            self._readers.setdefault(entry.request_id, []).append(reader)
        return p.TensorsReady(req=msg.req, tensors=ready, complete=complete)

    async def _pull_once(self, rid: bytes, msg: p.Get) -> Entry:
        """Pull request_id from msg.source; concurrent gets of the same id share one pull."""
        pull = self._start_pull(rid, msg.source, msg.request_id, msg.timeout, msg.keep)
        try:
            return await asyncio.shield(pull)
        finally:
            self._pull_readers.get((msg.source, msg.request_id), set()).discard(rid)

    def _leave_pull(self, key: tuple[str, str], rid: bytes) -> None:
        readers = self._pull_readers.get(key)
        if readers is None:
            return
        readers.discard(rid)
        pull = self._pulls.get(key)
        if not readers and pull is not None and not pull.done():
            log.info("nobody waits for %r from %s any more: pull called off", key[1], key[0])
            pull.cancel()

    def _start_pull(self, rid: bytes, source: str, request_id: str, timeout: float, keep: bool) -> asyncio.Future:
        """The pull of request_id from source, started or joined by connection rid's reader."""
        key = (source, request_id)
        pull = self._pulls.get(key)
        if pull is None:
            # the pull's own deadline (timeout + transfer_timeout) bounds it
            pull = asyncio.ensure_future(self.exchange.pull(request_id, source, timeout, keep=keep))
            self._pulls[key] = pull
            pull.add_done_callback(lambda _: self._pulls.pop(key, None))
            pull.add_done_callback(lambda _: self._pull_readers.pop(key, None))
            pull.add_done_callback(lambda f: f.cancelled() or f.exception())  # seen by every waiter
        self._pull_readers.setdefault(key, set()).add(rid)
        return pull

    def _drop_reader(self, lease_token: int) -> None:
        for request_id, readers in list(self._readers.items()):
            kept = [r for r in readers if r.lease_token != lease_token]
            if kept:
                self._readers[request_id] = kept
            else:
                del self._readers[request_id]

    async def _get_later(self, rid: bytes, msg: p.Get) -> p.Message:
        deadline = time.monotonic() + msg.timeout
        if msg.source is not None and msg.source != self.config.node_id:
            entry = self.store.ready(msg.request_id)
            if entry is None and msg.request_id in self.store.entries:
                entry = await self.wait_ready(msg.request_id, deadline)  # already arriving (pushed)
            elif entry is None:
                entry = await self._pull_once(rid, msg)
            if entry.state is not State.READY:  # taken by another reader in the meantime
                entry = await self.wait_ready(msg.request_id, deadline)
        else:
            entry = await self.wait_ready(msg.request_id, deadline)
        return self._lease_for_client(msg, entry)
