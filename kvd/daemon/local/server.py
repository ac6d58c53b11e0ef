"""The daemon's local client socket (daemon process): framed protocol messages on its event loop.

Clients on the same host send only small control messages (the bytes go through the shared
pool), so what matters here is round-trip latency: a unix socket wakes the other process
directly, where ZeroMQ would pass each message through an I/O thread on both ends (measured
on a 2-core VM: ~100 us against ~280 us per round trip). Framing is `kvd.wire.framing`; the
client's end is `kvd.client.connection`.

Each connection gets a connection id; messages are handed on as [connection id, *frames] and
replies addressed the same way (the shape of a ZeroMQ ROUTER's, so the handlers do not care).
A closed connection is reported, so what a dead client held can be given back at once.

At --max-clients, a new connection takes the place of another, so that a client always gets in
while some connection holds nothing: first one that never said a word (SILENT_GRACE after it
connected: a client says hello at once), then the one idle longest (nothing held or waited for,
the handlers say, `uses`; nothing half-sent or unanswered; silent IDLE_GRACE), and only then one
whose only business is gets waiting (those end, and it is told why). Idle connections (a leaked
one, a worker parked between requests) and parked waits cannot lock a new client out; what is
evicted is told why, and a client reconnects at its next call. Connections that hold something
(blocks, a lease, a reply owed) are never evicted: when every one does, a new client is refused,
and the refusal is read by the client before the connection closes (not lost to a reset).
"""
from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import logging
import os
import socket
import time
from collections.abc import Callable

from kvd.errors import BadRequest, KvdError, ProtocolError
from kvd.memory.heap import give_back_heap
from kvd.wire import protocol as p
from kvd.wire.endpoints import tcp_address, unix_path
from kvd.wire.framing import MessageReader, encode_message
from kvd.wire.protocol import Frame

from ..peer.tcpconn import TcpConnection, foreign_user, foreign_user_refusal

log = logging.getLogger(__name__)

# replies a client has not read yet; past this it is not reading at all and is cut off (a reply
# is at most a few MiB: a client accepts 4 MiB messages)
MAX_UNREAD_REPLIES_BYTES = 8 << 20
# a message begun must be finished within this; a client that sends part of one and stops holds
# up to 4 MiB of buffer (MAX_MESSAGE_BYTES), so both this and a budget over all connections bound
# what clients can pin: the budget is kept as bytes arrive (past it, the connections holding the
# most are cut before anything more is read), the deadline by the housekeeping
PARTIAL_DEADLINE = 10.0  # seconds
PARTIAL_BUDGET = 64 << 20  # bytes of unfinished messages over all connections
# once this much of cut connections' buffers is freed, the heap is given back to the kernel (the
# daemon keeps freed heap for ZeroMQ's receive buffers: kvd.memory.heap), so that a flood that
# was cut leaves no RSS behind
TRIM_AFTER = 16 << 20  # bytes
# messages of one connection handled per turn of the event loop: one read can hold thousands of
# pipelined requests, and other clients (and the peers) are served between batches
BATCH = 64
# silence after which a connection that holds nothing may be evicted at the cap, since its last message
# (a client between its hello and its first request is not idle) or since it connected, when it never sent
# one (a client says hello at once: after this long, it is not about to)
IDLE_GRACE = 1.0  # seconds
SILENT_GRACE = 1.0  # seconds
# a refused connection is kept open this long (at most REFUSED_KEPT of them), its input discarded, so
# that the client reads why before the close: closing on its unread hello would reset the connection
REFUSED_LINGER = 1.0  # seconds
REFUSED_KEPT = 256


class Use(enum.IntEnum):
    """What a connection has with the handlers, for eviction at the cap."""

    NOTHING = 0  # idle: may be evicted
    WAITS = 1  # gets waiting, nothing held: evicted only when no connection is idle (its waits end)
    HOLDS = 2  # blocks, a lease, a reply owed: never evicted


class LocalServer:
    """Accepts client connections; on_message gets [connection id, *frames] for each message.

    Built before the handlers (they send replies through it) and given them at `start`."""

    def __init__(self, max_clients: int = 1024) -> None:
        self.max_clients = max_clients
        self.refused = 0  # connections turned away at the cap
        self.evicted = 0  # idle connections closed at the cap, to make room for a new one
        self.partial_bytes = 0  # bytes of unfinished messages buffered, over all connections
        self.partial_cuts = {"budget": 0, "deadline": 0}  # connections cut for an unfinished message
        self._freed = 0  # bytes of cut connections' buffers freed since the heap was last given back
        # what a connection holds or waits for (the handlers', given at start): how it may be evicted
        self.uses: Callable[[bytes], Use] = lambda conn_id: Use.NOTHING
        self.lingering = 0  # refused connections kept open until their client read why
        self._on_message: Callable[[list[bytes]], None] = lambda frames: None
        self._on_disconnect: Callable[[bytes], None] = lambda conn_id: None
        self._connections: dict[bytes, _ClientConnection] = {}
        self._ids = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None

    async def start(self, endpoint: str, on_message: Callable[[list[bytes]], None],
                    on_disconnect: Callable[[bytes], None], uses: Callable[[bytes], Use] | None = None) -> None:
        """Serve endpoint; on_message gets [connection id, *frames], on_disconnect a departed id,
        uses what a connection holds or waits for (how it may be evicted at --max-clients)."""
        self._on_message, self._on_disconnect = on_message, on_disconnect
        if uses is not None:
            self.uses = uses
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

    def _new_connection(self) -> _ClientConnection:
        conn_id = b"c%d" % next(self._ids)
        conn = _ClientConnection(self, conn_id, full=len(self._connections) >= self.max_clients)
        if not conn.full:
            self._connections[conn_id] = conn
        return conn

    def admit_at_cap(self, conn: _ClientConnection) -> bool:
        """A connection that came at the cap: let it in if there is room now, or once another has
        been evicted to make some (the first of: never spoke, idle longest, only waiting longest)."""
        if len(self._connections) >= self.max_clients:
            now = time.monotonic()
            ranked = [(rank, c) for c in self._connections.values() if (rank := c.eviction_rank(now)) is not None]
            if not ranked:
                return False
            (kind, since), victim = min(ranked, key=lambda pair: pair[0])
            self.evicted += 1
            what = ("never sent a message" if kind == 0 else "holding nothing" if kind == 1
                    else "holding nothing but gets waiting, which end now")
            if self.evicted & (self.evicted - 1) == 0:  # 1st, 2nd, 4th, ...: a flood logs little
                log.warning("%d clients are connected (--max-clients): closed client %s, silent for %.0fs and %s, "
                            "to make room for a new one; %d evicted so far", self.max_clients,
                            victim.conn_id.decode(), now - since, what, self.evicted)
            victim.send(p.encode(p.error_reply(0, BadRequest(
                f"the daemon serves at most {self.max_clients} client connections (--max-clients) and a new client "
                f"came: this connection, idle for {now - since:.0f}s ({what}), was closed to make room "
                "(reconnect to go on)"), None)))
            victim.transport.close()
            self._gone(victim.conn_id)  # (now: it is no longer one of ours)
        self._connections[conn.conn_id] = conn
        return True

    def enforce(self, now: float) -> None:
        """Housekeeping: cut connections that began a message and did not finish it in time; give
        the heap back once cut connections freed enough of it."""
        for conn in list(self._connections.values()):
            if conn.partial_since is not None and now - conn.partial_since > PARTIAL_DEADLINE:
                self.cut_partial(conn, "deadline",
                                 f"it began a message and did not finish it within {PARTIAL_DEADLINE:g}s")
        if self._freed >= TRIM_AFTER and self.partial_bytes < TRIM_AFTER:
            self._freed = 0
            give_back_heap()

    def buffered(self, conn: _ClientConnection, grown: int) -> None:
        """A connection's unfinished message grew (or shrank) by `grown` bytes; past the budget over
        all connections, the ones holding the most are cut now, before anything more is read."""
        self.partial_bytes += grown
        if self.partial_bytes <= PARTIAL_BUDGET:
            return
        for victim in sorted((c for c in self._connections.values() if c.reader.buffered),
                             key=lambda c: c.reader.buffered, reverse=True):
            if self.partial_bytes <= PARTIAL_BUDGET:
                break
            self.cut_partial(victim, "budget", f"unfinished messages of all clients passed {PARTIAL_BUDGET >> 20} MiB")

    def cut_partial(self, conn: _ClientConnection, kind: str, why: str) -> None:
        cuts = self.partial_cuts[kind] = self.partial_cuts[kind] + 1
        if cuts & (cuts - 1) == 0:  # 1st, 2nd, 4th, ...: a flood logs little
            log.warning("client %s: closing its connection: %s (%d cut so far for this)", conn.conn_id.decode(), why,
                        cuts)
        conn.transport.abort()
        self.drop_partial(conn)

    def drop_partial(self, conn: _ClientConnection) -> None:
        """Free what a connection that is going away had of an unfinished message, now."""
        if conn.reader.buffered:
            self.partial_bytes -= conn.reader.buffered
            self._freed += conn.reader.buffered
            conn.reader = MessageReader()
            conn.partial_since = None

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

    def __init__(self, server: LocalServer, conn_id: bytes, full: bool = False) -> None:
        self.server = server
        self.conn_id = conn_id
        self.full = full  # came at the cap: let in only if an idle one makes room, else told why and closed
        self.reader = MessageReader()
        self._transport: asyncio.Transport | None = None  # (from connection_made)
        self._backlog: collections.deque[list[bytes]] = collections.deque()  # decoded, not yet handled
        self._paused = False
        self.partial_since: float | None = None  # when the message now buffered began
        self.connected_at = time.monotonic()
        self.last_message: float | None = None  # when the last whole message came (None: none yet)
        self.refused = False  # told why it is not served; closed once it read that
        self._lingers = False  # (counted among the refused connections kept open)

    @property
    def transport(self) -> asyncio.Transport:
        """The connection's transport: asyncio calls connection_made first (a connection is listed
        from its protocol's creation, a moment before: `eviction_rank` allows for that)."""
        transport = self._transport
        assert transport is not None, "a client connection used before connection_made"
        return transport

    def eviction_rank(self, now: float) -> tuple[int, float] | None:
        """(kind, since when) if this connection may be evicted at the cap, the lowest first: 0 never
        spoke, 1 idle, 2 only waiting; None if it may not (mid-message, unanswered, or holding)."""
        transport = self._transport
        if (transport is None or transport.is_closing() or self._backlog or self.reader.buffered
                or transport.get_write_buffer_size()):
            return None
        if self.last_message is None:
            return (0, self.connected_at) if now - self.connected_at >= SILENT_GRACE else None
        if now - self.last_message < IDLE_GRACE:
            return None
        uses = self.server.uses(self.conn_id)
        return None if uses is Use.HOLDS else (1 + uses, self.last_message)

    def refuse(self, error: KvdError) -> None:
        """Say why, then close: once the client has read it (it closes, or REFUSED_LINGER passed)."""
        self.refused = True
        self.send(p.encode(p.error_reply(0, error, None)))
        if self.server.lingering >= REFUSED_KEPT or not self.transport.can_write_eof():
            self.transport.close()
            return
        self.server.lingering += 1
        self._lingers = True
        self.transport.write_eof()  # (what was said goes out; what comes in is discarded)
        asyncio.get_running_loop().call_later(REFUSED_LINGER, self.transport.abort)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (a stream server's transport: asyncio types connection_made's argument as the base class)
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family != socket.AF_UNIX:
            uid = foreign_user(TcpConnection.of_fd(sock.fileno()))
            if uid is not None:  # (before it may take an idle connection's place)
                refusal = foreign_user_refusal(uid, "this client connection (from this host)",
                                               "run the client as the daemon's user")
                log.warning("refused a client connection from another user (%s)",
                            "unknown" if uid < 0 else f"uid {uid}")
                self.refuse(refusal)
                return
        if self.full and self.server.admit_at_cap(self):
            self.full = False
        elif self.full:
            self.server.refused += 1
            if self.server.refused & (self.server.refused - 1) == 0:  # 1st, 2nd, 4th, ...: a flood logs little
                log.warning("refused a client connection: %d clients are connected (--max-clients), none of them "
                            "able to make room (each holds something, or was active lately); %d refused so far",
                            self.server.max_clients, self.server.refused)
            self.refuse(BadRequest(f"the daemon serves at most {self.server.max_clients} client connections "
                                   "(--max-clients), and none can make room now: each holds something, or was "
                                   f"active within the last {IDLE_GRACE:g}s (try again)"))

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing() or self.refused:
            return
        held = self.reader.buffered
        try:
            messages = self.reader.feed(data)
        except ProtocolError as exc:
            # the stream cannot be resynchronized: say why, then hang up on this client only
            log.warning("client %s broke the framing: %s; closing its connection", self.conn_id.decode(), exc)
            self.send(p.encode(p.error_reply(0, exc, None)))
            self.transport.close()
            self.server.drop_partial(self)
            return
        if self.reader.buffered != held and not self.full:
            self.server.buffered(self, self.reader.buffered - held)
            if self.transport.is_closing():  # (cut: over the budget)
                return
        self._backlog.extend(messages)
        if messages:
            self.last_message = time.monotonic()
        if not self.reader.buffered:
            self.partial_since = None
        elif messages or self.partial_since is None:  # (a new message began)
            self.partial_since = time.monotonic()
        self._handle_batch()

    def _handle_batch(self) -> None:
        transport = self.transport
        for _ in range(BATCH):
            if not self._backlog or transport.is_closing():
                break
            self.server._on_message([self.conn_id, *self._backlog.popleft()])
        if transport.is_closing():
            return
        if self._backlog:
            if not self._paused:  # read more once these are handled
                self._paused = True
                transport.pause_reading()
            asyncio.get_running_loop().call_soon(self._handle_batch)
        elif self._paused:
            self._paused = False
            transport.resume_reading()

    def send(self, frames: list[Frame]) -> None:
        transport = self.transport
        if transport.is_closing():
            return
        transport.write(encode_message(frames))
        if transport.get_write_buffer_size() > MAX_UNREAD_REPLIES_BYTES:
            log.warning("client %s is not reading its replies; closing its connection", self.conn_id.decode())
            transport.abort()

    def eof_received(self) -> bool:
        if self.refused:
            self.transport.abort()  # (the client read why, and hung up)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lingers:
            self.server.lingering -= 1
        if not self.full:
            self.server.drop_partial(self)
            self.server._gone(self.conn_id)
