"""Pulls in flight for local gets (daemon process): one pull per (source, request id), shared by
every get and get_stream of that entry; a pull nobody waits for any more is called off (the
holder keeps its copy, readable by others, instead of it moving here unread). With a cluster
registry, `from_holders` finds the holder of a get that names no source and pulls from it (a
get_stream's search for one is a `HolderSearch`)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvd.cluster import RegistryUnavailable
from kvd.errors import KvdError, NotFound, PoolFull, ShuttingDown, Timeout

from ..membership import Directory
from ..peer.transfers import Expectation, Transfers
from ..store.entries import Entry, State
from .watch import EntryWatch

log = logging.getLogger(__name__)

RETRY_LOOKUP = 0.2  # seconds between lookups of a get while the registry does not answer
OURS = (PoolFull, ShuttingDown)  # failures of a pull that are this daemon's, not the holder's


class SharedPulls:
    def __init__(self, transfers: Transfers) -> None:
        self.transfers = transfers
        self._pulls: dict[tuple[str, str], asyncio.Future[Entry]] = {}  # (source, request id) -> pull in flight
        self._readers: dict[tuple[str, str], set[bytes]] = {}  # who waits on it: local connections

    def start(self, conn: bytes, source: str, request_id: str, timeout: float, keep: bool,
              expect: Expectation | None = None, connect_within: float | None = None) -> asyncio.Future[Entry]:
        """The pull of request_id from source, started or joined on behalf of connection conn."""
        key = (source, request_id)
        pull = self._pulls.get(key)
        if pull is None:
            # the pull's own deadline (timeout + transfer_timeout) bounds it
            pull = self.transfers.pull(request_id, source, timeout, keep, expect, connect_within)
            self._pulls[key] = pull
            pull.add_done_callback(lambda _: self._pulls.pop(key, None))
            pull.add_done_callback(lambda _: self._readers.pop(key, None))
            pull.add_done_callback(lambda f: f.cancelled() or f.exception())  # seen by every waiter
        self._readers.setdefault(key, set()).add(conn)
        return pull

    async def join(self, conn: bytes, source: str, request_id: str, timeout: float, keep: bool,
                   expect: Expectation | None = None, connect_within: float | None = None) -> Entry:
        """Wait for the pull (a cancelled wait leaves the pull to the others)."""
        pull = self.start(conn, source, request_id, timeout, keep, expect, connect_within)
        try:
            return await asyncio.shield(pull)
        finally:
            self._readers.get((source, request_id), set()).discard(conn)

    def pulling(self, request_id: str) -> bool:
        """Whether a pull of request_id (from any source) is in flight."""
        return any(rid == request_id for _, rid in self._pulls)

    def leave_all(self, conn: bytes) -> None:
        """Connection conn hung up: the pulls it alone waited for are called off."""
        for key in [k for k, readers in self._readers.items() if conn in readers]:
            readers = self._readers[key]
            readers.discard(conn)
            pull = self._pulls.get(key)
            if not readers and pull is not None and not pull.done():
                log.info("nobody waits for %r from %s any more: pull called off", key[1], key[0])
                pull.cancel()

    async def from_holders(self, conn: bytes, directory: Directory, request_id: str, keep: bool,
                           deadline: float) -> Entry:
        """Pull request_id from whichever node the registry says holds it, best first, waiting for
        one to be published until deadline. Each hint is checked by the holder (identity, then the
        entry's generation): a stale one costs one attempt and the next is tried."""
        tried: set[str] = set()
        while True:
            try:
                holders = await directory.holders(request_id, max(0.0, deadline - time.monotonic()), tried)
            except RegistryUnavailable:
                # down, or just back (a stale connection): ask again while there is time; its breaker
                # makes the asking cheap while it stays down
                if deadline - time.monotonic() < RETRY_LOOKUP:
                    raise
                await asyncio.sleep(RETRY_LOOKUP)
                continue
            if not holders:
                raise Timeout(f"no holder of {request_id!r} was published in the cluster registry in time")
            for holder in holders:
                tried.add(holder.node.node_id)
                expect = Expectation(holder.node.node_id, holder.node.incarnation, holder.holder.gen)
                left = deadline - time.monotonic()
                try:  # timeout 0: the hint says it is complete there; if it is not, try the next
                    return await self.join(conn, holder.node.node_id, request_id, 0.0, keep, expect, left)
                except OURS:
                    raise  # (our pool is full, or we are stopping: another holder would not help)
                except KvdError as exc:  # whatever one holder answers (or a liar in its place), try the next
                    directory.note_stale()
                    log.info("holder %s of %r did not serve it (%s): trying the next", holder.node.node_id,
                             request_id, exc)

    async def anywhere(self, conn: bytes, watch: EntryWatch, directory: Directory, request_id: str, keep: bool,
                       deadline: float) -> Entry:
        """A get with no source of an entry not here: wait for it here (a push may bring it), and
        meanwhile pull it from a holder the registry names. The first to succeed wins; when both
        fail, the local wait's error ends the get, saying why the registry could not help."""
        loop = asyncio.get_running_loop()
        local = loop.create_task(watch.wait_ready(request_id, deadline))
        remote = loop.create_task(self.from_holders(conn, directory, request_id, keep, deadline))
        try:
            pending = {local, remote}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if local in done and local.exception() is None:
                    return local.result()
                if remote in done and remote.exception() is None:
                    if remote.result().state is State.READY:
                        return remote.result()
                    pending = {local}  # it arrived, and another reader took it first: wait for it here
            failed = local.exception()
            assert failed is not None  # (both ended, and the local wait did not return its entry: it failed)
            raise registry_said(failed, remote.exception())
        finally:
            for task in (local, remote):
                task.cancel()


def registry_said(error: BaseException, why: BaseException | None) -> BaseException:
    """A local wait's error, saying why the registry could not help when it was not a plain miss."""
    if why is None or isinstance(why, (Timeout, NotFound)) or not isinstance(error, KvdError):
        return error
    return type(error)(f"{error.message}; the cluster registry could not say who holds it: {why}")


class HolderSearch:
    """A get_stream's look in the registry for the holder of an entry not here (with no source).
    The pull it starts streams the entry in here, where the reader's wait finds it as any arriving
    entry; a push may bring it first. `wake` is called when the search ends, either way."""

    def __init__(self, pulls: SharedPulls, conn: bytes, directory: Directory, request_id: str, keep: bool,
                 deadline: float, wake: Callable[[], None]) -> None:
        self.pulls, self.request_id = pulls, request_id
        self.task = asyncio.get_running_loop().create_task(
            pulls.from_holders(conn, directory, request_id, keep, deadline))
        self.task.add_done_callback(lambda _: wake())
        self.task.add_done_callback(lambda t: t.cancelled() or t.exception())  # said by explain()

    def explain(self, error: BaseException) -> BaseException:
        task = self.task
        return registry_said(error, task.exception() if task.done() and not task.cancelled() else None)

    def stop(self) -> None:
        """The reader's wait is over: stop looking, but let a pull under way finish (its reader
        stays on it: if that reader hangs up alone, the pull is called off)."""
        if not self.task.done() and not self.pulls.pulling(self.request_id):
            self.task.cancel()
