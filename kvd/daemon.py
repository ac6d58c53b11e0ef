"""The kvd daemon: owns the pool, serves local clients, and runs the peer exchange.

One asyncio loop (uvloop). Local clients talk to a ROUTER on `--socket` (ipc://) with
control messages only: the bytes themselves go through the shared pool, copied by the
client. Peer traffic is `kvd.exchange`'s. A handler's failure becomes an Error reply to
that client; nothing a client or peer sends can stop the loop.
"""
from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import time

import zmq

from . import protocol as p
from .config import Config
from .device import open_staging_memory
from .errors import BadRequest, KvdError, NotFound, ShuttingDown, Timeout
from .exchange import Exchange
from .layout import TensorSpec
from .pool import BlockAllocator
from .store import Entry, State, Store
from .streams import Producer, StreamReader
from .units import format_size
from .zsock import LoopSocket

log = logging.getLogger(__name__)

HOUSEKEEPING_INTERVAL = 0.2  # seconds between expiry/deadline sweeps
MAX_WAIT = 3600.0  # longest get timeout we accept


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.incarnation = random.getrandbits(63)  # new on every start: tells peers we restarted
        self.memory = None
        self.store: Store | None = None
        self.exchange: Exchange | None = None
        self.ctx: zmq.Context | None = None
        self.local: LoopSocket | None = None
        self._waiters: dict[str, list[asyncio.Future]] = {}  # request id -> woken on any change
        self._producers: dict[int, Producer] = {}  # entry token -> push in progress
        self._readers: dict[str, list[StreamReader]] = {}  # request id -> get_stream clients
        self._stream_leases: set[int] = set()
        self._tasks: set[asyncio.Task] = set()
        self._stopping = asyncio.Event()
        self.started_at = time.time()
        self.ready = False
        self.counters = {"puts": 0, "gets": 0, "errors": 0}

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        self.memory = open_staging_memory(cfg.device, cfg.pool_size, cfg.pool_path, cfg.pool_prefault)
        num_blocks = cfg.pool_size // cfg.block_size
        self.store = Store(BlockAllocator(num_blocks), cfg.block_size, cfg.default_ttl or None)
        self.ctx = zmq.Context()
        local = self.ctx.socket(zmq.ROUTER)
        local.setsockopt(zmq.LINGER, 0)
        self._bind_local(local, cfg.socket)
        self.exchange = Exchange(cfg, self.store, self.memory.host_view(), self.ctx, self.incarnation,
                                 self.wait_ready, self._on_progress, self._on_published, self._on_dropped)
        await self.exchange.start()
        self.local = LoopSocket(local, self._on_local_message)
        self._spawn(self._housekeeping(), "housekeeping")
        self.ready = True
        log.info("kvd %s ready: pool %s on %s (%d blocks of %s), clients on %s, peers on %s, %d peer(s) configured",
                 cfg.node_id, format_size(cfg.pool_size), cfg.device, num_blocks, format_size(cfg.block_size),
                 cfg.socket, self.exchange.bound_endpoint, len(cfg.peers))

    @staticmethod
    def _bind_local(sock: zmq.Socket, endpoint: str) -> None:
        if endpoint.startswith("ipc://"):
            path = endpoint[len("ipc://"):]
            directory = os.path.dirname(path) or "."
            os.makedirs(directory, mode=0o700, exist_ok=True)
            if os.path.exists(path):
                if _socket_in_use(path):
                    raise BadRequest(f"{endpoint} is in use by another daemon")
                os.unlink(path)  # stale socket of a daemon that did not exit cleanly
            old_umask = os.umask(0o177)  # socket file 0600: only our user may connect
            try:
                sock.bind(endpoint)
            finally:
                os.umask(old_umask)
        else:
            sock.bind(endpoint)

    def request_stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        await self.start()
        await self._stopping.wait()
        await self.stop()

    async def stop(self) -> None:
        log.info("kvd %s shutting down", self.config.node_id)
        self.ready = False
        if self.exchange is not None:
            await self.exchange.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.local is not None:
            self.local.close()
            if self.config.socket.startswith("ipc://"):
                try:
                    os.unlink(self.config.socket[len("ipc://"):])
                except FileNotFoundError:
                    pass
        if self.ctx is not None:
            self.ctx.term()
        self.exchange = None
        if self.memory is not None:
            self.memory.close()
        log.info("kvd %s stopped", self.config.node_id)

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL)
            now = time.monotonic()
            expired, abandoned, stale = self.store.sweep(now)
            for entry in expired:
                log.info("expired %s (ttl)", entry.request_id)
            for entry in abandoned:
                log.warning("dropped %s: its writer did not finish within the lease", entry.request_id)
                self._on_dropped(entry, Timeout(f"the writer of {entry.request_id!r} did not finish in time"))
            for lease in stale:
                self._stream_leases.discard(lease.token)
                log.warning("read lease on %s expired; entry given back", lease.request_id)
            self.exchange.check_deadlines(now)

    # --- waiting for entries -----------------------------------------------------------------------

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

    def _on_progress(self, entry: Entry, indices: list[int]) -> None:
        """Tensors of an entry still being written or received are complete."""
        if entry.state is State.RECEIVING and entry.request_id not in self._readers:
            self._wake(entry.request_id)  # a get_stream may be waiting for the entry to exist
        for reader in self._readers.get(entry.request_id, []):
            if reader.entry is entry:
                fresh = reader.news(indices)
                if fresh:
                    self._reply(reader.rid, p.TensorsReady(req=reader.req, tensors=fresh))

    def _on_published(self, entry: Entry) -> None:
        readers = [r for r in self._readers.pop(entry.request_id, []) if r.entry is entry]
        for reader in readers:
            fresh = reader.news(list(range(len(entry.specs))))
            self._reply(reader.rid, p.TensorsReady(req=reader.req, tensors=fresh, complete=True))
            self.store.set_lease_deadline(reader.lease_token, time.monotonic() + self.config.lease_timeout)
        self._wake(entry.request_id)

    def _on_dropped(self, entry: Entry, error: KvdError) -> None:
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

    # --- local clients -------------------------------------------------------------------------------

    def _on_local_message(self, frames: list) -> None:
        rid = frames[0]
        try:
            msg = p.decode(frames[1:])
        except KvdError as exc:
            self.counters["errors"] += 1
            log.warning("undecodable client message: %s", exc)
            self._reply(rid, p.error_reply(0, exc, self.config.node_id))
            return
        try:
            if self._stopping.is_set() and not isinstance(msg, (p.GetDone, p.Stats, p.Hello)):
                raise ShuttingDown(f"daemon {self.config.node_id} is shutting down")
            reply = self._handle_now(rid, msg)
        except Exception as exc:
            reply = self._error(msg, exc)
        if reply is not None:
            self._reply(rid, reply)

    def _reply(self, rid: bytes, msg: p.Message) -> None:
        self.local.send_now([rid, *p.encode(msg)])

    def _error(self, msg: p.Message, exc: Exception) -> p.Error:
        self.counters["errors"] += 1
        if not isinstance(exc, KvdError):
            log.exception("internal error handling %s", msg.TYPE, exc_info=exc)
        return p.error_reply(getattr(msg, "req", 0), exc, self.config.node_id)

    def _later(self, rid: bytes, msg: p.Message, coro) -> None:
        """Run a handler that waits (on a peer, or for data) without holding up other clients."""
        async def run() -> None:
            try:
                reply = await coro
            except Exception as exc:
                reply = self._error(msg, exc)
            self._reply(rid, reply)

        self._spawn(run(), f"{msg.TYPE}-{getattr(msg, 'request_id', '')}")

    def _handle_now(self, rid: bytes, msg: p.Message) -> p.Message | None:
        cfg = self.config
        match msg:
            case p.Hello():
                return p.HelloOk(req=msg.req, node_id=cfg.node_id, incarnation=self.incarnation,
                                 pool_path=self.memory.client_path, pool_size=cfg.pool_size,
                                 block_size=cfg.block_size, device=cfg.device)
            case p.PutAlloc():
                specs = [TensorSpec.from_wire(t) for t in msg.tensors]
                entry = self.store.reserve(msg.request_id, specs, msg.ttl, msg.meta, State.WRITING,
                                           time.monotonic() + cfg.lease_timeout)
                if msg.stream:
                    self._wake(entry.request_id)  # get_stream readers may start now
                    if self._is_remote(msg.dest):
                        self._start_producer(entry, msg.dest)
                return p.PutSlots(req=msg.req, token=entry.token, segments=entry.segments(cfg.block_size))
            case p.PutPart():
                entry = self.store.writing_entry(msg.request_id, msg.token, State.WRITING)
                self._written(entry, entry.mark_tensors(msg.tensors), msg.tensors)
                return None
            case p.PutCommit():
                producer = self._producers.get(msg.token)
                if producer is not None and producer.entry.request_id == msg.request_id and producer.entry.removed:
                    # every tensor was written and the peer already has them all: just report
                    self._later(rid, msg, self._finish_push(producer, msg))
                    return None
                entry = self.store.writing_entry(msg.request_id, msg.token, State.WRITING)
                rest = [i for i, left in enumerate(entry.remaining) if left]
                if producer is None and self._is_remote(msg.dest):
                    producer = self._start_producer(entry, msg.dest)
                self._written(entry, entry.mark_tensors(rest), rest)
                self.store.publish(entry)
                self.counters["puts"] += 1
                if producer is None:
                    self._on_published(entry)
                    return p.Ok(req=msg.req)
                self._later(rid, msg, self._finish_push(producer, msg))
                return None
            case p.GetStream():
                self._later(rid, msg, self._get_stream(rid, msg))
                return None
            case p.Get():
                if not 0 <= msg.timeout <= MAX_WAIT:
                    raise BadRequest(f"timeout must be between 0 and {MAX_WAIT:g} seconds")
                entry = self.store.ready(msg.request_id)
                if entry is not None:
                    return self._lease_for_client(msg, entry)
                self._later(rid, msg, self._get_later(msg))
                return None
            case p.GetDone():
                entry = self.store.release(msg.token, success=msg.consume)
                if msg.token in self._stream_leases:
                    self._stream_leases.discard(msg.token)
                    self._drop_reader(msg.token)
                    if msg.consume:
                        self.store.remove(entry)
                self.counters["gets"] += 1
                return p.Ok(req=msg.req) if msg.reply else None
            case p.Delete():
                entry = self.store.entries.get(msg.request_id)
                if entry is None:
                    return p.Ok(req=msg.req, value=False)
                self.store.remove(entry)
                if entry.state in (State.WRITING, State.RECEIVING):
                    self._on_dropped(entry, NotFound(f"request {msg.request_id!r} was deleted"))
                return p.Ok(req=msg.req, value=True)
            case p.Stats():
                return p.Ok(req=msg.req, value=self.stats())
            case p.ListEntries():
                return p.Ok(req=msg.req, value=[e.describe() for e in self.store.entries.values()])
            case _:
                raise BadRequest(f"{msg.TYPE} is not a client request")

    def _lease_for_client(self, msg: p.Get, entry: Entry) -> p.GetSlots:
        lease = self.store.lease(entry, consume=not msg.keep, deadline=time.monotonic() + self.config.lease_timeout)
        return p.GetSlots(req=msg.req, token=lease.token, tensors=[s.to_wire() for s in entry.specs],
                          segments=entry.segments(self.config.block_size), meta=entry.meta)

    def _is_remote(self, dest: str | None) -> bool:
        return dest is not None and dest != self.config.node_id

    def _start_producer(self, entry: Entry, dest: str) -> Producer:
        """Push entry to dest as its bytes are written (the Offer goes out right away)."""
        lease = self.store.lease(entry, consume=True, deadline=None, incomplete=True)
        producer = Producer(entry, lease.token, dest)
        self._producers[entry.token] = producer

        async def run() -> None:
            producer.outbound = await self.exchange.open_push(entry, lease.token, dest)
            self.exchange.queue(producer.outbound, producer.pending)
            producer.pending = []
            await producer.outbound.done

        producer.task = self._spawn(run(), f"push-{entry.request_id}")
        producer.task.add_done_callback(lambda t: t.cancelled() or t.exception())  # seen by _finish_push
        return producer

    def _written(self, entry: Entry, ranges: list[tuple[int, int]], indices: list[int]) -> None:
        """A local producer wrote these tensors: tell stream readers, ship them to the peer."""
        self._on_progress(entry, indices)
        producer = self._producers.get(entry.token)
        if producer is None or not ranges:
            return
        if producer.outbound is None:
            producer.pending.extend(ranges)
        else:
            self.exchange.queue(producer.outbound, ranges)

    async def _finish_push(self, producer: Producer, msg: p.PutCommit) -> p.Message:
        entry = producer.entry
        try:
            await producer.task
            self.exchange.counters["pushes"] += 1
        except BaseException:
            # the caller still has its tensors and gets the error; the local copy goes
            # (its blocks return once the exchange lets go of its lease)
            self.store.remove(entry)
            raise
        finally:
            self._producers.pop(entry.token, None)
        return p.Ok(req=msg.req)

    async def _get_stream(self, rid: bytes, msg: p.GetStream) -> p.Message:
        """Lease an entry that may still be arriving; TensorsReady messages follow the slots."""
        if not 0 <= msg.timeout <= MAX_WAIT:
            raise BadRequest(f"timeout must be between 0 and {MAX_WAIT:g} seconds")
        deadline = time.monotonic() + msg.timeout
        entry = await self._wait_for(msg.request_id, deadline, lambda: self._streamable(msg.request_id))
        complete = entry.state is State.READY
        lease = self.store.lease(entry, consume=False, incomplete=True,
                                 deadline=time.monotonic() + self.config.lease_timeout if complete else None)
        self._stream_leases.add(lease.token)
        reader = StreamReader(rid, msg.req, entry, lease.token)
        slots = p.GetSlots(req=msg.req, token=lease.token, tensors=[s.to_wire() for s in entry.specs],
                           segments=entry.segments(self.config.block_size), meta=entry.meta)
        self._reply(rid, slots)
        ready = reader.news(entry.complete_tensors())
        if not complete:
            self._readers.setdefault(entry.request_id, []).append(reader)
        return p.TensorsReady(req=msg.req, tensors=ready, complete=complete)

    def _drop_reader(self, lease_token: int) -> None:
        for request_id, readers in list(self._readers.items()):
            kept = [r for r in readers if r.lease_token != lease_token]
            if kept:
                self._readers[request_id] = kept
            else:
                del self._readers[request_id]

    async def _get_later(self, msg: p.Get) -> p.Message:
        deadline = time.monotonic() + msg.timeout
        if msg.source is not None and msg.source != self.config.node_id:
            entry = self.store.ready(msg.request_id)
            if entry is None:
                # the pull's own deadline (timeout + transfer_timeout) bounds this wait
                entry = await self.exchange.pull(msg.request_id, msg.source, msg.timeout, keep=False)
            if entry.state is not State.READY:  # taken by another reader in the meantime
                entry = await self.wait_ready(msg.request_id, deadline)
        else:
            entry = await self.wait_ready(msg.request_id, deadline)
        return self._lease_for_client(msg, entry)

    def stats(self) -> dict:
        cfg, store = self.config, self.store
        return {
            "node_id": cfg.node_id,
            "incarnation": self.incarnation,
            "device": cfg.device,
            "uptime_s": round(time.time() - self.started_at, 3),
            "pool": {
                "capacity_bytes": store.allocator.num_blocks * cfg.block_size,
                "used_bytes": store.used_bytes,
                "block_size": cfg.block_size,
                "free_blocks": store.allocator.free_blocks,
                "largest_free_extent_blocks": store.allocator.largest_free_extent(),
            },
            "entries": len(store.entries),
            "entries_by_state": store.counts(),
            "expired_total": store.expired_total,
            "transfers_in_flight": len(self.exchange.transfers),
            "peers": self.exchange.peer_states(),
            "counters": {**self.counters, **self.exchange.counters},
            "listen": self.exchange.bound_endpoint,
        }


def _socket_in_use(path: str) -> bool:
    """True if something accepts connections on this unix socket path."""
    import socket as pysocket

    probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()
