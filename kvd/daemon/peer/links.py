"""Our connections to peer daemons (daemon process): one DEALER link per peer.

Each daemon binds one ROUTER (`--listen`) for peers that connect to it, and opens one
DEALER per peer it connects to (`PeerLink`). A transfer does not care which of the two
carries it: it holds a `Channel` and sends frames; replies come back on the same path.
Whether a link is up, and what a wait for it gets, is decided by its `handshake.Handshake`.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvd.errors import KvdError, PeerUnavailable, Unauthorized
from kvd.throttle import Throttle
from kvd.wire import protocol as p

from ..metrics import Metrics
from ..plane.negotiation import PlaneHandshake
from ..transfer.channel import Channel, Sending
from .auth import CurveKeys, make_client
from .link_state import (
    Action,
    Answered,
    Closed,
    Expired,
    Fail,
    Forgotten,
    Forward,
    Handshake,
    Heartbeat,
    Log,
    Lost,
    Redial,
    Refused,
    Resolve,
    Retrying,
    SendHello,
    SendPing,
    Silent,
    StartTimer,
    State,
    Wait,
)
from .loopsocket import NOT_SENT, LoopSocket
from .owed import PEER_QUEUE_BYTES, Owed  # noqa: F401  (PEER_QUEUE_BYTES: read here by tests)
from .tcpconn import TcpConnection, foreign_user, foreign_user_refusal

log = logging.getLogger(__name__)
_REFUSALS = Throttle()  # (peer name, why) -> last logged: a refused link says so once a minute

COPY_BELOW = (1 << 20) + 1  # bytes; frames up to 1 MiB are copied into ZeroMQ
# ZeroMQ's own handshake (ZMTP, and CURVE's key exchange and ZAP check) happens before any kvd
# message; these socket-monitor events are the only sign that a peer refused us there
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
PEER_SNDHWM = 10_000  # messages queued for one peer connection


def tune_peer_socket(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 500)  # let Abort messages out at shutdown, but not forever
    # flow control is the transfer window, not the HWM; the HWM only bounds how many messages a peer
    # that stops reading can make us queue for it (chunks in flight are at most a few windows'
    # worth), not their bytes: those are counted per connection (owed.Owed: PEER_QUEUE_BYTES)
    sock.setsockopt(zmq.SNDHWM, PEER_SNDHWM)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # ZMTP pings keep dead TCP connections from lingering
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    sock.setsockopt(zmq.HEARTBEAT_TTL, 6000)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)  # a restarted peer is found again within 0.5 s
    sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_CHUNK_BYTES)  # a bigger frame is a broken peer: drop it
    # pyzmq copies frames smaller than this instead of lending them to libzmq; a lent frame's
    # release goes through pyzmq's garbage-collector thread (two more thread wake-ups), which
    # costs more than copying up to ~1 MiB here (measured: bench/RESULTS.md, "Figures moved out
    # of docstrings")
    sock.copy_threshold = COPY_BELOW


class PeerLink:
    """Our DEALER to one peer's ROUTER: the shell of its handshake (`handshake.Handshake`), which
    decides; this class feeds it what the sockets and timers saw and carries out its actions."""

    def __init__(self, ctx: zmq.Context, name: str, endpoint: str, node_id: str, incarnation: int,
                 on_message: Callable[[PeerLink, p.Message], None], curve: CurveKeys | None = None,
                 on_lost: Callable[[PeerLink, str], None] | None = None, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.monotonic, owed: Owed | None = None,
                 plane: PlaneHandshake | None = None,
                 registry_key: Callable[[str], bytes | None] | None = None) -> None:
        """registry_key: a cluster node's CURVE key from its verified registry record (for a peer
        that no NAME.key names)."""
        self._metrics = metrics or Metrics()
        self._plane = plane  # our one-sided plane, offered in our hello (None: ZeroMQ's frames only)
        self.name = name
        self.endpoint = endpoint
        self.handshake = Handshake(name, endpoint, clock)
        self._node_id = node_id
        self._incarnation = incarnation
        self._on_message = on_message
        sock = ctx.socket(zmq.DEALER)
        tune_peer_socket(sock)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue into a connection that is not up
        # the key the peer must prove it holds (CURVE), None without CURVE: what a revocation looks for
        self.server_key = make_client(sock, curve, name, registry_key) if curve is not None else None
        self._curve = curve is not None
        self._cert = curve.cert.raw if curve is not None and curve.cert is not None else None
        self._on_lost = on_lost  # (link, why): whatever was in flight on this link is gone
        self._monitor = LoopSocket(sock.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_DISCONNECTED),
                                   self._on_socket_event)
        sock.connect(endpoint)
        self.channel = Channel(("dealer", endpoint), name, self._send, self.cut)
        self.connection: TcpConnection | None = None  # the TCP connection the last hello answer came on
        # what ZeroMQ holds for the peer, counted: a peer that sends requests on our link and never
        # reads the answers is cut as one connected to our ROUTER is (owed.Owed)
        self._owed = owed or Owed()
        self._account = self._owed.account(self.channel.key, lambda: self.name, lambda: self.connection, self.cut,
                                           sock.copy_threshold, self._curve)
        self.socket = LoopSocket(sock, self._on_frames, copy=False, on_taken=self._account.taken)
        # what this shell keeps of each waiter, by the handshake's waiter id
        self._waiter_ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._hellos: dict[int, Sending] = {}  # a waiter's hello send: called back if it gives up
        self._now = 0.0  # the heartbeat's time, for a ping's nonce
        self.last_seen = 0.0  # monotonic time of the last message from this peer
        self.last_used = time.monotonic()  # when a transfer last asked for this link

    # --- what the rest of the daemon reads ----------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self.handshake.state is State.UP

    @property
    def refusal(self) -> KvdError | None:
        """Why the last handshake failed, until one succeeds."""
        return self.handshake.refusal

    @property
    def remote_node_id(self) -> str | None:
        return self.handshake.node_id

    @property
    def remote_incarnation(self) -> int | None:
        return self.handshake.incarnation

    # --- events in ----------------------------------------------------------------------------------

    def ping(self, now: float) -> None:
        """Heartbeat: a Ping when connected, a fresh hello otherwise (reconnects in the background)."""
        self._now = now
        self._do(self.handshake.handle(Heartbeat(backlog=bool(self.socket.backlog))))

    def ready(self, timeout: float) -> asyncio.Future:
        """Handshake once (again after a loss): a future that resolves once the peer answered our
        PeerHello (at once when it has), or fails within timeout with the reason it did not (within
        DOWN_GRACE when the link is known down)."""
        result = asyncio.get_running_loop().create_future()
        if self.handshake.state is State.UP:
            # the table's (up, Wait) row, resolve, taken here without a waiter id: every push asks
            # this of a link that is up, and the whole walk costs ~10 us more (measured) than this
            result.set_result(None)
            return result
        waiter = next(self._waiter_ids)
        self._waiting[waiter] = result
        self._do(self.handshake.handle(Wait(waiter, timeout)))
        return result

    async def ensure_ready(self, timeout: float) -> None:
        await self.ready(timeout)

    def mark_lost(self) -> None:
        """The heartbeat heard nothing for heartbeat_timeout (it fails what ran on the link)."""
        self._do(self.handshake.handle(Silent()))

    def _on_socket_event(self, frames: list) -> None:
        """ZeroMQ's monitor: the TCP connection closed (ZeroMQ reconnects by itself, but the peer
        will not know the new connection, and a transfer cannot move to it: what ran on the link
        fails now, not at the heartbeat timeout), or ZeroMQ's handshake failed: refused by the
        peer (ZAP said no, or the mechanisms differ: a waiter fails at once, with the reason), or
        cut off without detail (a connection error ZeroMQ retries: the reason is kept for the
        timeout's message)."""
        event = parse_monitor_message(frames)
        if event["event"] == zmq.EVENT_DISCONNECTED:
            self._owed.released(self.channel.key)  # (with IMMEDIATE, its queue went with it)
            self._account.backlog.cut = False  # (a cut one: what is sent now waits for the next connection)
            self._do(self.handshake.handle(Closed()))
            return
        refusal = handshake_refusal(self.name, self.endpoint, event["event"], event["value"], self._curve)
        if self.refusal is None or self.refusal.message != refusal.message:
            log.warning("%s", refusal.message)
        # ZeroMQ drops a connection for good once the peer refused its handshake (it redials only
        # after network errors), so the link dials again itself: the peer may be fixed
        self._do(self.handshake.handle(Retrying(refusal) if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                       else Refused(refusal, redial=True)))

    def _on_frames(self, frames: list) -> None:
        self.last_seen = time.monotonic()
        try:
            msg = p.decode([f.buffer for f in frames])
        except KvdError as exc:  # the one decode site of this socket: counted, answered, never raised
            self._metrics.report_undecodable("peer", f"peer {self.name}", exc, log)
            self.channel.send(p.Abort(xfer=0, code=exc.code, message=exc.message))
            return
        if isinstance(msg, p.PeerHelloOk):
            self.connection = TcpConnection.of_fd(frames[0].get(zmq.SRCFD))
            uid = None if self._curve else foreign_user(self.connection)
            if uid is not None:  # another user's process listens there: never send it a cache
                refusal = foreign_user_refusal(uid, f"the listener of peer {self.name} ({self.endpoint})")
                log.warning("%s", refusal.message)
                self.cut()
                self._do(self.handshake.handle(Refused(refusal, redial=False)))
                return
            self.channel.features = frozenset(f for f in msg.features if isinstance(f, str))
            unplaned = self._plane.admit(self.channel, msg.node_id, msg.incarnation, msg.plane) if self._plane else None
            if unplaned is not None:  # (we require a plane this peer does not offer)
                log.warning("%s", unplaned.message)
                self._do(self.handshake.handle(Refused(unplaned, redial=False)))
                return
            self._do(self.handshake.handle(Answered(msg.node_id, msg.incarnation)))
        elif isinstance(msg, p.Pong):
            return
        elif isinstance(msg, p.Abort) and msg.xfer == 0 and msg.code == Unauthorized.code:
            refusal = Unauthorized(f"peer {self.name} ({self.endpoint}) refused this daemon: {msg.message}")
            if _REFUSALS.allow((self.name, msg.message)):  # (the link re-hellos each second: once a minute)
                log.warning("%s (again at most once a minute)", refusal.message)
            self._do(self.handshake.handle(Refused(refusal, redial=False)))
        elif isinstance(msg, p.Abort) and msg.xfer == 0:  # (up: the peer restarted on the same address)
            self._do(self.handshake.handle(Forgotten(msg.message)), msg)
        else:
            self._on_message(self, msg)

    # --- actions out --------------------------------------------------------------------------------

    def _do(self, actions: list[Action], msg: p.Message | None = None) -> None:
        for action in actions:
            match action:
                case SendHello(waiter=waiter):
                    sent = self.channel.send(self._hello_msg())
                    if waiter is not None:
                        self._hellos[waiter] = sent
                case SendPing():
                    self.channel.send(p.Ping(nonce=int(self._now * 1000)))
                case StartTimer(waiter=waiter, after=after):
                    self._timers[waiter] = asyncio.get_running_loop().call_later(after, self._expired, waiter)
                case Resolve() | Fail():
                    self._end_wait(action)
                case Lost(reason=reason):
                    if self._on_lost is not None:
                        self._on_lost(self, reason)
                case Redial():
                    self._redial()
                case Forward():
                    if msg is not None:
                        self._on_message(self, msg)
                case Log(warning=warning, text=text):
                    (log.warning if warning else log.info)("%s", text)

    def _expired(self, waiter: int) -> None:
        self._do(self.handshake.handle(Expired(waiter)))

    def _end_wait(self, action: Resolve | Fail) -> None:
        timer, sent = self._timers.pop(action.waiter, None), self._hellos.pop(action.waiter, None)
        result = self._waiting.pop(action.waiter)
        if timer is not None:
            timer.cancel()
        if type(action) is Fail:
            if sent is not None and not sent.done():
                sent.cancel()  # never delivered: do not let it go out later
            if not result.done():
                result.set_exception(action.error)
        elif not result.done():
            result.set_result(None)

    def _hello_msg(self) -> p.PeerHello:
        return p.PeerHello(node_id=self._node_id, incarnation=self._incarnation, features=list(p.FEATURES),
                           cert=self._cert, plane=self._plane.offer() if self._plane is not None else None)

    def _redial(self) -> None:
        sock = self.socket.sock
        try:
            sock.disconnect(self.endpoint)
        except zmq.ZMQError:
            pass  # already forgotten
        sock.connect(self.endpoint)

    def _send(self, frames: list, track: bool) -> Sending:
        if self._account.backlog.cut:  # (cut for not reading, and ZeroMQ has not seen it yet)
            return NOT_SENT
        return self.socket.send(frames, copy=False, track=track)

    def cut(self) -> bool:
        """Cut our TCP connection to the peer: ZeroMQ drops the frames queued on it (with
        IMMEDIATE, a DEALER discards its queue with the connection) and dials again."""
        conn, self.connection = self.connection, None  # (its descriptor may be another's soon)
        return conn is not None and conn.cut()

    def close(self) -> None:
        self._owed.forget(self.channel.key)
        self.socket.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.socket.close()


def handshake_refusal(name: str, endpoint: str, event: int, value: int, curve: bool) -> KvdError:
    """The error a put or get to this peer reports when ZeroMQ's handshake with it failed."""
    where = f"peer {name} ({endpoint})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # value: the ZAP status code (400: key not allowed)
        return Unauthorized(f"{where} refused this daemon's CURVE key (ZAP status {value}): add this node's "
                            "public key (its .key file from `kvd keygen`) to that peer's --curve-allow")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        mine, theirs = ("on", "off") if curve else ("off", "on")
        return Unauthorized(f"{where} has CURVE {theirs} and this daemon has it {mine}: set --curve-secret-key "
                            "on every daemon or on none")
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and curve:
        return Unauthorized(f"the CURVE handshake with {where} failed: most likely its key pair is not the one "
                            f"whose public key this daemon has for it ({name}.key among --curve-allow)")
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # value: an errno (the peer hung up on us)
        return PeerUnavailable(f"the ZeroMQ handshake with {where} failed ({os.strerror(value)}): a peer with CURVE "
                               "on hangs up on daemons without --curve-secret-key; or that is not a kvd daemon")
    return PeerUnavailable(f"the ZeroMQ handshake with {where} failed (monitor event {event:#x}, value {value:#x})")
