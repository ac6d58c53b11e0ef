"""The peer-facing ROUTER (daemon process): the `--listen` socket other daemons connect to.

It decodes what arrives (the one decode site for this socket: an undecodable message is
answered with `abort` xfer 0 and counted), admits a connection once it said `peer_hello` (and,
without CURVE, only if it is not another user's on this host; with CURVE, only as a node id its
key may claim), and hands every other message
of a known peer to the transfers, with the channel replies go back on (one per connection).
Which connections wait for a hello, which are admitted and which were refused is bookkeeping in
`admission.Admissions`; this module does the I/O around it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvd.errors import KvdError, ProtocolError, Unauthorized
from kvd.throttle import Throttle
from kvd.wire import protocol as p

from ..config import Config
from ..metrics import Metrics
from ..transfer.channel import Channel
from .admission import Admissions
from .auth import CurveKeys, make_server
from .links import tune_peer_socket
from .loopsocket import NOT_SENT, LoopSocket, Sent
from .owed import Account
from .peers import PeerSet
from .tcpconn import TcpConnection, foreign_user, foreign_user_refusal

log = logging.getLogger(__name__)

REFUSED_CUT_DELAY = 0.1  # seconds: let the refusal's abort leave before the connection is cut
# an abort's message quotes what was wrong, which can be what the peer sent (a type name of 64
# KiB): what goes back is cut to this many characters
MAX_ABORT_TEXT = 512


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """What the router reads of the daemon's configuration."""

    node_id: str
    listen: str
    max_connections: int
    connect_timeout: float

    @classmethod
    def of(cls, config: Config) -> RouterSettings:
        return cls(config.node_id, config.listen, config.max_peer_connections, config.connect_timeout)


class Router:
    """Bounded: at most max_peer_connections connections, each of which must say hello within
    connect_timeout; a peer whose send queue is full (it stopped reading) is cut. The socket
    monitor also says when a connection closes, so a peer that left is forgotten at once, not
    reported lost at the heartbeat timeout."""

    def __init__(self, settings: RouterSettings, ctx: zmq.Context, curve: CurveKeys | None, peers: PeerSet,
                 metrics: Metrics, incarnation: int, on_gone: Callable[[tuple, str], None] | None = None,
                 max_connections: int | None = None) -> None:
        self.settings = settings
        # --max-peer-connections, or fewer where the open-file limit cannot hold that many
        self.max_connections = settings.max_connections if max_connections is None else max_connections
        self._on_gone = on_gone or (lambda key, reason: None)
        self.admissions: Admissions[Unauthorized] = Admissions(self.max_connections, settings.connect_timeout,
                                                               time.monotonic)
        self._monitor: LoopSocket | None = None
        self._refusals = Throttle()
        self.ctx = ctx
        self.curve = curve
        self.peers = peers
        self.metrics = metrics
        self.incarnation = incarnation
        self.socket: LoopSocket | None = None
        self.bound_endpoint = ""
        self._on_message: Callable[[Channel, p.Message], None] = lambda channel, msg: None

    def start(self, on_message: Callable[[Channel, p.Message], None]) -> None:
        """Bind --listen; on_message gets every message of a peer that said hello."""
        self._on_message = on_message
        router = self.ctx.socket(zmq.ROUTER)
        tune_peer_socket(router)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished peer is an error, not silence
        if self.curve is not None:
            make_server(router, self.curve)
        router.bind(self.settings.listen)
        self.bound_endpoint = router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._monitor = LoopSocket(router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED),
                                   self._on_socket_event)
        self.socket = LoopSocket(router, self._on_frames, copy=False, fail_when_full=True)

    def close(self) -> None:
        if self.socket is not None and self._monitor is not None:  # (start made both)
            self.socket.sock.disable_monitor()
            self._monitor.close(linger=0)
            self.socket.close()

    def _channel(self, rid: bytes) -> Channel:
        """The channel to one connection. What ZeroMQ queues for it is capped twice: PEER_SNDHWM
        messages (ZeroMQ's own count: a send past it fails), and the bytes copied into ZeroMQ and
        not yet written to the kernel (an `owed.Account`: per connection, over all of them, and in
        time). Past either, the peer is not reading what it asked for, and its connection is cut:
        ZeroMQ drops what it held, the transfers on it fail as for a lost peer, and what is sent to
        it meanwhile is dropped here."""
        socket = self.socket
        assert socket is not None  # (a channel is for a connection that came in on it)
        peers = self.peers
        account = peers.owed.account(("router", rid), lambda: peers.router_name(rid),
                                     lambda: peers.router_connection(rid), lambda: peers.cut_router(rid),
                                     socket.sock.copy_threshold, self.curve is not None)
        backlog, taken, socket_send = account.backlog, account.taken, socket.send

        def send(frames: list, track: bool):
            if backlog.cut:
                return NOT_SENT
            sent = socket_send([rid, *frames], copy=False, track=track)
            if type(sent) is not Sent:  # not taken (yet): a full queue, or a connection gone
                sent.add_done_callback(lambda f: self._check_sent(f, account))
            else:
                taken(frames)
            return sent

        return RouterChannel(("router", rid), self.peers.router_name(rid), send,
                             lambda: self.peers.cut_router(rid))

    def _check_sent(self, sent, account: Account) -> None:
        if not sent.cancelled() and isinstance(sent.exception(), zmq.Again):
            self.peers.owed.cut(account, "its queue is full")

    # --- connections ------------------------------------------------------------------------------

    def _on_socket_event(self, frames: list) -> None:
        event = parse_monitor_message(frames)
        fd = event["value"]
        if event["event"] == zmq.EVENT_ACCEPTED:
            too_many = self.admissions.accepted(fd)
            if too_many is not None:
                self._cut_fd(fd, too_many)
            return
        rid = self.admissions.closed(fd)
        if rid is not None:  # a known peer closed its connection: its transfers end now
            name = self.peers.router_name(rid)
            if self.peers.router_forget(rid):
                log.info("peer %s (connected to us) disconnected", name)
                self._on_gone(("router", rid), f"peer {name} disconnected")

    def enforce(self, now: float) -> None:
        """Housekeeping: cut connections that did not say hello within connect_timeout, and, every
        READMIT_EVERY, peers whose cert has expired meanwhile; and peers that stopped reading."""
        self.peers.owed.enforce(now)
        if self.admissions.readmit_due():
            self.readmit()
        for fd, why in self.admissions.overdue():
            self._cut_fd(fd, why)

    def _cut_fd(self, fd: int, why: str) -> None:
        conn = TcpConnection.of_fd(fd)
        if conn is not None and conn.cut():
            log.info("closed a peer connection from %s:%d: %s", *conn.remote, why)

    def _refusal(self, msg: p.PeerHello, conn: TcpConnection | None, key: bytes | None) -> Unauthorized | None:
        """Why a peer saying this hello is not admitted (None: it is). Without CURVE: another user of
        this host; with CURVE: a key that may not call itself msg.node_id (kvd.daemon.peer.auth)."""
        if self.curve is None:
            uid = foreign_user(conn)
            if uid is None:
                return None
            if self._refusals.allow(uid):
                log.warning("refused a peer connection from another user (%s) calling itself %s (again at most "
                            "once a minute)", "unknown" if uid < 0 else f"uid {uid}", msg.node_id)
            return foreign_user_refusal(uid, "this peer connection (from this host)")
        why = self.curve.admits(key or b"", msg.node_id, msg.cert)
        if why is None:
            return None
        if self._refusals.allow((key, msg.node_id)):
            log.warning("refused a peer calling itself %s: %s (again at most once a minute)", msg.node_id[:128], why)
        return Unauthorized(f"this daemon does not admit a peer as {msg.node_id[:128]!r}: {why}")

    def _refuse(self, rid: bytes, refusal: Unauthorized, conn: TcpConnection | None) -> None:
        """Tell the peer why, then cut its connection (and forget it, if it had been admitted)."""
        (self.peers.router_channel(rid) or self._channel(rid)).send(
            p.Abort(xfer=0, code=refusal.code, message=refusal.message))
        self.admissions.refuse(rid, refusal)
        if conn is not None:
            asyncio.get_running_loop().call_later(REFUSED_CUT_DELAY, conn.cut)
        name = self.peers.router_name(rid)
        if self.peers.router_forget(rid):
            self._on_gone(("router", rid), f"peer {name} is no longer admitted: {refusal.message}")

    def readmit(self) -> None:
        """Check every admitted peer again (a key denied or no longer allowed, a cert expired): who
        fails is cut now, and its transfers end."""
        if self.curve is None:
            return
        for rid, (key, node_id, cert) in self.peers.router_identities().items():
            why = self.curve.admits(key, node_id, cert)
            if why is not None:
                log.warning("peer %s is no longer admitted (%s): connection cut", node_id, why)
                self._refuse(rid, Unauthorized(f"this daemon no longer admits {node_id!r}: {why}"),
                             self.peers.router_connection(rid))

    def _on_frames(self, frames: list) -> None:
        rid = frames[0].bytes
        self.peers.router_seen(rid)
        channel = self.peers.router_channel(rid)
        try:
            msg = p.decode([f.buffer for f in frames[1:]])
        except KvdError as exc:
            self.metrics.report_undecodable("peer", f"peer connection {self.peers.router_name(rid)}", exc, log)
            (channel or self._channel(rid)).send(p.Abort(xfer=0, code=exc.code, message=exc.message))
            return
        if isinstance(msg, p.PeerHello):
            # with CURVE, the key that passed ZeroMQ's handshake (the ZAP handler names it User-Id)
            key = frames[1].get("User-Id").encode() if self.curve is not None else None
            self._hello(rid, msg, TcpConnection.of_fd(frames[1].get(zmq.SRCFD)), key)
            return
        if channel is None:
            refused = self.admissions.refusal(rid)  # (a message already on its way when we cut the peer off)
            self._channel(rid).send(p.Abort(xfer=getattr(msg, "xfer", 0),
                                            code=refused.code if refused else ProtocolError.code,
                                            message=refused.message if refused else "say peer_hello first"))
            return
        self._on_message(channel, msg)

    def _hello(self, rid: bytes, msg: p.PeerHello, conn: TcpConnection | None, key: bytes | None) -> None:
        refusal = self._refusal(msg, conn, key)
        if refusal is not None:
            self._refuse(rid, refusal, conn)
            return
        channel = self.peers.router_channel(rid) or self._channel(rid)
        self.peers.router_hello(rid, msg, conn, channel, key)
        self.admissions.admitted(conn.fd if conn is not None else None, rid)
        channel.peer_name = msg.node_id
        channel.features = frozenset(f for f in msg.features if isinstance(f, str))
        plane = self.peers.plane
        unplaned = plane.admit(channel, msg.node_id, msg.incarnation, msg.plane) if plane is not None else None
        if unplaned is not None:  # (we require a plane this peer does not offer)
            self._refuse(rid, Unauthorized(unplaned.message), conn)
            return
        channel.send(p.PeerHelloOk(node_id=self.settings.node_id, incarnation=self.incarnation,
                                   features=list(p.FEATURES),
                                   plane=plane.offer() if plane is not None and channel.plane else None))


class RouterChannel(Channel):
    """A channel on the ROUTER: an abort's message is cut to MAX_ABORT_TEXT characters."""

    def send(self, msg: p.Message, track: bool = False):
        if type(msg) is p.Abort and len(msg.message) > MAX_ABORT_TEXT:
            msg = p.Abort(xfer=msg.xfer, code=msg.code, message=clip(msg.message))
        return super().send(msg, track)


def clip(text: str, limit: int = MAX_ABORT_TEXT) -> str:
    if len(text) <= limit:
        return text
    tail = f"... ({len(text)} characters)"
    return text[:limit - len(tail)] + tail
