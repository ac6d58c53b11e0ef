"""Who waits on which entry (daemon process): gets waiting for an entry to arrive, pulls served
once it does, and get_stream readers told which tensors are complete as they land.

A get that can only wait here (for an entry to be put or to arrive) is parked: a record and a timer,
no task, answered from a turn of the loop after its entry changes, so that what a client's waits
hold is small, and a client that hangs up takes them along at once (`unpark`).

Both the local request handlers and the peer transfers use it, so it sits below both: the
transfers tell it what happens to arriving entries (`on_progress`, `on_published`,
`on_dropped`, the `EntryEvents` of `peer/transfers.py`), the handlers tell it about local
writes, and either may wait on it (`wait_ready`, `wait_for`). It answers stream readers
through the local server; it never touches pool bytes.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvd.errors import KvdError, NotFound, Timeout
from kvd.wire import protocol as p

from ..store.entries import Entry, Lease, State, Store
from .server import LocalServer

# entries sent away lately (pushed, or pulled without keep), or whose push failed, are remembered by
# request id, so that a get_stream here that comes for one after it left is told where it went (or
# that it is gone), not left waiting
DEPARTURES_KEPT = 4096
DEPARTURE_MEMORY = 300.0  # seconds


@dataclass(eq=False, slots=True)
class ParkedGet:
    """A local get waiting for its entry to be ready here; `answer(parked, entry or error)` is
    called once, unless it is unparked first (its client hung up)."""

    rid: bytes  # the client's connection on the local socket
    msg: p.Get
    answer: Callable[[ParkedGet, Entry | KvdError], None]
    timer: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class StreamReader:
    """A local get_stream client, told which tensors of an entry are complete as they are."""

    rid: bytes  # the client's connection on the local socket
    req: int
    entry: Entry
    lease_token: int
    announced: set[int] = field(default_factory=set)

    def news(self, indices: list[int]) -> list[int]:
        """Indices not yet announced to this reader; records them as announced."""
        fresh = [i for i in indices if i not in self.announced]
        self.announced.update(fresh)
        return fresh


class EntryWatch:
    def __init__(self, store: Store, clients: LocalServer, node_id: str, lease_timeout: float) -> None:
        self.store = store
        self.clients = clients
        self.node_id = node_id
        self.lease_timeout = lease_timeout
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}  # request id -> woken on any change
        self._readers: dict[str, list[StreamReader]] = {}  # request id -> get_stream clients
        self.stream_leases: set[int] = set()  # read leases held by get_stream readers
        self._parked: dict[str, dict[ParkedGet, None]] = {}  # request id -> its parked gets, oldest first
        self._retrying: set[str] = set()  # request ids whose parked gets are retried in the next turn
        self._departed: dict[str, tuple[str, float]] = {}  # request id -> (how it left, when), oldest first

    # --- waiting for an entry ------------------------------------------------------------------

    def wake(self, request_id: str) -> None:
        for waiter in self._waiters.pop(request_id, []):
            if not waiter.done():
                waiter.set_result(None)
        if request_id in self._parked and request_id not in self._retrying:
            self._retrying.add(request_id)  # (in a turn of its own, as a waiting task would be)
            asyncio.get_running_loop().call_soon(self._retry_parked, request_id)

    def not_here(self, request_id: str) -> NotFound:
        return NotFound(f"request {request_id!r} not found on {self.node_id}")

    def park(self, rid: bytes, msg: p.Get, answer: Callable[[ParkedGet, Entry | KvdError], None]) -> ParkedGet:
        """Wait for msg's entry to be READY here, for msg.timeout seconds (more than 0); answer(parked,
        entry) as it is, answer(parked, Timeout) after that."""
        parked = ParkedGet(rid, msg, answer)
        parked.timer = asyncio.get_running_loop().call_later(msg.timeout, self._expire, parked)
        self._parked.setdefault(msg.request_id, {})[parked] = None
        return parked

    def unpark(self, parked: ParkedGet) -> None:
        """Forget a parked get (its client hung up, or it is being answered): it is never answered."""
        if parked.timer is not None:
            parked.timer.cancel()
            parked.timer = None
        waiting = self._parked.get(parked.msg.request_id)
        if waiting is not None:
            waiting.pop(parked, None)
            if not waiting:
                del self._parked[parked.msg.request_id]

    def _retry_parked(self, request_id: str) -> None:
        """Hand a ready entry to its parked gets, oldest first, while it is READY (a keep=True get
        leaves it so; a consuming one claims it, and the rest wait on)."""
        self._retrying.discard(request_id)
        waiting = self._parked.get(request_id)
        while waiting:
            entry = self.store.ready(request_id)
            if entry is None:
                return
            parked = next(iter(waiting))
            self.unpark(parked)
            parked.answer(parked, entry)

    def _expire(self, parked: ParkedGet) -> None:
        parked.timer = None
        request_id = parked.msg.request_id
        entry = self.store.ready(request_id)  # (one last look)
        self.unpark(parked)
        parked.answer(parked, entry if entry is not None else
                      Timeout(f"request {request_id!r} did not arrive within the timeout"))

    def close(self) -> None:
        """Shutting down: parked gets are dropped unanswered (as waiting tasks are cancelled)."""
        for waiting in list(self._parked.values()):
            for parked in list(waiting):
                self.unpark(parked)

    async def wait_for(self, request_id: str, deadline: float, find: Callable[[], Entry | None]) -> Entry:
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
                raise self.not_here(request_id)
            waited = True
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(request_id, []).append(waiter)
            try:
                await asyncio.wait_for(waiter, remaining)
            except TimeoutError:
                pass
            finally:
                waiters = self._waiters.get(request_id)
                if waiters and waiter in waiters:
                    waiters.remove(waiter)
                    if not waiters:
                        del self._waiters[request_id]

    async def wait_ready(self, request_id: str, deadline: float) -> Entry:
        """The READY entry for request_id, waiting for it to arrive until deadline."""
        return await self.wait_for(request_id, deadline, lambda: self.store.ready(request_id))

    async def wait_pullable(self, request_id: str, deadline: float) -> Entry:
        """An entry a peer's pull may be served from: complete, or a local put still being written
        (the pull follows it), waiting for one until deadline."""
        def find() -> Entry | None:
            entry = self.store.entries.get(request_id)
            if entry is None:
                return None
            if entry.state is State.READY or (entry.state is State.WRITING and not self.store.claimed(entry)):
                return entry  # (a put being written that a push already owns is not ours to give away)
            return None

        return await self.wait_for(request_id, deadline, find)

    def streamable(self, request_id: str) -> Entry | None:
        """An entry a get_stream may lease: complete, or still being written or received."""
        entry = self.store.entries.get(request_id)
        return entry if entry is not None and entry.state is not State.CLAIMED else None

    # --- stream readers ---------------------------------------------------------------------------

    def add_reader(self, reader: StreamReader) -> None:
        self._readers.setdefault(reader.entry.request_id, []).append(reader)

    def drop_reader(self, lease_token: int) -> None:
        self.stream_leases.discard(lease_token)
        for request_id, readers in list(self._readers.items()):
            kept = [r for r in readers if r.lease_token != lease_token]
            if kept:
                self._readers[request_id] = kept
            else:
                del self._readers[request_id]

    # --- what happens to entries (EntryEvents) ----------------------------------------------------

    def on_progress(self, entry: Entry, indices: list[int]) -> None:
        """Tensors of an entry still being written or received are complete."""
        if entry.state is State.RECEIVING and entry.request_id not in self._readers:
            self.wake(entry.request_id)  # a get_stream may be waiting for the entry to exist
        for reader in self._readers.get(entry.request_id, []):
            if reader.entry is entry:
                fresh = reader.news(indices)
                if fresh:
                    self.clients.send(reader.rid, p.TensorsReady(req=reader.req, tensors=fresh))

    def on_published(self, entry: Entry) -> None:
        """Every byte is in: stream readers finish (their leases now run out like any read), waiters wake."""
        self._departed.pop(entry.request_id, None)  # (a newer entry of that id is here)
        readers = [r for r in self._readers.pop(entry.request_id, []) if r.entry is entry]
        for reader in readers:
            fresh = reader.news(list(range(len(entry.specs))))
            self.clients.send(reader.rid, p.TensorsReady(req=reader.req, tensors=fresh, complete=True))
            self.store.set_lease_deadline(reader.lease_token, time.monotonic() + self.lease_timeout)
        self.wake(entry.request_id)

    def on_dropped(self, entry: Entry, error: KvdError) -> None:
        """An entry failed before completion: its stream readers get the error, their leases go."""
        self._fail_readers(entry, error)
        self.wake(entry.request_id)  # (a reader still waiting for the entry to appear looks again)

    def _fail_readers(self, entry: Entry, error: KvdError) -> None:
        for reader in [r for r in self._readers.pop(entry.request_id, []) if r.entry is entry]:
            self.clients.send(reader.rid, p.error_reply(reader.req, error, self.node_id))
            self.stream_leases.discard(reader.lease_token)
            with contextlib.suppress(NotFound):  # (released already)
                self.store.release(reader.lease_token, success=False)

    def on_departed(self, entry: Entry, peer: str, pushed: bool) -> None:
        """A transfer took the entry to peer and it is gone from here: stream readers still waiting
        for it are told (`departed`)."""
        how = "was pushed to" if pushed else "was pulled by"
        self._remember(entry.request_id, f"{how} {peer} and is no longer on {self.node_id}: read it on {peer}")

    def on_push_failed(self, entry: Entry, peer: str, error: KvdError) -> None:
        """A push of the entry to peer failed: the put that made it fails with it, and the entry is
        dropped here. A stream reader waiting for it, or that comes for it (it may have come after
        the push was refused: before the first write), is told so, not left waiting for its timeout."""
        how = f"was being pushed to {peer} and the push failed ({error.message}): it is not on {self.node_id}"
        self._fail_readers(entry, NotFound(f"request {entry.request_id!r} {how}"))  # (those following it)
        self._remember(entry.request_id, how)

    def _remember(self, request_id: str, how: str) -> None:
        self._departed.pop(request_id, None)
        self._departed[request_id] = (how, time.monotonic())
        if len(self._departed) > DEPARTURES_KEPT:
            del self._departed[next(iter(self._departed))]
        self.wake(request_id)

    def on_returned(self, entry: Entry) -> None:
        """A failed push or pull gave its claim back: whoever waits for the entry may have it now."""
        self.wake(entry.request_id)

    def departed(self, request_id: str) -> str | None:
        """How an entry of request_id left for a peer lately ("was pushed to B and ..."), if it did
        and none came since."""
        found = self._departed.get(request_id)
        if found is not None and time.monotonic() - found[1] > DEPARTURE_MEMORY:
            del self._departed[request_id]
            found = None
        return found[0] if found is not None else None

    def lease_expired(self, lease: Lease) -> None:
        """A read lease ran out (or its client hung up): the entry is back, wake its waiters."""
        self.stream_leases.discard(lease.token)
        self.wake(lease.request_id)
