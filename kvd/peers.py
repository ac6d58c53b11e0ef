"""Connections to peer daemons, and the channel a transfer talks through.

Each daemon binds one ROUTER (`--listen`) for peers that connect to it, and opens one
DEALER per peer it connects to (`PeerLink`). A transfer does not care which of the two
carries it: it holds a `Channel` and sends frames; replies come back on the same path.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import zmq

from . import protocol as p
from .auth import CurveKeys, make_client
from .errors import PeerUnavailable
from .zsock import LoopSocket

log = logging.getLogger(__name__)

COPY_BELOW = (1 << 20) + 1  # bytes; frames up to 1 MiB are copied into ZeroMQ


def tune_peer_socket(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 500)  # let Abort messages out at shutdown, but not forever
    sock.setsockopt(zmq.SNDHWM, 0)  # flow control is the transfer window, not the HWM
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # ZMTP pings keep dead TCP connections from lingering
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    sock.setsockopt(zmq.HEARTBEAT_TTL, 6000)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
    sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_CHUNK_BYTES)  # a bigger frame is a broken peer: drop it
    # pyzmq copies frames smaller than this instead of lending them to libzmq; a lent frame's
    # release goes through pyzmq's garbage-collector thread (two more thread wake-ups), which
    # costs more than copying up to ~1 MiB here (64 KiB push 1.74 -> 1.51-1.57 ms, measured)
    sock.copy_threshold = COPY_BELOW


class Channel:
    """Where a transfer's messages go: a ROUTER routing id, or a DEALER link."""

    def __init__(self, key: tuple, peer_name: str, sender: Callable[[list, bool], asyncio.Future]) -> None:
        self.key = key  # identifies the connection, so a message on another one is refused
        self.peer_name = peer_name
        self._sender = sender

    def send(self, msg: p.Message, track: bool = False) -> asyncio.Future:
        """Queue a message; the future resolves (to a MessageTracker if track) once ZeroMQ took it."""
        return self._sender(p.encode(msg), track)


class PeerLink:
    """Our DEALER to one peer's ROUTER, with its handshake state."""

    def __init__(self, ctx: zmq.Context, name: str, endpoint: str, node_id: str, incarnation: int,
                 on_message: Callable[["PeerLink", p.Message], None], curve: CurveKeys | None = None,
                 on_restart: Callable[["PeerLink"], None] | None = None) -> None:
        self.name = name
        self.endpoint = endpoint
        self.remote_node_id: str | None = None
        self.remote_incarnation: int | None = None
        self._node_id = node_id
        self._incarnation = incarnation
        self._on_message = on_message
        sock = ctx.socket(zmq.DEALER)
        tune_peer_socket(sock)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue into a connection that is not up
        if curve is not None:
            make_client(sock, curve, name)
        self._on_restart = on_restart
        sock.connect(endpoint)
        self.socket = LoopSocket(sock, self._on_frames, copy=False)
        self.channel = Channel(("dealer", endpoint), name,
                               lambda frames, track: self.socket.send(frames, copy=False, track=track))
        self._hello: asyncio.Future | None = None
        self.connected = False
        self.last_seen = 0.0  # monotonic time of the last message from this peer

    def ping(self, now: float) -> None:
        """Heartbeat: a Ping when connected, a fresh hello otherwise (reconnects in the background)."""
        if self.socket.backlog:
            return  # the last one has not left yet: the peer is not reachable
        if self.connected:
            self.channel.send(p.Ping(nonce=int(now * 1000)))
        else:
            self.channel.send(p.PeerHello(node_id=self._node_id, incarnation=self._incarnation))

    async def ensure_ready(self, timeout: float) -> None:
        """Handshake once (again after a loss): PeerHello, wait for PeerHelloOk."""
        if self.connected:
            return
        if self._hello is None or self._hello.done():
            self._hello = asyncio.get_running_loop().create_future()
        hello = self._hello
        sent = self.channel.send(p.PeerHello(node_id=self._node_id, incarnation=self._incarnation))
        try:
            await asyncio.wait_for(asyncio.shield(hello), timeout)
        except asyncio.TimeoutError:
            if not sent.done():
                sent.cancel()  # never delivered: do not let it go out later
            raise PeerUnavailable(f"peer {self.name} ({self.endpoint}) did not answer within {timeout:g}s") from None

    def mark_lost(self) -> None:
        self.connected = False

    def _on_frames(self, frames: list) -> None:
        self.last_seen = time.monotonic()
        try:
            msg = p.decode([f.buffer for f in frames])
        except Exception as exc:
            log.warning("peer %s sent an undecodable message: %s", self.name, exc)
            return
        if isinstance(msg, p.PeerHelloOk):
            restarted = self.remote_incarnation is not None and self.remote_incarnation != msg.incarnation
            self.remote_node_id, self.remote_incarnation = msg.node_id, msg.incarnation
            if not self.connected:
                log.info("peer %s connected: node %s at %s", self.name, msg.node_id, self.endpoint)
            if restarted:
                log.warning("peer %s answered with a new incarnation: it restarted", self.name)
                if self._on_restart is not None:
                    self._on_restart(self)
            self.connected = True
            if self._hello is not None and not self._hello.done():
                self._hello.set_result(None)
            return
        if isinstance(msg, p.Pong):
            return
        if isinstance(msg, p.Abort) and msg.xfer == 0 and self.connected:
            # the peer does not know us (it restarted on the same address): introduce ourselves again
            log.warning("peer %s no longer knows us (%s); handshaking again", self.name, msg.message)
            self.connected = False
            self.channel.send(p.PeerHello(node_id=self._node_id, incarnation=self._incarnation))
            return
        self._on_message(self, msg)

    def close(self) -> None:
        self.socket.close()
