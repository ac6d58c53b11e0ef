"""Reads that wait (daemon process): a get for an entry not here yet (arriving, held by a peer,
or somewhere in the cluster) and a get_stream that follows an entry as it is written. The
handlers run these as tasks; each resolves to the reply (or the first reply: a stream's
TensorsReady follow through the entry watch)."""
from __future__ import annotations

import time
from typing import Callable

from kvd.errors import BadRequest, NotFound, Timeout
from kvd.wire import protocol as p

from .config import Config
from .directory import Directory
from .pulls import HolderSearch, SharedPulls
from .store.entries import Entry, State, Store
from .watch import EntryWatch, StreamReader

MAX_WAIT = 3600.0  # longest get timeout we accept


class Reads:
    def __init__(self, config: Config, store: Store, watch: EntryWatch, pulls: SharedPulls,
                 directory: Directory | None, reply: Callable[[bytes, p.Message], bool]) -> None:
        self.config = config
        self.store = store
        self.watch = watch
        self.pulls = pulls
        self._directory = directory  # the cluster registry's holder directory, with --registry
        self._reply = reply

    def _is_remote(self, peer: str | None) -> bool:
        return peer is not None and peer != self.config.node_id

    def lease_for_client(self, msg: p.Get, entry: Entry) -> p.GetSlots:
        lease = self.store.lease(entry, consume=not msg.keep, deadline=time.monotonic() + self.config.lease_timeout)
        return p.GetSlots(req=msg.req, token=lease.token, tensors=[s.to_wire() for s in entry.specs],
                          segments=entry.segments(self.config.block_size), meta=entry.meta)

    async def get(self, rid: bytes, msg: p.Get) -> p.Message:
        deadline = time.monotonic() + msg.timeout
        if self._is_remote(msg.source):
            entry = self.store.ready(msg.request_id)
            if entry is None and msg.request_id in self.store.entries:
                entry = await self.watch.wait_ready(msg.request_id, deadline)  # already arriving (pushed)
            elif entry is None:
                entry = await self.pulls.join(rid, msg.source, msg.request_id, msg.timeout, msg.keep)
            if entry.state is not State.READY:  # taken by another reader in the meantime
                entry = await self.watch.wait_ready(msg.request_id, deadline)
        elif self._directory is not None and msg.request_id not in self.store.entries:
            entry = await self.pulls.anywhere(rid, self.watch, self._directory, msg.request_id, msg.keep, deadline)
        else:
            entry = await self.watch.wait_ready(msg.request_id, deadline)
        return self.lease_for_client(msg, entry)

    async def locate(self, msg: p.ClusterLocate) -> p.Message:
        return p.Ok(req=msg.req, value=await self.directory().locate(msg.request_id))

    def directory(self) -> Directory:
        if self._directory is None:
            raise BadRequest(f"daemon {self.config.node_id} has no cluster registry (start it with --registry)")
        return self._directory

    async def get_stream(self, rid: bytes, msg: p.GetStream) -> p.Message | None:
        """Lease an entry that may still be arriving; TensorsReady messages follow the slots."""
        if not 0 <= msg.timeout <= MAX_WAIT:
            raise BadRequest(f"timeout must be between 0 and {MAX_WAIT:g} seconds")
        deadline = time.monotonic() + msg.timeout
        pull = search = None
        if self._is_remote(msg.source) and msg.request_id not in self.store.entries:
            pull = self.pulls.start(rid, msg.source, msg.request_id, msg.timeout, msg.keep)
            pull.add_done_callback(lambda _: self.watch.wake(msg.request_id))  # a failed pull ends the wait
        elif self._directory is not None and msg.request_id not in self.store.entries:  # as a get does
            search = HolderSearch(self.pulls, rid, self._directory, msg.request_id, msg.keep, deadline,
                                  lambda: self.watch.wake(msg.request_id))

        def find() -> Entry | None:
            if pull is not None and pull.done() and not pull.cancelled() and pull.exception() is not None:
                raise pull.exception()
            return self.watch.streamable(msg.request_id)

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
                                 deadline=time.monotonic() + self.config.lease_timeout if complete else None)
        self.watch.stream_leases.add(lease.token)
        reader = StreamReader(rid, msg.req, entry, lease.token)
        slots = p.GetSlots(req=msg.req, token=lease.token, tensors=[s.to_wire() for s in entry.specs],
                           segments=entry.segments(self.config.block_size), meta=entry.meta)
        if not self._reply(rid, slots):
            return None  # the reader has gone; its lease went back
        ready = reader.news(entry.complete_tensors())
        if not complete:
            self.watch.add_reader(reader)
        return p.TensorsReady(req=msg.req, tensors=ready, complete=complete)
