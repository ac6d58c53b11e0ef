"""The client's end of the local socket (worker process): one connection to the daemon.

`BlockingConnection` is the synchronous `Client`'s, a blocking socket in the caller's thread;
`StreamConnection` is `AsyncClient`'s, an asyncio protocol. Both carry the messages
`kvd.wire.framing` frames; the daemon's end is `kvd.daemon.local.server`. `ask` sends one
request that needs no pool (what `kvd status`, `ls` and `rm` send): no torch, no mapping.
"""
from __future__ import annotations

import asyncio
import collections
import os
import select
import socket
import struct
from collections.abc import Callable
from typing import Any

from kvd.errors import KvdError, ProtocolError, Timeout, Unauthorized, error_from_code
from kvd.wire import protocol as p
from kvd.wire.endpoints import default_socket, tcp_address, unix_path
from kvd.wire.framing import PEER_PORT, MessageReader, encode_message, zmtp_greeting

from .ops import reply_as, req_of

RECEIVE_BYTES = 1 << 16
PROBE_TIMEOUT = 0.25  # s: how long a probe of a tcp:// endpoint waits for ZeroMQ's greeting (sent at once)


def peer_port_error(endpoint: str, head: bytes = b"") -> ProtocolError | None:
    """A tcp:// endpoint that dropped us, or sent no kvd message, before any answer: is a kvd peer
    port there? ZeroMQ greets first, and a client socket never does. `head`: the first bytes it
    sent, if any came (ZeroMQ may reset the connection before they are read: then a fresh
    connection, which sends nothing, waits a moment for a greeting)."""
    if unix_path(endpoint) is not None:
        return None
    if not head:
        try:
            with socket.create_connection(tcp_address(endpoint), timeout=PROBE_TIMEOUT) as probe:
                head = probe.recv(10)
        except (OSError, KvdError):
            return None
    return ProtocolError(f"{endpoint}: {PEER_PORT}") if zmtp_greeting(head) else None


def _connect_socket(endpoint: str, timeout: float) -> socket.socket:
    path = unix_path(endpoint)
    if path is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address: Any = path
    else:
        address = tcp_address(endpoint)
        sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(address)
    except OSError as exc:
        sock.close()
        raise KvdError(f"no kvd daemon at {endpoint} ({exc.strerror or exc}); start one with `kvd serve`") from None
    if path is None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    else:
        _check_daemon_user(sock, endpoint)
    return sock


def _check_daemon_user(sock: socket.socket, endpoint: str) -> None:
    """Only our own user's daemon (or root's) may answer: another user could have taken the socket
    path first, and a worker must never write a KV cache into its pool, nor read caches from it."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid not in (os.getuid(), 0):
        sock.close()
        raise Unauthorized(f"the process answering on {endpoint} (pid {pid}) runs as uid {uid}, not as this worker's "
                           f"uid {os.getuid()} or root: refusing to hand it any KV cache (is the socket directory "
                           "another user's?)")


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
        self._head: bytes | None = b""  # the stream's first bytes, until a message came (then None)

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
            if self._head is not None:
                self._head = (self._head + data)[:10]
            try:
                self._ready.extend(self._reader.feed(data))
            except ProtocolError as exc:
                self._broken = True
                raise (peer_port_error(self.endpoint, self._head) if self._head else None) or exc from None
            if self._ready:
                self._head = None
        return self._ready.popleft()

    def _lost(self, exc: OSError | None) -> KvdError:
        self._broken = True
        if self._head is not None and (wrong := peer_port_error(self.endpoint, self._head)) is not None:
            return wrong
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
        self._head = True  # nothing received yet (ZeroMQ's greeting comes in the first bytes)

    @classmethod
    async def open(cls, endpoint: str, on_message: Callable[[list], None],
                   on_lost: Callable[[KvdError], None], timeout: float) -> StreamConnection:
        loop = asyncio.get_running_loop()
        sock = await loop.run_in_executor(None, _connect_socket, endpoint, timeout) \
            if unix_path(endpoint) is None else _connect_socket(endpoint, timeout)
        sock.setblocking(False)
        _, conn = await loop.create_connection(lambda: cls(on_message, on_lost), sock=sock)
        conn.endpoint = endpoint
        return conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream socket's transport is an asyncio.Transport (asyncio.Protocol's signature says
        # BaseTransport, for every kind); uvloop's is one without deriving from it
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        head, self._head = self._head, False
        try:
            messages = self._reader.feed(data)
        except ProtocolError as exc:
            if self.transport is not None:
                self.transport.abort()
            wrong = peer_port_error(self.endpoint, data[:10]) if head else None
            self._on_lost(wrong or KvdError(f"the kvd daemon at {self.endpoint} sent a malformed stream: {exc}"))
            return
        for frames in messages:
            self._on_message(frames)

    def send_now(self, frames: list) -> None:
        if self.transport is None or self.transport.is_closing():
            raise KvdError(f"the connection to the kvd daemon at {self.endpoint} was lost")
        self.transport.write(encode_message(frames))

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost(KvdError(f"the connection to the kvd daemon at {self.endpoint} was lost"))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def ask(msg: p.Message, endpoint: str | None = None, timeout: float = 10.0) -> Any:
    """Send one request that needs no pool (stats, list, delete) and return its answer's value;
    the daemon's error is raised as its class."""
    endpoint = endpoint or default_socket()
    conn = BlockingConnection(endpoint, timeout)
    try:
        conn.send(p.encode(msg))
        while (frames := conn.receive(timeout)) is not None:
            reply = p.decode(frames)
            if req_of(reply) != req_of(msg):
                continue
            if isinstance(reply, p.Error):
                raise error_from_code(reply.code, reply.message, remote=reply.origin)
            return reply_as(p.Ok, reply).value
        raise Timeout(f"the kvd daemon at {endpoint} did not answer {msg.TYPE} within {timeout:g}s")
    finally:
        conn.close()
