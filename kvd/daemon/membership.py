"""The daemon's side of the cluster registry (daemon process): what this node says about itself
and its entries, and where it asks who holds a request.

Built only with `--registry`. It owns the `ClusterMember` (kvd.cluster: session, keepalive,
re-publication, the node watch), lists the entries the publish policy names as they become
complete and unlists them as they go (store hooks), and answers lookups. A registry answer is a
hint: the holder checks who it is (node id and incarnation, at the link's handshake) and which
entry it means (its generation, in the pull) before it serves a byte, so a stale record costs one
failed attempt, never wrong bytes. Losing the registry never stops the daemon: it runs on its
static peers meanwhile, and re-registers and re-publishes when the registry is back.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvd.cluster import Candidate, ClusterMember, HolderRecord, NodeRecord, open_backend
from kvd.cluster.signing import RecordSigner, RecordVerifier
from kvd.cluster.url import redact
from kvd.errors import BadRequest, PeerUnavailable
from kvd.throttle import Throttle
from kvd.wire.endpoints import is_loopback_endpoint
from kvd.wire.protocol import PROTOCOL_VERSION

from .config import Config
from .peer.auth import CurveKeys
from .store.entries import Entry, State

log = logging.getLogger(__name__)
LOCATE_CACHE = 0.5  # seconds a /cluster/locate answer is served again (routers ask the same id in bursts)
LOCATE_CACHE_KEEP = 1024
LOCATE_AT_ONCE = 16  # registry reads for locate in flight; past that, "try again"


@dataclass(frozen=True, slots=True)
class RegistrySettings:
    """What the directory reads of the daemon's configuration: the registry, and our node's record."""

    node_id: str
    cluster: str
    registry: str
    registry_ttl: float
    registry_publish: str
    password_file: str  # "": none
    ca_file: str
    cert_file: str
    key_file: str
    insecure: bool
    advertised: str
    role: str
    pool_size: int
    block_size: int
    labels: dict[str, str]
    device: str
    cache_budget: int

    @classmethod
    def of(cls, c: Config) -> RegistrySettings:
        return cls(c.node_id, c.cluster, c.registry, c.registry_ttl, c.registry_publish, c.registry_password_file,
                   c.registry_ca, c.registry_cert, c.registry_key, c.insecure, c.advertised, c.role, c.pool_size,
                   c.block_size, dict(c.labels), c.device, c.cache_budget)


class Directory:
    def __init__(self, config: RegistrySettings, incarnation: int, curve: CurveKeys | None) -> None:
        """With a cluster CA (`curve.authority`) our records are signed and only verified ones are
        believed. Without peer authentication only loopback endpoints are dialled (unless
        --insecure): a registry record cannot send this daemon's pushes off the host."""
        self.node_id = config.node_id
        self.cluster = config.cluster
        self.loopback_only = curve is None and not config.insecure
        self.incarnation = incarnation
        self.policy = config.registry_publish
        self.url = redact(config.registry)
        record = NodeRecord(
            node_id=config.node_id, incarnation=incarnation, endpoint=config.advertised, role=config.role,
            pool_bytes=config.pool_size, block_size=config.block_size, protocol=(PROTOCOL_VERSION, PROTOCOL_VERSION),
            curve_public=curve.public.decode() if curve else None, labels=dict(config.labels), started_at=time.time(),
            device=config.device, cache_bytes=config.cache_budget)
        try:
            backend = open_backend(config.registry, cluster=config.cluster,
                                   password_file=config.password_file, ca_file=config.ca_file,
                                   cert_file=config.cert_file, key_file=config.key_file)
        except (RuntimeError, ValueError) as exc:  # a backend's library missing; a bad TLS or password file
            raise BadRequest(f"--registry {redact(config.registry)}: {exc}") from None
        signed = curve is not None and curve.authority is not None and curve.signer is not None
        self.member = ClusterMember(backend, record, ttl=config.registry_ttl, snapshot=self.snapshot,
                                    signer=RecordSigner(curve.signer) if signed else None,
                                    verifier=RecordVerifier(curve.authority) if signed else None)
        self._refused_endpoints = Throttle()
        self._located: dict[str, tuple[float, list[dict]]] = {}  # request id -> (when, holders): /cluster/locate
        self._locating = 0
        self._listed: dict[str, HolderRecord] = {}  # request id -> the holder record we published

    def renew(self, signer) -> None:
        """SIGHUP brought a renewed cert (kvd.trust.NodeSigner): our records carry it from now on."""
        if self.member.signer is not None:
            self.member.renew(RecordSigner(signer))

    async def start(self) -> None:
        await self.member.start()  # returns at once: registration goes on in the background

    async def stop(self) -> None:
        """Leave the registry now (the lease is revoked): our node and holder records go with it."""
        await self.member.stop()

    # --- the holder directory (store hooks) ---------------------------------------------------------

    def entry_published(self, entry: Entry, received: bool) -> None:
        """An entry is complete here. `pullable` lists local puts with no destination (the pull
        mode's entries), never one a push already claims nor one received from a peer (its reader
        is here): the push mode costs no registry write. `all` lists every complete entry."""
        if self.policy == "none" or entry.state is not State.READY or (received and self.policy == "pullable"):
            return
        expires_at = None if entry.expires_at is None else time.time() + entry.expires_at - time.monotonic()
        record = HolderRecord(entry.request_id, self.node_id, self.incarnation, gen=entry.token,
                              nbytes=entry.total_bytes, state="complete", expires_at=expires_at)
        self._listed[entry.request_id] = record
        self.member.publish(record)

    def entry_removed(self, entry: Entry) -> None:
        record = self._listed.get(entry.request_id)
        if record is not None and record.gen == entry.token:
            del self._listed[entry.request_id]
            self.member.unpublish(entry.request_id, gen=entry.token)

    def snapshot(self) -> list[HolderRecord]:
        """Everything we list now (re-published after the registry lost it)."""
        return list(self._listed.values())

    # --- lookups ----------------------------------------------------------------------------------

    def endpoint_of(self, node_id: str) -> str | None:
        """Where a cluster node listens, as it published it (peers by name)."""
        node = self.member.node(node_id) if node_id != self.node_id else None
        if node is None:
            return None
        if self.loopback_only and not is_loopback_endpoint(node.endpoint):
            if self._refused_endpoints.allow(node_id):
                log.warning("not dialling node %s at %s, as its registry record says: without peer authentication "
                            "(CURVE) this daemon dials only loopback endpoints (set up a cluster CA, or --insecure)",
                            node_id, node.endpoint)
            return None
        return node.endpoint

    def explain_missing(self, node_id: str) -> str:
        """Why the registry named no endpoint for node_id: for the error of a push or pull to it."""
        status = self.member.status()
        if not status["up"] or (not status["registered"] and status["last_error"]):
            return (f"the cluster registry {self.url} is unreachable, so node ids cannot be looked up "
                    f"({status['last_error'] or 'no answer'})")
        if self.member.node(node_id) is not None:
            return f"node {node_id!r} is registered at an endpoint this daemon does not dial (see its log)"
        return (f"no node {node_id!r} is registered in the cluster registry {self.url} (cluster "
                f"{self.cluster!r}, {status['nodes']} nodes seen)")

    def key_of(self, node_id: str) -> bytes | None:
        """The CURVE key a node's verified cert names (None without a CA, or for an unknown node)."""
        cert = self.member.cert_of(node_id)
        return cert.curve_z85 if cert is not None else None

    async def holders(self, request_id: str, timeout: float, exclude: set[str]) -> list[Candidate]:
        """Holders of request_id other than us, best first, waiting up to timeout for one to be
        published; [] at the deadline. RegistryUnavailable (a PeerUnavailable) when it is down."""
        return await self.member.find(request_id, timeout, exclude=exclude)

    async def locate(self, request_id: str) -> list[dict]:
        """Who holds request_id (for /cluster/locate and `kvd cluster locate`): answered from a
        short-lived cache, with at most LOCATE_AT_ONCE registry reads in flight (past that, a
        PeerUnavailable to try again), so that callers cannot turn this daemon into a registry flood."""
        now = time.monotonic()
        cached = self._located.get(request_id)
        if cached is not None and now - cached[0] < LOCATE_CACHE:
            return cached[1]
        if self._locating >= LOCATE_AT_ONCE:
            raise PeerUnavailable(f"{LOCATE_AT_ONCE} registry lookups are in flight already: try again")
        self._locating += 1
        try:
            found = [{"node_id": c.node.node_id, "endpoint": c.node.endpoint, "gen": c.holder.gen,
                      "bytes": c.holder.nbytes, "state": c.holder.state} for c in await self.member.locate(request_id)]
        finally:
            self._locating -= 1
        if len(self._located) >= LOCATE_CACHE_KEEP:
            self._located.clear()
        self._located[request_id] = (now, found)
        return found

    def note_stale(self) -> None:
        self.member.note_stale()

    def nodes(self) -> list[dict]:
        return [{"node_id": n.node_id, "endpoint": n.endpoint, "role": n.role, "incarnation": f"{n.incarnation:x}",
                 "pool_bytes": n.pool_bytes, "cache_bytes": n.cache_bytes, "device": n.device, "labels": dict(n.labels),
                 "started_at": n.started_at} for n in self.member.nodes()]

    def status(self) -> dict:
        return {"url": self.url, "listed": len(self._listed), **self.member.status()}
