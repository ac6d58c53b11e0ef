"""Pulls in flight for local gets (daemon process): one pull per (source, request id), shared by
every get and get_stream of that entry; a pull nobody waits for any more is called off (the
holder keeps its copy, readable by others, instead of it moving here unread)."""
from __future__ import annotations

import asyncio
import logging

from .peer.transfers import Transfers
from .store.entries import Entry

log = logging.getLogger(__name__)


class SharedPulls:
    def __init__(self, transfers: Transfers) -> None:
        self.transfers = transfers
        self._pulls: dict[tuple[str, str], asyncio.Future] = {}  # (source, request id) -> pull in flight
        self._readers: dict[tuple[str, str], set[bytes]] = {}  # who waits on it: local connections

    def start(self, conn: bytes, source: str, request_id: str, timeout: float, keep: bool) -> asyncio.Future:
        """The pull of request_id from source, started or joined on behalf of connection conn."""
        key = (source, request_id)
        pull = self._pulls.get(key)
        if pull is None:
            # the pull's own deadline (timeout + transfer_timeout) bounds it
            pull = self.transfers.pull(request_id, source, timeout, keep)
            self._pulls[key] = pull
            pull.add_done_callback(lambda _: self._pulls.pop(key, None))
            pull.add_done_callback(lambda _: self._readers.pop(key, None))
            pull.add_done_callback(lambda f: f.cancelled() or f.exception())  # seen by every waiter
        self._readers.setdefault(key, set()).add(conn)
        return pull

    async def join(self, conn: bytes, source: str, request_id: str, timeout: float, keep: bool) -> Entry:
        """Wait for the pull (a cancelled wait leaves the pull to the others)."""
        pull = self.start(conn, source, request_id, timeout, keep)
        try:
            return await asyncio.shield(pull)
        finally:
            self._readers.get((source, request_id), set()).discard(conn)

    def leave_all(self, conn: bytes) -> None:
        """Connection conn hung up: the pulls it alone waited for are called off."""
        for key in [k for k, readers in self._readers.items() if conn in readers]:
            readers = self._readers[key]
            readers.discard(conn)
            pull = self._pulls.get(key)
            if not readers and pull is not None and not pull.done():
                log.info("nobody waits for %r from %s any more: pull called off", key[1], key[0])
                pull.cancel()
