"""Who waits on which entry (daemon process): gets waiting for an entry to arrive, pulls served
once it does, and get_stream readers told which tensors are complete as they land.

Both the local request handlers and the peer transfers use it, so it sits below both: the
transfers tell it what happens to arriving entries (`on_progress`, `on_published`,
`on_dropped`, the `EntryEvents` of `peer/transfers.py`), the handlers tell it about local
writes, and either may wait on it (`wait_ready`, `wait_for`). It answers stream readers
through the local server; it never touches pool bytes.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

from kvd.errors import KvdError, NotFound, Timeout
from kvd.wire import protocol as p

from .local_server import LocalServer
from .store.entries import Entry, Lease, State, Store


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
        self._waiters: dict[str, list[asyncio.Future]] = {}  # request id -> woken on any change
        self._readers: dict[str, list[StreamReader]] = {}  # request id -> get_stream clients
        self.stream_leases: set[int] = set()  # read leases held by get_stream readers

    # --- waiting for an entry ------------------------------------------------------------------

    def wake(self, request_id: str) -> None:
        for waiter in self._waiters.pop(request_id, []):
            if not waiter.done():
                waiter.set_result(None)

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
                raise NotFound(f"request {request_id!r} not found on {self.node_id}")
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
        readers = [r for r in self._readers.pop(entry.request_id, []) if r.entry is entry]
        for reader in readers:
            fresh = reader.news(list(range(len(entry.specs))))
            self.clients.send(reader.rid, p.TensorsReady(req=reader.req, tensors=fresh, complete=True))
            self.store.set_lease_deadline(reader.lease_token, time.monotonic() + self.lease_timeout)
        self.wake(entry.request_id)

    def on_dropped(self, entry: Entry, error: KvdError) -> None:
        """An entry failed before completion: its stream readers get the error, their leases go."""
        for reader in [r for r in self._readers.pop(entry.request_id, []) if r.entry is entry]:
            self.clients.send(reader.rid, p.error_reply(reader.req, error, self.node_id))
            self.stream_leases.discard(reader.lease_token)
            try:
                self.store.release(reader.lease_token, success=False)
            except NotFound:
                pass

    def lease_expired(self, lease: Lease) -> None:
        """A read lease ran out (or its client hung up): the entry is back, wake its waiters."""
        self.stream_leases.discard(lease.token)
        self.wake(lease.request_id)
