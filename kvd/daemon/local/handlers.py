"""Serving local clients (daemon process): put, get, streams, delete, stats, over the local socket.

Handlers that can answer at once do so inside the socket callback; those that wait (for data
to arrive, or on a peer) run as tasks this object owns, so one slow request never holds up
another. Any exception becomes an Error reply carrying its wire code. Who holds what (reservations,
read leases, loans, tier pages) is the ledger's (`ledger.py`): these handlers tell it what happened
and carry out what it answers. Puts are `LocalPuts`' (put_side.py); gets that wait are `Reads`'; a get
from a source is one pull, shared by every get of the same entry (`SharedPulls`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

from kvd.errors import BadRequest, KvdError, NotFound, ShuttingDown
from kvd.wire import protocol as p

from ..lifecycle import Lifecycle
from ..membership import Directory
from ..metrics import Metrics
from ..peer.transfers import Transfers
from ..store.entries import Entry, State, Store, validate_request_id
from . import events as ev
from .get_side import MAX_WAIT, Reads, ReadSettings
from .ledger import LocalLedger
from .put_side import LocalPuts, PutSettings
from .server import LocalServer, Use
from .shared_pulls import SharedPulls
from .watch import EntryWatch, ParkedGet

Route = Callable[[bytes, Any], p.Message | None]  # a client request's handler: (connection, message) -> reply
log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class LocalSettings:
    """What the local handlers are told of the configuration (built from Config by the daemon)."""

    hello: HelloInfo  # the node's facts: its id, the pool's size and blocks
    lease_timeout: float  # a client must finish a put's or get's copy within this (--lease-timeout)
    scratch_max: int  # puts up to this size take one round trip (--scratch-max); 0 = off

    @property
    def node_id(self) -> str:
        return self.hello.node_id

    def puts(self) -> PutSettings:
        return PutSettings(self.node_id, self.hello.block_size, self.lease_timeout, self.scratch_max)

    def reads(self) -> ReadSettings:
        return ReadSettings(self.node_id, self.hello.block_size, self.lease_timeout)


class LocalHandlers:
    def __init__(self, settings: LocalSettings, store: Store, watch: EntryWatch, transfers: Transfers,
                 metrics: Metrics, clients: LocalServer, lifecycle: Lifecycle, *, stats: Callable[[], dict[str, Any]],
                 ledger: LocalLedger, directory: Directory | None = None,
                 tier_routes: Mapping[type[p.Message], Route] | None = None) -> None:
        self.settings = settings
        self.store = store
        self.watch = watch
        self.transfers = transfers
        self.metrics = metrics
        self.clients = clients
        self.lifecycle = lifecycle
        self.stats = stats
        self.ledger = ledger  # who holds what, handoffs and tier pages alike (the tier's service shares it)
        self.pulls = SharedPulls(transfers)
        self.reads = Reads(settings.reads(), store, watch, self.pulls, directory, self._reply)
        self.puts = LocalPuts(settings.puts(), store, watch, transfers, metrics, self.ledger, clients.is_connected,
                              self._reply, self._error)
        self._tasks: set[asyncio.Task[None]] = set()
        self.tier_routes = dict(tier_routes or {})  # the KV tier's requests, to its service (none: no tier)
        self._routes = self.routes()

    async def close(self) -> None:
        self.watch.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- messages in, replies out -------------------------------------------------------------------

    def on_local_message(self, frames: list[bytes]) -> None:
        rid = frames[0]
        try:
            msg = p.decode(frames[1:])
        except KvdError as exc:  # answered with the req the header's first keys give, when they do
            self.metrics.report_undecodable("client", f"client {rid.decode()}", exc, log)
            refusal = self._error(None, exc)
            refusal.req = p.request_number(frames[1]) if len(frames) > 1 else 0
            self._reply(rid, refusal)
            return
        reply: p.Message | None
        try:
            if self.lifecycle.draining and not isinstance(msg, ALLOWED_WHILE_DRAINING):
                raise ShuttingDown(f"daemon {self.settings.node_id} is shutting down")
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
                self.puts.carry(self.ledger.handle(ev.Undelivered(msg.token)))
            return False
        if isinstance(msg, p.GetSlots):
            lease = self.store.lease_of(msg.token)
            assert lease is not None  # (given just now)
            self.ledger.handle(ev.LeaseGiven(rid, msg.token, lease.request_id))
        return self.clients.send(rid, msg)

    def _error(self, msg: p.Message | None, exc: Exception) -> p.Error:
        self.metrics.tally["errors"] += 1
        kind = msg.TYPE if msg is not None else "undecodable"
        if not isinstance(exc, KvdError):
            log.exception("internal error handling %s", kind, exc_info=exc)
        reply = p.error_reply(getattr(msg, "req", 0), exc, self.settings.node_id)
        self.metrics.error(reply.code)
        request_id = getattr(msg, "request_id", None)
        self.metrics.recent_errors.append({  # (bounded: kvd status must stay small whatever a client sent)
            "time": round(time.time(), 3), "request": kind, "code": reply.code, "message": reply.message[:MAX_NOTE],
            "request_id": request_id[:MAX_NOTE] if isinstance(request_id, str) else None})
        return reply

    def _list_page(self, after: str | None, limit: int | None) -> list[dict[str, Any]]:
        """Entries by request id after `after`, at most LIST_PAGE (one reply must fit a header:
        the client library and `kvd ls` ask for the next page until one comes back short)."""
        count = p.LIST_PAGE if limit is None else max(0, min(limit, p.LIST_PAGE))
        ids = sorted(i for i in self.store.entries if after is None or i > after)[:count]
        return [self.store.entries[i].describe() for i in ids]

    def _later(self, rid: bytes, msg: p.Message, coro: Coroutine[Any, Any, p.Message | None],
               waits: bool = False) -> None:
        """Run a handler that waits (on a peer, or for data) without holding up other clients. A
        waiting read (waits=True) ends with its client: nobody is left to answer (a get may wait an
        hour, and a client that hangs up must not leave it behind)."""
        if waits:
            try:
                self.ledger.admit_wait(rid)  # (at most so many per connection)
            except BaseException:
                coro.close()
                raise

        async def run() -> None:
            reply: p.Message | None
            try:
                reply = await coro
            except Exception as exc:
                reply = self._error(msg, exc)
            if waits:
                self._wait_ended(rid, task)  # before the reply: the client's next call sees it ended
            else:
                self.ledger.handle(ev.AnswerOwed(rid, -1))
            if reply is not None:
                self._reply(rid, reply)

        task = asyncio.get_running_loop().create_task(run(), name=f"{msg.TYPE}-{getattr(msg, 'request_id', '')[:64]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if waits:
            self._wait_started(rid, task)
            task.add_done_callback(lambda task: self._wait_ended(rid, task))  # (cancelled: its client left)
        else:
            self.ledger.handle(ev.AnswerOwed(rid))

    def _park(self, rid: bytes, msg: p.Get) -> None:
        """A get that can only wait here waits in the entry watch, without a task."""
        if msg.timeout == 0:
            raise self.watch.not_here(msg.request_id)
        self.ledger.admit_wait(rid)
        self._wait_started(rid, self.watch.park(rid, msg, self._answer_parked))

    def _answer_parked(self, parked: ParkedGet, found: Entry | KvdError) -> None:
        self._wait_ended(parked.rid, parked)
        reply: p.Message
        try:
            if isinstance(found, KvdError):
                raise found
            reply = self.reads.lease_for_client(parked.msg, found)
        except Exception as exc:
            reply = self._error(parked.msg, exc)
        self._reply(parked.rid, reply)

    def uses(self, rid: bytes) -> Use:
        """What the connection holds or waits for (it is not idle then, whatever its silence)."""
        if self.ledger.holds_any(rid):  # (its tier reservations and pins too)
            return Use.HOLDS
        return Use.WAITS if self.ledger.waits_any(rid) else Use.NOTHING

    def _wait_started(self, rid: bytes, wait: asyncio.Task[None] | ParkedGet) -> None:
        self.ledger.handle(ev.WaitStarted(rid, wait))
        self.metrics.waiting_reads = self.ledger.waiting

    def _wait_ended(self, rid: bytes, wait: asyncio.Task[None] | ParkedGet) -> None:
        self.ledger.handle(ev.WaitEnded(rid, wait))
        self.metrics.waiting_reads = self.ledger.waiting

    def routes(self) -> dict[type[p.Message], Route]:
        """Each client request's handler, by type: `_handle` dispatches through this table. The KV
        tier's requests go to its service (`tier_routes`) when the daemon has a tier (without one,
        they are not client requests here)."""
        routes: dict[type[p.Message], Route] = {
            p.Hello: self._hello, p.PutAlloc: self.puts.alloc, p.PutPart: self.puts.part,
            p.PutCommit: self.puts.commit, p.Put: self.puts.in_scratch, p.GetStream: self._get_stream,
            p.Get: self._get, p.GetDone: self._get_done, p.Delete: self._delete, p.Stats: self._stats,
            p.ClusterNodes: self._cluster_nodes, p.ClusterLocate: self._cluster_locate,
            p.ListEntries: self._list_entries}
        routes.update(self.tier_routes)
        return routes

    def _handle(self, rid: bytes, msg: p.Message) -> p.Message | None:
        handler = self._routes.get(type(msg))
        if handler is None:
            raise BadRequest(f"{msg.TYPE} is not a client request")
        return handler(rid, msg)

    def _hello(self, rid: bytes, msg: p.Hello) -> p.HelloOk:
        h = self.settings.hello
        return p.HelloOk(req=msg.req, node_id=h.node_id, incarnation=h.incarnation, pool_path=h.pool_path,
                         pool_size=h.pool_size, block_size=h.block_size, device=h.device, pool_handle=h.pool_handle)

    def _delete(self, rid: bytes, msg: p.Delete) -> p.Ok:
        if msg.token is not None:  # a writer gives up its own reservation
            return self.puts.abort(rid, msg, msg.token)
        entry = self.store.entries.get(msg.request_id)
        if entry is None:
            return p.Ok(req=msg.req, value=False)
        self.puts.remove(entry, NotFound(f"request {msg.request_id!r} was deleted on {self.settings.node_id}"))
        return p.Ok(req=msg.req, value=True)

    def _stats(self, rid: bytes, msg: p.Stats) -> p.Ok:
        return p.Ok(req=msg.req, value=self.stats())

    def _cluster_nodes(self, rid: bytes, msg: p.ClusterNodes) -> p.Ok:
        return p.Ok(req=msg.req, value=self.reads.directory().nodes())

    def _cluster_locate(self, rid: bytes, msg: p.ClusterLocate) -> None:
        self._later(rid, msg, self.reads.locate(msg))

    def _list_entries(self, rid: bytes, msg: p.ListEntries) -> p.Ok:
        return p.Ok(req=msg.req, value=self._list_page(msg.after, msg.limit))

    def on_client_gone(self, rid: bytes) -> None:
        """A client hung up: its unfinished puts are dropped and its reads given back now, as
        they would be at lease expiry; blocks parked for it are free at last."""
        self.pulls.leave_all(rid)
        actions = self.ledger.handle(ev.ConnectionLost(rid))  # its waits, handoffs, reads, loans, tier pages
        if actions and isinstance(off := actions[0], ev.CallOff):  # every one of its waits, now, unanswered
            actions.pop(0)
            self.metrics.waiting_reads = self.ledger.waiting
            for wait in off.waits:
                if isinstance(wait, ParkedGet):
                    self.watch.unpark(wait)
                elif isinstance(wait, asyncio.Task):
                    wait.cancel()
        if actions and isinstance(gave := actions[-1], ev.GaveBack):
            actions.pop()
            log.warning("a client disconnected with %d unfinished put(s) and %d open read(s); giving them back",
                        gave.writes, gave.reads)
        self.puts.carry(actions)

    # --- gets ---------------------------------------------------------------------------------------------

    def _get(self, rid: bytes, msg: p.Get) -> p.GetSlots | None:
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

    def _get_stream(self, rid: bytes, msg: p.GetStream) -> None:
        self._later(rid, msg, self.reads.get_stream(rid, msg), waits=True)

    def _get_done(self, rid: bytes, msg: p.GetDone) -> p.Ok | None:
        (released,) = self.ledger.handle(ev.Release(rid, msg.token, msg.consume))
        assert isinstance(released, ev.Released)
        entry, lease, claiming = released.entry, released.lease, released.claiming
        if claiming and msg.consume:
            assert lease is not None  # (a lease that still claims its entry was there)
            self.metrics.duration.labels("local_get").observe(time.monotonic() - lease.started)
            self.metrics.local_bytes.labels("out").inc(entry.total_bytes)
        if msg.token in self.watch.stream_leases:
            self.watch.drop_reader(msg.token)
            if msg.consume and entry.state is State.WRITING:  # read before its writer committed: end the
                # write as a delete would (its writer is told, its blocks go when it lets go of them)
                self.puts.remove(entry, NotFound(f"request {entry.request_id!r} was consumed by a stream reader "
                                                 "before its writer committed"))
            elif msg.consume:
                self.store.remove(entry)
        if claiming and not msg.consume and entry is not None and not entry.removed:
            self.watch.wake(entry.request_id)  # a claim given back: the next reader may have it now
        self.metrics.tally["gets"] += 1
        return p.Ok(req=msg.req) if msg.reply else None
