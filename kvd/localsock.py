"""The local client socket: a unix stream socket carrying framed protocol messages.

Clients on the same host send only small control messages (the bytes go through the shared
pool), so what matters here is round-trip latency: a unix socket wakes the other process
directly, where ZeroMQ would pass each message through an I/O thread on both ends (measured
on a 2-core VM: ~100 us against ~280 us per round trip). Framing is `kvd.framing`.

- `LocalServer`: the daemon's side, on its event loop. Each connection gets a connection id;
  messages are handed on as [connection id, *frames] and replies addressed the same way (the
  shape of a ZeroMQ ROUTER's, so the service does not care). A closed connection is reported,
  so what a dead client held can be given back at once.
- `BlockingConnection`: the synchronous client's side, a blocking socket in the caller's thread.
- `StreamConnection`: the asyncio client's side.

Endpoints: `unix://PATH` (also written `ipc://PATH`, the older spelling) or `tcp://HOST:PORT`
(for a client in another network namespace of the same host: it still maps the pool).
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import select
import socket
from typing import Any, Callable

from . import protocol as p
from .errors import BadRequest, KvdError, ProtocolError
from .framing import MessageReader, encode_message
from .tcpconn import TcpConnection, foreign_user, foreign_user_refusal

log = logging.getLogger(__name__)

LOCAL_SCHEMES = ("unix://", "ipc://", "tcp://")
# replies a client has not read yet; past this it is not reading at all and is cut off
MAX_UNREAD_REPLIES_BYTES = 64 << 20
RECEIVE_BYTES = 1 << 16
# messages of one connection handled per turn of the event loop: one read can hold thousands of
# pipelined requests, and other clients (and the peers) are served between batches
BATCH = 64


def unix_path(endpoint: str) -> str | None:
    """The socket file of a unix:// or ipc:// endpoint; None for tcp://."""
    for scheme in ("unix://", "ipc://"):
        if endpoint.startswith(scheme):
            return endpoint[len(scheme):]
    return None


def _tcp_address(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit():
        raise BadRequest(f"local socket must be unix://PATH or tcp://HOST:PORT, got {endpoint!r}")
    return host.strip("[]"), int(port)


# --- daemon side ---------------------------------------------------------------------------------------

class LocalServer:
    """Accepts client connections; on_message gets [connection id, *frames] for each message."""

    def __init__(self, on_message: Callable[[list], None], on_disconnect: Callable[[bytes], None]) -> None:
        self._on_message = on_message
        self._on_disconnect = on_disconnect
        self._connections: dict[bytes, _ClientConnection] = {}
        self._ids = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None

    async def start(self, endpoint: str) -> None:
        loop = asyncio.get_running_loop()
        path = unix_path(endpoint)
        if path is not None:
            old_umask = os.umask(0o177)  # socket file 0600: only our user may connect
            try:
                self._server = await loop.create_unix_server(self._new_connection, path)
            finally:
                os.umask(old_umask)
        else:
            host, port = _tcp_address(endpoint)
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

    def send_now(self, frames: list) -> None:
        """Send frames[1:] to connection frames[0]; dropped if that client is gone."""
        conn = self._connections.get(frames[0])
        if conn is not None:
            conn.send(frames[1:])

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


# --- client side ---------------------------------------------------------------------------------------

def _connect_socket(endpoint: str, timeout: float) -> socket.socket:
    path = unix_path(endpoint)
    if path is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address: Any = path
    else:
        address = _tcp_address(endpoint)
        sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(address)
    except OSError as exc:
        sock.close()
        raise KvdError(f"no kvd daemon at {endpoint} ({exc.strerror or exc}); start one with `kvd serve`") from None
    if path is None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class BlockingConnection:
    """One connection to the daemon, used from one thread at a time."""

    def __init__(self, endpoint: str, connect_timeout: float) -> None:
        self.endpoint = endpoint
        self._sock = _connect_socket(endpoint, connect_timeout)
        self._sock.settimeout(None)
        self._reader = MessageReader()
        self._ready: collections.deque[list[bytes]] = collections.deque()
        self._poller = select.poll()
        self._poller.register(self._sock, select.POLLIN)
        self._broken = False

    def alive(self) -> bool:
        """False once the daemon has closed the connection (checked without blocking)."""
        if self._broken:
            return False
        events = self._poller.poll(0)
        if not events:
            return True
        if events[0][1] & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
            return False
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def send(self, frames: list) -> None:
        try:
            self._sock.sendall(encode_message(frames))
        except OSError as exc:
            raise self._lost(exc) from None

    def receive(self, timeout: float) -> list[bytes] | None:
        """The next message, or None if none came within timeout seconds."""
        while not self._ready:
            if not self._poller.poll(max(0, int(timeout * 1000))):
                return None
            try:
                data = self._sock.recv(RECEIVE_BYTES)
            except OSError as exc:
                raise self._lost(exc) from None
            if not data:
                raise self._lost(None)
            self._ready.extend(self._reader.feed(data))
        return self._ready.popleft()

    def _lost(self, exc: OSError | None) -> KvdError:
        self._broken = True
        why = f" ({exc.strerror or exc})" if exc is not None else ""
        return KvdError(f"the connection to the kvd daemon at {self.endpoint} was lost{why}")

    def close(self) -> None:
        self._sock.close()


class StreamConnection(asyncio.Protocol):
    """The asyncio client's connection: on_message gets each message's frames."""

    def __init__(self, on_message: Callable[[list], None], on_lost: Callable[[KvdError], None]) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        self._reader = MessageReader()
        self.transport: asyncio.Transport | None = None
        self.endpoint = ""

    @classmethod
    async def open(cls, endpoint: str, on_message: Callable[[list], None],
                   on_lost: Callable[[KvdError], None], timeout: float) -> "StreamConnection":
        loop = asyncio.get_running_loop()
        sock = await loop.run_in_executor(None, _connect_socket, endpoint, timeout) \
            if unix_path(endpoint) is None else _connect_socket(endpoint, timeout)
        sock.setblocking(False)
        _, conn = await loop.create_connection(lambda: cls(on_message, on_lost), sock=sock)
        conn.endpoint = endpoint
        return conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            messages = self._reader.feed(data)
        except ProtocolError as exc:
            self.transport.abort()
            self._on_lost(KvdError(f"the kvd daemon at {self.endpoint} sent a malformed stream: {exc}"))
            return
        for frames in messages:
            self._on_message(frames)

    def send_now(self, frames: list) -> None:
        if self.transport.is_closing():
            raise KvdError(f"the connection to the kvd daemon at {self.endpoint} was lost")
        self.transport.write(encode_message(frames))

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost(KvdError(f"the connection to the kvd daemon at {self.endpoint} was lost"))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
