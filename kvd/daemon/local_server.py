"""The daemon's local client socket (daemon process): framed protocol messages on its event loop.

Clients on the same host send only small control messages (the bytes go through the shared
pool), so what matters here is round-trip latency: a unix socket wakes the other process
directly, where ZeroMQ would pass each message through an I/O thread on both ends (measured
on a 2-core VM: ~100 us against ~280 us per round trip). Framing is `kvd.wire.framing`; the
client's end is `kvd.client.connection`.

Each connection gets a connection id; messages are handed on as [connection id, *frames] and
replies addressed the same way (the shape of a ZeroMQ ROUTER's, so the handlers do not care).
A closed connection is reported, so what a dead client held can be given back at once.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import socket
from typing import Callable

from kvd.errors import ProtocolError
from kvd.wire import protocol as p
from kvd.wire.endpoints import tcp_address, unix_path
from kvd.wire.framing import MessageReader, encode_message

from .peer.tcpconn import TcpConnection, foreign_user, foreign_user_refusal

log = logging.getLogger(__name__)

# replies a client has not read yet; past this it is not reading at all and is cut off
MAX_UNREAD_REPLIES_BYTES = 64 << 20
# messages of one connection handled per turn of the event loop: one read can hold thousands of
# pipelined requests, and other clients (and the peers) are served between batches
BATCH = 64


class LocalServer:
    """Accepts client connections; on_message gets [connection id, *frames] for each message.

    Built before the handlers (they send replies through it) and given them at `start`."""

    def __init__(self) -> None:
        self._on_message: Callable[[list], None] = lambda frames: None
        self._on_disconnect: Callable[[bytes], None] = lambda conn_id: None
        self._connections: dict[bytes, _ClientConnection] = {}
        self._ids = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None

    async def start(self, endpoint: str, on_message: Callable[[list], None],
                    on_disconnect: Callable[[bytes], None]) -> None:
        """Serve endpoint; on_message gets [connection id, *frames], on_disconnect a departed id."""
        self._on_message, self._on_disconnect = on_message, on_disconnect
        loop = asyncio.get_running_loop()
        path = unix_path(endpoint)
        if path is not None:
            old_umask = os.umask(0o177)  # socket file 0600: only our user may connect
            try:
                self._server = await loop.create_unix_server(self._new_connection, path)
            finally:
                os.umask(old_umask)
        else:
            host, port = tcp_address(endpoint)
            self._server = await loop.create_server(self._new_connection, host, port)

    def _new_connection(self) -> "_ClientConnection":
        conn_id = b"c%d" % next(self._ids)
        conn = _ClientConnection(self, conn_id)
        self._connections[conn_id] = conn
        return conn

    @property
    def connections(self) -> int:
        return len(self._connections)

    def is_connected(self, conn_id: bytes) -> bool:
        return conn_id in self._connections

    def send(self, conn_id: bytes, msg: p.Message) -> bool:
        """Send msg to a client; False if that client is gone."""
        conn = self._connections.get(conn_id)
        if conn is None:
            return False
        conn.send(p.encode(msg))
        return True

    def _gone(self, conn_id: bytes) -> None:
        if self._connections.pop(conn_id, None) is not None:
            try:
                self._on_disconnect(conn_id)
            except Exception:
                log.exception("clean-up after a client disconnect failed")

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        connections = list(self._connections.values())
        self._connections.clear()  # shutting down: no per-client clean-up to run
        for conn in connections:
            conn.transport.abort()


class _ClientConnection(asyncio.Protocol):
    """One client; on a tcp:// socket, one from another user on loopback is turned away at once
    (a unix socket's 0600 mode does that for the default endpoint)."""

    def __init__(self, server: LocalServer, conn_id: bytes) -> None:
        self.server = server
        self.conn_id = conn_id
        self.reader = MessageReader()
        self.transport: asyncio.Transport | None = None
        self._backlog: collections.deque = collections.deque()  # decoded, not yet handled
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family != socket.AF_UNIX:
            uid = foreign_user(TcpConnection.of_fd(sock.fileno()))
            if uid is not None:
                refusal = foreign_user_refusal(uid, "this client connection (on loopback)",
                                               "run the client as the daemon's user")
                log.warning("refused a client connection from another user (%s)",
                            "unknown" if uid < 0 else f"uid {uid}")
                self.send(p.encode(p.error_reply(0, refusal, None)))
                self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        try:
            messages = self.reader.feed(data)
        except ProtocolError as exc:
            # the stream cannot be resynchronized: say why, then hang up on this client only
            log.warning("client %s broke the framing: %s; closing its connection", self.conn_id.decode(), exc)
            self.send(p.encode(p.error_reply(0, exc, None)))
            self.transport.close()
            return
        self._backlog.extend(messages)
        self._handle_batch()

    def _handle_batch(self) -> None:
        for _ in range(BATCH):
            if not self._backlog or self.transport.is_closing():
                break
            self.server._on_message([self.conn_id, *self._backlog.popleft()])
        if self.transport.is_closing():
            return
        if self._backlog:
            if not self._paused:  # read more once these are handled
                self._paused = True
                self.transport.pause_reading()
            asyncio.get_running_loop().call_soon(self._handle_batch)
        elif self._paused:
            self._paused = False
            self.transport.resume_reading()

    def send(self, frames: list) -> None:
        if self.transport.is_closing():
            return
        self.transport.write(encode_message(frames))
        if self.transport.get_write_buffer_size() > MAX_UNREAD_REPLIES_BYTES:
            log.warning("client %s is not reading its replies; closing its connection", self.conn_id.decode())
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._gone(self.conn_id)
