"""Who a daemon talks to, and whether they are still there (daemon process).

Outgoing links (one DEALER per configured peer name or tcp:// endpoint, created on first use),
peers that connected to our ROUTER (known once they said peer_hello), and liveness: every link is
pinged each heartbeat_interval, and a peer silent for heartbeat_timeout is declared lost, which
fails its transfers (the `on_lost` callback, given the channel key). Transfers live in
`transfers.py`; this module only names the channels they run on.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import zmq

from kvd.errors import BadRequest, PeerUnavailable
from kvd.wire import protocol as p

from ..config import Config
from ..metrics import Metrics
from ..plane.negotiation import PlaneHandshake
from ..transfer.channel import Channel
from .auth import CurveKeys
from .links import PeerLink
from .owed import Owed
from .tcpconn import TcpConnection

log = logging.getLogger(__name__)

# a link to a tcp:// endpoint that is not a configured peer (e.g. a decode pod's address from a
# request) is closed after this long unused: addresses come and go, and each link is three file
# descriptors and a reconnect attempt every 0.5 s for as long as it exists
ADHOC_IDLE = 60.0  # seconds

# a peer that sent no whole message for a while is still alive if its TCP connection moved at
# least this many bytes meanwhile: one chunk can take longer than heartbeat_timeout to cross a
# slow link, and the pings queue behind it. Far above what pings alone add (~50 B a second),
# which a frozen peer's kernel still acknowledges.
MIN_PROGRESS = 16 << 10  # bytes


@dataclass(frozen=True, slots=True)
class PeerSettings:
    """What the peer links read of the daemon's configuration (the peer list is set again on SIGHUP)."""

    node_id: str
    peers: dict[str, str]
    connect_timeout: float
    heartbeat_interval: float
    heartbeat_timeout: float

    @classmethod
    def of(cls, config: Config) -> PeerSettings:
        return cls(config.node_id, dict(config.peers), config.connect_timeout, config.heartbeat_interval,
                   config.heartbeat_timeout)


class PeerSet:
    """Built before the transfers (they find links here), and given their handlers at `start`."""

    def __init__(self, settings: PeerSettings, ctx: zmq.Context, incarnation: int, curve: CurveKeys | None,
                 metrics: Metrics | None = None, resolve: Callable[[str], str | None] | None = None,
                 explain: Callable[[str], str] | None = None, plane: PlaneHandshake | None = None,
                 key_of: Callable[[str], bytes | None] | None = None) -> None:
        """resolve: a node id -> its endpoint from the cluster registry; explain: why the registry
        gave none (unreachable, not registered, ...), for the error; plane: the one-sided plane our
        hellos offer (None: every link's bytes go as ZeroMQ frames); key_of: a node id -> the CURVE
        key its verified registry record names (for a node no NAME.key names)."""
        self._key_of = key_of
        self.settings = settings
        self.plane = plane
        self._explain = explain or (lambda name: "")
        self.metrics = metrics or Metrics()
        # a node id -> its published endpoint (the cluster registry), for names no --peer gives
        self._resolve = resolve or (lambda name: None)
        self._discovered: set[str] = set()  # links to nodes found through the registry
        self._configured: dict[str, str] = {}  # the peer list as last set (start, SIGHUP)
        self._unlinked: dict[str, str] = {}  # configured peer -> why it has no link (for kvd status)
        self.ctx = ctx
        self.incarnation = incarnation
        self.curve = curve
        self._on_message: Callable[[PeerLink, p.Message], None] = lambda link, msg: None
        self._on_lost: Callable[[tuple, str], None] = lambda key, reason: None
        self.links: dict[str, PeerLink] = {}  # peer name or endpoint -> link
        self._router_peers: dict[bytes, str] = {}  # routing id -> node id, after PeerHello
        self._router_seen: dict[bytes, float] = {}  # routing id -> last message
        self._router_conns: dict[bytes, TcpConnection] = {}  # routing id -> its TCP connection
        self._router_channels: dict[bytes, Channel] = {}  # routing id -> the channel replies go on
        self._router_identities: dict[bytes, tuple[bytes, str, bytes | None]] = {}  # routing id -> key, id, cert
        self._last_ping = 0.0
        # the bytes ZeroMQ holds for every peer connection (our links and connections to our ROUTER)
        self.owed = Owed(stall=settings.heartbeat_timeout)
        # a silent peer's connection -> the byte count it had when the silence began (see `_moving`)
        self._silent_since_bytes: dict[object, int] = {}

    # --- outgoing links ----------------------------------------------------------------------

    def start(self, on_message: Callable[[PeerLink, p.Message], None], on_lost: Callable[[tuple, str], None]) -> None:
        """Link the configured peers; on_message gets what links receive, on_lost (channel key,
        reason) says a connection is gone, so what runs on it fails."""
        self._on_message, self._on_lost = on_message, on_lost
        self.set_peers(dict(self.settings.peers))

    def _new_link(self, name: str, endpoint: str) -> PeerLink:
        return PeerLink(self.ctx, name, endpoint, self.settings.node_id, self.incarnation,
                        lambda link, msg: self._on_message(link, msg), self.curve, self._on_link_lost, self.metrics,
                        owed=self.owed, plane=self.plane, registry_key=self._key_of)

    def tear_down_plane(self, agent: str) -> None:
        """End the plane's connection to that agent and cut our connections with it: their handshakes,
        done again, bring it back (the transfers' operations towards it fail meanwhile)."""
        if self.plane is not None:
            self.plane.tear_down(agent)
        for link in self.links.values():
            if link.channel.plane_agent == agent:
                link.cut()
        for rid, channel in self._router_channels.items():
            if channel.plane_agent == agent and (conn := self._router_conns.get(rid)) is not None:
                conn.cut()

    def _on_link_lost(self, link: PeerLink, reason: str) -> None:
        """The connection to a peer closed, or the peer came back with a new incarnation:
        whatever we had in flight with it is gone."""
        self._on_lost(link.channel.key, reason)

    def link_for(self, dest: str) -> PeerLink:
        """A peer name from the config, a node of the cluster (found in the registry; a configured
        name wins), or a tcp:// endpoint: linked on first use."""
        link = self.links.get(dest)
        if link is not None and dest in self._discovered:
            endpoint = self._resolve(dest)
            if endpoint is not None and (endpoint != link.endpoint or self._rekeyed(dest, link)):
                self._forget(dest)  # the node came back elsewhere, or under another key (its new cert)
                link = None
        if link is None and dest.startswith("tcp://"):
            # the endpoint of a configured peer (or of a cluster node) is that peer: one link, and
            # under CURVE the key of its name
            link = self._named_link_at(dest)
            if link is None:
                self.links[dest] = link = self._new_link(dest, dest)
        elif link is None and dest in self._configured:  # configured, not linked (no key yet): say why
            self.links[dest] = link = self._new_link(dest, self._configured[dest])
        elif link is None and (endpoint := self._resolve(dest)) is not None:
            self.links[dest] = link = self._new_link(dest, endpoint)
            self._discovered.add(dest)
        if link is not None:
            link.last_used = time.monotonic()
            return link
        configured = ", ".join(sorted(self._configured)) or "none"
        why = self._explain(dest)
        raise PeerUnavailable(f"unknown peer {dest!r}: not a configured peer (--peer: {configured}) nor a tcp:// "
                              "endpoint; " + (why or "and this daemon has no cluster registry (--registry) to find "
                                                     "a node id in"))

    def _rekeyed(self, name: str, link: PeerLink) -> bool:
        if self.curve is None:
            return False
        try:
            return self.curve.server_key_for(name, self._key_of) != link.server_key
        except BadRequest:
            return False  # (no key for it any more: the dial that follows says so)

    def _named_link_at(self, endpoint: str) -> PeerLink | None:
        return next((link for name, link in self.links.items()
                     if link.endpoint == endpoint and not name.startswith("tcp://")), None)

    def _forget(self, name: str) -> None:
        self.links.pop(name).close()
        self._discovered.discard(name)
        self._silent_since_bytes.pop(name, None)

    def set_peers(self, peers: dict[str, str], rekey: Collection[str] = frozenset()) -> None:
        """Apply a reloaded peer list: new names are linked, removed ones closed; links named in
        `rekey` (their CURVE key changed; "*": the allow list did) are dialled again."""
        self._configured = dict(peers)
        self._unlinked.clear()
        for name in [n for n in self.links if n in rekey or ("*" in rekey and n not in peers)]:
            self._forget(name)
        for name in [n for n in self.links if not n.startswith("tcp://") and n not in self._discovered
                     and n not in peers]:
            self.links.pop(name).close()
            log.info("peer %s removed", name)
        for name, endpoint in peers.items():
            link = self.links.get(name)
            if link is not None and (link.endpoint != endpoint or name in self._discovered):
                self._forget(name)  # (a configured name wins over a node found in the registry)
                link = None
            if link is None:
                try:
                    self.links[name] = self._new_link(name, endpoint)
                except BadRequest as exc:  # (no CURVE key for it: a push to it says so; a reload may fix it)
                    log.error("peer %s is not linked: %s", name, exc)
                    self._unlinked[name] = exc.message
                    continue
                log.info("peer %s added at %s", name, endpoint)

    def states(self) -> dict[str, dict]:
        states = {
            name: {"endpoint": link.endpoint, "connected": link.connected, "node_id": link.remote_node_id}
            for name, link in self.links.items()
        }
        for name in self._configured.keys() - states.keys():  # configured, never linked (no CURVE key for it)
            states[name] = {"endpoint": self._configured[name], "connected": False, "node_id": None,
                            "not_linked": self._unlinked.get(name, "not linked")}
        return states

    def close(self) -> None:
        for link in self.links.values():
            link.close()

    # --- peers connected to our ROUTER ---------------------------------------------------------

    def router_name(self, rid: bytes) -> str:
        return self._router_peers.get(rid, rid.hex())

    def router_channel(self, rid: bytes) -> Channel | None:
        """The channel of a peer connected to our ROUTER, once it said hello."""
        return self._router_channels.get(rid)

    def router_known(self, rid: bytes) -> bool:
        """Has this connection said peer_hello? (Anything else from it before that is refused.)"""
        return rid in self._router_peers

    def _moving(self, key: object, conn: TcpConnection | None, silent_for: float) -> bool:
        """Whether a peer silent for `silent_for` seconds is still moving bytes (MIN_PROGRESS since
        its silence began, counted by the kernel: acknowledged by it, or received from it)."""
        if silent_for <= self.settings.heartbeat_interval or conn is None:
            self._silent_since_bytes.pop(key, None)
            return False
        moved = conn.progress()
        if moved is None:
            return False
        since = self._silent_since_bytes.setdefault(key, moved)
        if moved - since < MIN_PROGRESS:
            return False
        self._silent_since_bytes[key] = moved
        return True

    def router_seen(self, rid: bytes) -> None:
        if rid in self._router_peers:
            self._router_seen[rid] = time.monotonic()

    def router_hello(self, rid: bytes, msg: p.PeerHello, conn: TcpConnection | None, channel: Channel,
                     key: bytes | None = None) -> None:
        if self._router_peers.get(rid) != msg.node_id:
            log.info("peer %s (incarnation %x) connected to us", msg.node_id[:128], msg.incarnation)
        self._router_peers[rid] = msg.node_id
        if key is not None:  # who it proved to be, for the checks a reload or an expiry makes again
            self._router_identities[rid] = (key, msg.node_id, msg.cert)
        self._router_seen[rid] = time.monotonic()
        self._router_channels[rid] = channel
        if conn is not None:
            self._router_conns[rid] = conn

    def router_forget(self, rid: bytes) -> bool:
        """A peer's connection to our ROUTER closed: forget it (False if it was not known)."""
        self._router_seen.pop(rid, None)
        self._silent_since_bytes.pop(rid, None)
        self._router_conns.pop(rid, None)
        self._router_channels.pop(rid, None)
        self._router_identities.pop(rid, None)
        self.owed.forget(("router", rid))
        return self._router_peers.pop(rid, None) is not None

    def router_identities(self) -> dict[bytes, tuple[bytes, str, bytes | None]]:
        """Routing id -> (CURVE key, node id, cert) of every peer admitted under CURVE."""
        return dict(self._router_identities)

    def router_connection(self, rid: bytes) -> TcpConnection | None:
        return self._router_conns.get(rid)

    def names_with_keys(self, keys: frozenset[bytes] | set[bytes]) -> set[str]:
        """Our links to peers whose CURVE key is among keys (a reload denied them)."""
        return {name for name, link in self.links.items() if link.server_key in keys}

    def cut_router(self, rid: bytes) -> bool:
        """Cut the TCP connection of a peer connected to our ROUTER (ZeroMQ then drops it and the
        frames it still had queued for it)."""
        conn = self._router_conns.get(rid)
        return conn is not None and conn.cut()

    # --- liveness -----------------------------------------------------------------------------

    def heartbeat(self, now: float, busy: set[tuple]) -> None:
        """Ping every linked peer; a peer silent past heartbeat_timeout is lost. Ad-hoc links
        unused for ADHOC_IDLE with no transfer on them (`busy`: channel keys in use) are closed."""
        cfg = self.settings
        idle = max(ADHOC_IDLE, 2 * cfg.connect_timeout)  # never under a transfer still waiting for its hello
        # links to nodes found in the registry go idle the same way: a cluster of 100 nodes must not
        # mean a full mesh of heartbeats (about 10k messages a second)
        for name in [n for n, link in self.links.items() if (n.startswith("tcp://") or n in self._discovered)
                     and now - link.last_used > idle and link.channel.key not in busy]:
            self._forget(name)
            log.info("closed the idle link to %s", name)
        if now - self._last_ping >= cfg.heartbeat_interval:
            self._last_ping = now
            for link in self.links.values():
                link.ping(now)
        for link in self.links.values():
            if link.connected and self._moving(link.name, link.connection, now - link.last_seen):
                link.last_seen = now
            if link.connected and now - link.last_seen > cfg.heartbeat_timeout:
                log.warning("peer %s lost: silent for %.1fs", link.name, now - link.last_seen)
                link.mark_lost()
                self._on_lost(link.channel.key, f"peer {link.name} stopped answering")
        for rid, seen in list(self._router_seen.items()):
            if self._moving(rid, self._router_conns.get(rid), now - seen):
                self._router_seen[rid] = seen = now
            if now - seen > cfg.heartbeat_timeout:
                del self._router_seen[rid]
                self._silent_since_bytes.pop(rid, None)
                conn = self._router_conns.pop(rid, None)
                if conn is not None:  # (ZeroMQ would keep its connection, and what it holds for it)
                    conn.cut()
                self.owed.forget(("router", rid))
                self._router_channels.pop(rid, None)
                self._router_identities.pop(rid, None)
                name = self._router_peers.pop(rid, rid.hex())
                log.warning("peer %s (connected to us) lost: silent for %.1fs; connection closed", name, now - seen)
                self._on_lost(("router", rid), f"peer {name} stopped answering")
