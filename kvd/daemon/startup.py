"""Building the daemon's parts (daemon process): every part made once, each given its collaborators
in its constructor, in the order they depend on each other.

`build` runs the cheap checks first (CURVE keys, exposure, the pool against RAM, the socket path and
--cache-dir claimed), then opens the pool memory and makes: the holder directory (`--registry`), the
KV tier's store and its disk level, the entry store, ZeroMQ with its authenticator, the one-sided
plane, the local server and the entry watch, the peer side (links, transfers, the tier's homes, the
ROUTER), the status reader, the tier's service, the local handlers, the expiry sweeper and the HTTP
endpoint. Nothing listens yet: `Daemon.start` starts them (and passes each the callbacks it needs
of a part built after it), `Daemon.stop` closes them. A part that fails to build closes the parts
made before it, in reverse order, and its error goes up. No part receives the Daemon.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvd import __version__
from kvd.memory import StagingMemory, check_fits_in_ram, open_staging_memory
from kvd.memory.faults import with_fault_injection
from kvd.wire.endpoints import tcp_address

from .config import Config
from .exposure import check_exposure, warn_exposure
from .http import HttpEndpoint
from .lifecycle import Lifecycle
from .local.handlers import HelloInfo, LocalHandlers, LocalSettings
from .local.ledger import LocalLedger
from .local.server import LocalServer
from .local.watch import EntryWatch
from .membership import Directory, RegistrySettings
from .metrics import Metrics
from .peer.auth import CurveKeys, load_keys, start_authenticator
from .peer.peers import PeerSet, PeerSettings
from .peer.router import Router, RouterSettings
from .peer.transfers import Transfers, TransferSettings
from .plane.negotiation import PlaneHandshake
from .plane.nixl import NixlPlane, start_plane
from .plane.poller import PlaneOps
from .socket_path import claim_socket_path
from .status import Status, StatusSettings
from .store.entries import Entry, Store
from .store.page_store import CacheStore, SharedPool
from .tier.disk.level import DiskTier, claim_disk, disk_tier_for
from .tier.disk.media import Media
from .tier.homes import TierPeers, tier_peers_for
from .tier.service import CacheCollector, CacheService

log = logging.getLogger(__name__)

PeerCallback = Callable[..., None]  # (a link or a ROUTER channel, the message)


@dataclass
class Parts:
    """What a running daemon is made of, as `build` made it."""

    curve: CurveKeys | None  # our CURVE keys and allow list, when CURVE is on
    memory: StagingMemory
    directory: Directory | None  # the cluster registry's side (--registry)
    cache: CacheStore  # the KV tier's pages in the pool
    disk: DiskTier | None  # the tier's disk level (--cache-dir)
    store: Store  # the handoffs' entries in the pool
    ctx: zmq.Context
    authenticator: ThreadAuthenticator | None
    plane: NixlPlane | None  # the one-sided data plane (--data-plane)
    handshake: PlaneHandshake | None  # what our hellos offer of it
    local: LocalServer
    watch: EntryWatch
    peers: PeerSet
    transfers: Transfers
    tier: TierPeers | None  # pages homed on other nodes (a registry and a host pool)
    router: Router
    status: Status
    tier_service: CacheService
    handlers: LocalHandlers
    sweeper: Sweeper
    http: HttpEndpoint | None  # metrics and health (--metrics-port)

    def peer_callbacks(self) -> tuple[PeerCallback, PeerCallback]:
        """What the ROUTER and the links are given at start: the tier's peer messages are answered
        by its homes, the rest are the transfers'."""
        on_peer, on_link = self.transfers.on_message, self.transfers.on_link_message
        if self.tier is not None:
            return self.tier.wrap(on_peer), self.tier.wrap(on_link)
        return on_peer, on_link


def load_curve(cfg: Config) -> CurveKeys:
    return load_keys(cfg.curve_secret_key, list(cfg.curve_allow), ca_file=cfg.curve_ca, cert_file=cfg.curve_cert,
                     deny_file=cfg.curve_deny, cluster=cfg.cluster, node_id=cfg.node_id)


async def build(cfg: Config, life: Lifecycle, metrics: Metrics, made_dirs: list[str],
                caps: tuple[int, int]) -> Parts:
    """Every part of the daemon, built; none started. made_dirs: the socket directories made here
    (taken away again by the caller, whose stop knows whether the daemon served); caps: the
    connection caps the open-file limit honours (clients, peer connections)."""
    async with contextlib.AsyncExitStack() as made:  # closes what was made, should a later part fail
        parts = _build(cfg, life, metrics, made_dirs, caps, made)
        made.pop_all()
        return parts


def checked(cfg: Config, made_dirs: list[str]) -> CurveKeys | None:
    """The cheap checks, before the pool's prefault (seconds for a big pool): our CURVE keys (None
    without CURVE), a listener beyond loopback that nothing authenticates, the pool against RAM, the
    socket path (before anything binds: a second daemon stops here)."""
    curve = load_curve(cfg) if cfg.curve_secret_key else None
    check_exposure(cfg, curve is not None)
    if cfg.device == "cpu":
        check_fits_in_ram(cfg.pool_size, cfg.pool_path, cfg.pool_overcommit)
    claim_socket_path(cfg.socket, made_dirs)
    return curve


def _build(cfg: Config, life: Lifecycle, metrics: Metrics, made_dirs: list[str], caps: tuple[int, int],
           made: contextlib.AsyncExitStack) -> Parts:
    """build's work: each part made, and its closer pushed on `made`."""
    curve = checked(cfg, made_dirs)
    claimed = claim_disk(cfg)  # --cache-dir ours alone, and not another daemon's
    if claimed is not None:
        made.callback(claimed.release)
    memory = open_staging_memory(cfg.device, cfg.pool_size, cfg.pool_path, cfg.pool_prefault)
    made.callback(memory.close)
    directory = None
    if cfg.registry:  # the holder directory hears of every entry the store publishes or removes
        directory = Directory(RegistrySettings.of(cfg), life.incarnation, curve)
        made.push_async_callback(leave_registry, directory)
    pool = SharedPool(cfg.pool_size // cfg.block_size)  # handoffs and the KV tier share it (a handoff evicts)
    cache = CacheStore(pool, cfg.block_size, cfg.cache_budget, cfg.cache_max_pages, cfg.cache_namespace_pages)
    disk = disk_tier_for(cfg, claimed, cache, memory)
    if disk is not None:
        made.push_async_callback(disk.close, cfg.drain_timeout)
    store = Store(pool, cfg.block_size, cfg.default_ttl or None,
                  on_published=directory.entry_published if directory else None,
                  on_removed=directory.entry_removed if directory else None, max_entries=cfg.max_entries)
    ctx = zmq.Context(io_threads=cfg.io_threads)
    made.callback(ctx.destroy, linger=500)  # (closes any socket a failed build left open)
    authenticator = start_authenticator(ctx, curve) if curve is not None else None
    if authenticator is not None:
        made.callback(authenticator.stop)
    warn_exposure(cfg, curve is not None)
    # a one-sided data plane (--data-plane): the pool registered, offered in our hellos
    plane = start_plane(cfg.data_plane, cfg.node_id, life.incarnation, memory, tcp_address(cfg.listen)[0])
    if plane is not None:
        made.callback(plane.close)
    # the peer side, the local side and the reports
    max_clients, max_peer_connections = caps
    local = LocalServer(max_clients)
    watch = EntryWatch(store, local, cfg.node_id, cfg.lease_timeout)
    handshake = PlaneHandshake(cfg.data_plane, plane) if plane is not None else None
    peers = PeerSet(PeerSettings.of(cfg), ctx, life.incarnation, curve, metrics,
                    resolve=directory.endpoint_of if directory else None,
                    explain=directory.explain_missing if directory else None, plane=handshake,
                    key_of=directory.key_of if directory else None)
    made.callback(peers.close)
    io = with_fault_injection(memory.io(cfg.chunk_size, cfg.window))
    transfers = Transfers(TransferSettings.of(cfg), store, io, metrics, watch, peers,
                          plane_ops=PlaneOps.from_env(plane) if plane is not None else None)
    made.push_async_callback(transfers.close)
    tier = tier_peers_for(cfg, cache, memory, peers, directory, disk)  # pages homed elsewhere
    router = Router(RouterSettings.of(cfg), ctx, curve, peers, metrics, life.incarnation,
                    on_gone=transfers.on_lost, max_connections=max_peer_connections)
    made.callback(router.close)
    media = Media(cache, disk, (lambda: tier.counts) if tier is not None else None)
    status = Status(StatusSettings.of(cfg), life, store, transfers, peers, local, metrics,
                    lambda: router.bound_endpoint, __version__, directory, cache=cache, media=media.as_dict)
    for collector in (status, CacheCollector(cache), media):
        metrics.registry.register(collector)
    ledger = LocalLedger(store, cache, cfg.lease_timeout)  # who holds what on the local side: handoffs and tier pages
    tier_service = CacheService(cache, cfg.block_size, cfg.lease_timeout, ledger, peers=tier, reply=local.send,
                                disk=disk, media=media.as_dict)
    made.push_async_callback(tier_service.close)
    hello = HelloInfo(cfg.node_id, life.incarnation, memory.client_path, cfg.pool_size, cfg.block_size, cfg.device,
                      memory.ipc_handle)
    handlers = LocalHandlers(LocalSettings(hello, cfg.lease_timeout, cfg.scratch_max), store, watch, transfers,
                             metrics, local, life, stats=status.snapshot, ledger=ledger, directory=directory,
                             tier_routes=tier_service.routes() if tier_service is not None else None)
    made.push_async_callback(handlers.close)
    http = (HttpEndpoint(cfg.metrics_host, cfg.metrics_port, metrics.render, lambda: life.ready, directory)
            if cfg.metrics_port else None)
    return Parts(curve=curve, memory=memory, directory=directory, cache=cache, disk=disk, store=store, ctx=ctx,
                 authenticator=authenticator, plane=plane, handshake=handshake, local=local, watch=watch, peers=peers,
                 transfers=transfers, tier=tier, router=router, status=status, tier_service=tier_service,
                 handlers=handlers, sweeper=Sweeper(store, watch, handlers.puts.write_expired, metrics), http=http)


async def leave_registry(directory: Directory) -> None:
    """Leave the registry (our lease revoked: our node and holder records go with it), within 2 s:
    a registry away lets our lease run out by itself."""
    try:
        await asyncio.wait_for(directory.stop(), 2.0)
    except (TimeoutError, Exception) as exc:
        log.warning("leaving the cluster registry failed: %s", exc)


class Sweeper:
    """Expiry (daemon process): what ran out of time in the store, and who must hear of it."""

    def __init__(self, store: Store, watch: EntryWatch, write_expired: Callable[[Entry], None],
                 metrics: Metrics) -> None:
        self.store, self.watch, self.write_expired, self.metrics = store, watch, write_expired, metrics

    def sweep(self, now: float) -> None:
        expired, abandoned, stale = self.store.sweep(now)
        for entry in expired:
            log.info("expired %s (ttl)", entry.request_id)
        self.metrics.expired.inc(len(expired))
        for entry in abandoned:
            log.warning("dropped %s: its writer did not finish within the lease", entry.request_id)
            self.write_expired(entry)
        self.metrics.abandoned.inc(len(abandoned))
        for lease in stale:
            self.watch.lease_expired(lease)
            log.warning("read lease on %s expired; entry given back", lease.request_id)
        self.metrics.lease_expiries.inc(len(stale))
