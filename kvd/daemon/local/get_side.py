"""Reads that wait (daemon process): a get for an entry not here yet (arriving, held by a peer,
or somewhere in the cluster) and a get_stream that follows an entry as it is written. The
handlers run these as tasks; each resolves to the reply (or the first reply: a stream's
TensorsReady follow through the entry watch). A get that can only wait here is parked in the
entry watch instead (no task). The ledger (`ledger.py`) counts each connection's waits, and bounds them."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeGuard

from kvd.errors import BadRequest, NotFound, Timeout
from kvd.wire import protocol as p

from ..membership import Directory
from ..store.entries import Entry, State, Store
from .books import MAX_WAITS_PER_CONNECTION as MAX_WAITS_PER_CONNECTION
from .shared_pulls import HolderSearch, SharedPulls
from .watch import EntryWatch, StreamReader

MAX_WAIT = 3600.0  # longest get timeout we accept


@dataclass(frozen=True)
class ReadSettings:
    node_id: str
    block_size: int
    lease_timeout: float  # a client must finish a get's copy within this (--lease-timeout)


class Reads:
    def __init__(self, settings: ReadSettings, store: Store, watch: EntryWatch, pulls: SharedPulls,
                 directory: Directory | None, reply: Callable[[bytes, p.Message], bool]) -> None:
        self.settings = settings
        self.store = store
        self.watch = watch
        self.pulls = pulls
        self._directory = directory  # the cluster registry's holder directory, with --registry
        self._reply = reply

    def _is_remote(self, peer: str | None) -> TypeGuard[str]:
        """Whether peer names another node (so it is not None)."""
        return peer is not None and peer != self.settings.node_id

    def lease_for_client(self, msg: p.Get, entry: Entry) -> p.GetSlots:
        lease = self.store.lease(entry, consume=not msg.keep, deadline=time.monotonic() + self.settings.lease_timeout)
        return p.GetSlots(req=msg.req, token=lease.token, tensors=[s.to_wire() for s in entry.specs],
                          segments=entry.segments(self.settings.block_size), meta=entry.meta)

    def waits_here(self, msg: p.Get) -> bool:
        """A get that can only wait for its entry here: no source to pull from, no registry to
        search (or the entry is here already, being written or read): `get` would only wait_ready."""
        return not self._is_remote(msg.source) and (self._directory is None or msg.request_id in self.store.entries)

    async def get(self, rid: bytes, msg: p.Get) -> p.Message:
        deadline = time.monotonic() + msg.timeout
        if self._is_remote(msg.source):
            entry = self.store.ready(msg.request_id)
            if entry is None and msg.request_id in self.store.entries:
                entry = await self.watch.wait_ready(msg.request_id, deadline)  # already arriving (pushed)
            elif entry is None:
                # (the get's timeout bounds the link's handshake too: a down source costs no more)
                entry = await self.pulls.join(rid, msg.source, msg.request_id, msg.timeout, msg.keep,
                                              connect_within=msg.timeout)
            if entry.state is not State.READY:  # taken by another reader in the meantime
                entry = await self.watch.wait_ready(msg.request_id, deadline)
        elif self._directory is not None and msg.request_id not in self.store.entries:
            entry = await self.pulls.anywhere(rid, self.watch, self._directory, msg.request_id, msg.keep, deadline)
        else:
            entry = await self.watch.wait_ready(msg.request_id, deadline)
        return self.lease_for_client(msg, entry)

    def _check_not_leaving(self, request_id: str, departed_too: bool) -> None:
        """A stream read does not wait for an entry a push is taking to a peer (committed), nor,
        unless told where else to look, for one that left lately (pushed, or pulled without keep)
        or whose push failed: it will not be readable here. (One a pull is taking may still come
        back, if the pull fails.)"""
        entry = self.store.entries.get(request_id)
        if entry is not None:
            peer = self.pulls.transfers.pushing(entry) if entry.state is State.CLAIMED else None
            how = (f"was pushed to {peer} and is no longer on {self.settings.node_id}: read it on {peer}"
                   if peer is not None else None)
        else:
            how = self.watch.departed(request_id) if departed_too else None
        if how is not None:
            raise NotFound(f"request {request_id!r} {how}")

    async def locate(self, msg: p.ClusterLocate) -> p.Message:
        return p.Ok(req=msg.req, value=await self.directory().locate(msg.request_id))

    def directory(self) -> Directory:
        if self._directory is None:
            raise BadRequest(f"daemon {self.settings.node_id} has no cluster registry (start it with --registry)")
        return self._directory

    async def get_stream(self, rid: bytes, msg: p.GetStream) -> p.Message | None:
        """Lease an entry that may still be arriving; TensorsReady messages follow the slots."""
        if not 0 <= msg.timeout <= MAX_WAIT:
            raise BadRequest(f"timeout must be between 0 and {MAX_WAIT:g} seconds")
        deadline = time.monotonic() + msg.timeout
        pull = search = None
        if self._is_remote(msg.source) and msg.request_id not in self.store.entries:
            pull = self.pulls.start(rid, msg.source, msg.request_id, msg.timeout, msg.keep,
                                    connect_within=msg.timeout)
            pull.add_done_callback(lambda _: self.watch.wake(msg.request_id))  # a failed pull ends the wait
        elif self._directory is not None and msg.request_id not in self.store.entries:  # as a get does
            search = HolderSearch(self.pulls, rid, self._directory, msg.request_id, msg.keep, deadline,
                                  lambda: self.watch.wake(msg.request_id))

        def find() -> Entry | None:
            if pull is not None and pull.done() and not pull.cancelled() and (failed := pull.exception()) is not None:
                raise failed
            entry = self.watch.streamable(msg.request_id)
            if entry is None:  # (one that left is sought where it went, with a source or a registry)
                self._check_not_leaving(msg.request_id, departed_too=pull is None and search is None)
            return entry

        # (a reader stays on the pull it started while the entry streams in: if it hangs up and
        # nobody else reads, the pull is called off)
        try:
            entry = await self.watch.wait_for(msg.request_id, deadline, find)
        except (Timeout, NotFound) as error:
            raise (error if search is None else search.explain(error)) from None
        finally:
            if search is not None:
                search.stop()
        complete = entry.state is State.READY
        lease = self.store.lease(entry, consume=False, incomplete=True,
                                 deadline=time.monotonic() + self.settings.lease_timeout if complete else None)
        self.watch.stream_leases.add(lease.token)
        reader = StreamReader(rid, msg.req, entry, lease.token)
        slots = p.GetSlots(req=msg.req, token=lease.token, tensors=[s.to_wire() for s in entry.specs],
                           segments=entry.segments(self.settings.block_size), meta=entry.meta)
        if not self._reply(rid, slots):
            return None  # the reader has gone; its lease went back
        ready = reader.news(entry.complete_tensors())
        if not complete:
            self.watch.add_reader(reader)
        return p.TensorsReady(req=msg.req, tensors=ready, complete=complete)
