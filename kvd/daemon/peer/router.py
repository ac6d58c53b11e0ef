"""The peer-facing ROUTER (daemon process): the `--listen` socket other daemons connect to.

It decodes what arrives (the one decode site for this socket: an undecodable message is
answered with `abort` xfer 0 and counted), admits a connection once it said `peer_hello` (and,
without CURVE, only if it is not another user's on loopback), and hands every other message
of a known peer to the transfers, with the channel replies go back on (one per connection).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import zmq

from kvd.errors import KvdError, ProtocolError
from kvd.wire import protocol as p

from ..config import Config
from ..metrics import Metrics
from .auth import CurveKeys, make_server
from .channel import Channel
from .links import tune_peer_socket
from .loopsocket import LoopSocket
from .peers import PeerSet
from .tcpconn import TcpConnection, foreign_user, foreign_user_refusal

log = logging.getLogger(__name__)

REFUSED_CUT_DELAY = 0.1  # seconds: let the refusal's abort leave before the connection is cut


class Router:
    def __init__(self, config: Config, ctx: zmq.Context, curve: CurveKeys | None, peers: PeerSet,
                 metrics: Metrics, incarnation: int) -> None:
        self.config = config
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
        router.bind(self.config.listen)
        self.bound_endpoint = router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.socket = LoopSocket(router, self._on_frames, copy=False)

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close()

    def _channel(self, rid: bytes) -> Channel:
        return Channel(("router", rid), self.peers.router_name(rid), lambda frames, track: self.socket.send(
            [rid, *frames], copy=False, track=track), lambda: self.peers.cut_router(rid))

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
            self._hello(rid, msg, TcpConnection.of_fd(frames[1].get(zmq.SRCFD)))
            return
        if channel is None:
            self._channel(rid).send(p.Abort(xfer=getattr(msg, "xfer", 0), code=ProtocolError.code,
                                            message="say peer_hello first"))
            return
        self._on_message(channel, msg)

    def _hello(self, rid: bytes, msg: p.PeerHello, conn: TcpConnection | None) -> None:
        uid = None if self.curve is not None else foreign_user(conn)
        if uid is not None:
            refusal = foreign_user_refusal(uid, "this peer connection (on loopback)")
            log.warning("refused a peer connection from another user (%s) calling itself %s",
                        "unknown" if uid < 0 else f"uid {uid}", msg.node_id)
            self._channel(rid).send(p.Abort(xfer=0, code=refusal.code, message=refusal.message))
            asyncio.get_running_loop().call_later(REFUSED_CUT_DELAY, conn.cut)
            return
        channel = self.peers.router_channel(rid) or self._channel(rid)
        self.peers.router_hello(rid, msg, conn, channel)
        channel.peer_name = msg.node_id
        channel.send(p.PeerHelloOk(node_id=self.config.node_id, incarnation=self.incarnation))
