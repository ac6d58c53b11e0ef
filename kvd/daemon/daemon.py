"""The kvd daemon's composition root (daemon process): builds the parts, runs the process's life.

One asyncio loop (uvloop). `start` builds every part, each given its collaborators, in the
order they depend on each other: pool memory and its bookkeeping (`store/`), the local
server, the entry watch, the peer side (`peer/`: links, transfers, the ROUTER), the status
reader, the local handlers. Then it keeps house (expiry, deadlines, heartbeats, watchdog),
reloads what can change on SIGHUP, and on SIGTERM drains in-flight work before it releases
the pool and exits. No part below this module receives the Daemon.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Callable

import zmq

from kvd import __version__
from kvd.errors import BadRequest
from kvd.memory import check_fits_in_ram, open_staging_memory
from kvd.memory.faults import with_fault_injection
from kvd.memory.heap import keep_receive_buffers
from kvd.units import format_size
from kvd.wire.endpoints import tcp_address, unix_path

from .config import Config
from .exposure import check_exposure, warn_exposure
from .http import HttpEndpoint
from .lifecycle import Lifecycle
from .local.handlers import HelloInfo, LocalHandlers, LocalSettings
from .local.server import LocalServer
from .local.watch import EntryWatch
from .membership import Directory, RegistrySettings
from .metrics import Metrics
from .peer.auth import load_keys, start_authenticator
from .peer.peers import PeerSet, PeerSettings
from .peer.router import Router, RouterSettings
from .peer.transfers import Transfers, TransferSettings
from .plane.negotiation import PlaneHandshake
from .plane.nixl import start_plane
from .plane.poller import PlaneOps
from .socket_path import claim_socket_path
from .status import Status, StatusSettings
from .store.entries import Entry, Store
from .systemd import Notifier
from .tier.disk.level import claim_disk, disk_tier_for
from .tier.disk.media import Media
from .tier.homes import tier_peers_for
from .tier.page_store import CacheStore, SharedPool
from .tier.service import CacheCollector, CacheService

log = logging.getLogger(__name__)

HOUSEKEEPING_INTERVAL = 0.2  # seconds between expiry/deadline sweeps
RELOADABLE = {"peers", "log_level", "curve_allow"}  # what SIGHUP can change without a restart
# (SIGHUP also re-reads the files behind curve_allow, curve_deny and this node's cert)


class Daemon:
    def __init__(self, config: Config, reload_config: Callable[[], Config] | None = None) -> None:
        self.config = config
        self._reload_config = reload_config
        self.lifecycle = Lifecycle(config.node_id)
        self.metrics = Metrics()
        self.notifier = Notifier()
        self._stop_requested = asyncio.Event()
        # built by start(), in this order; stop() closes whatever was built
        self.memory = self.store = self.cache = self.disk = self.ctx = self.authenticator = self.plane = None
        self.directory: Directory | None = None
        self.curve = None  # our CURVE keys and allow list, when CURVE is on
        self.local: LocalServer | None = None
        self.peers: PeerSet | None = None
        self.transfers: Transfers | None = None
        self.router: Router | None = None
        self.handlers: LocalHandlers | None = None
        self._cache_service: CacheService | None = None
        self.http: HttpEndpoint | None = None
        self._housekeeping: asyncio.Task | None = None
        self._made_dirs: list[str] = []  # socket directories this start created

    # --- start ---------------------------------------------------------------------------------

    async def start(self) -> None:
        cfg, life = self.config, self.lifecycle
        keep_receive_buffers()
        max_clients, max_peer_connections = fit_connection_caps(
            raise_open_file_limit(cfg.max_clients + cfg.max_peer_connections), cfg.max_clients,
            cfg.max_peer_connections)
        # the cheap checks before the pool's prefault (seconds for a big pool)
        curve = self.curve = self._load_curve(cfg) if cfg.curve_secret_key else None
        check_exposure(cfg, curve is not None)  # a listener beyond loopback that nothing authenticates
        if cfg.device == "cpu":
            check_fits_in_ram(cfg.pool_size, cfg.pool_path, cfg.pool_overcommit)
        claim_socket_path(cfg.socket, self._made_dirs)  # before anything binds: a second daemon stops here
        disk_dir = claim_disk(cfg)  # --cache-dir ours alone, and not another daemon's
        self.memory = open_staging_memory(cfg.device, cfg.pool_size, cfg.pool_path, cfg.pool_prefault)
        if cfg.registry:  # the holder directory hears of every entry the store publishes or removes
            self.directory = Directory(RegistrySettings.of(cfg), life.incarnation, curve)
            if curve is not None:  # a node found in the registry is dialled under the key its cert names
                curve.registry_key = self.directory.key_of
        num_blocks = cfg.pool_size // cfg.block_size
        pool = SharedPool(num_blocks)  # handoffs and the KV tier share it; a handoff may evict tier pages
        self.cache = CacheStore(pool, cfg.block_size, cfg.cache_budget, cfg.cache_max_pages, cfg.cache_namespace_pages)
        self.disk = disk_tier_for(cfg, disk_dir, self.cache, self.memory)
        self.store = Store(pool, cfg.block_size, cfg.default_ttl or None,
                           on_published=self.directory.entry_published if self.directory else None,
                           on_removed=self.directory.entry_removed if self.directory else None,
                           max_entries=cfg.max_entries)
        self.ctx = zmq.Context(io_threads=cfg.io_threads)
        if curve is not None:
            self.authenticator = start_authenticator(self.ctx, curve)
        warn_exposure(cfg, curve is not None)
        self.local = LocalServer(max_clients)
        watch = EntryWatch(self.store, self.local, cfg.node_id, cfg.lease_timeout)
        # a one-sided data plane (--data-plane): the pool registered, offered in our hellos
        self.plane = start_plane(cfg.data_plane, cfg.node_id, life.incarnation, self.memory, tcp_address(cfg.listen)[0])
        handshake = (PlaneHandshake(cfg.data_plane, self.plane, lambda agent: self.transfers.plane.peer_gone(agent))
                     if self.plane is not None else None)
        self.peers = PeerSet(PeerSettings.of(cfg), self.ctx, life.incarnation, curve, self.metrics,
                             resolve=self.directory.endpoint_of if self.directory else None,
                             explain=self.directory.explain_missing if self.directory else None, plane=handshake)
        io = with_fault_injection(self.memory.io(cfg.chunk_size, cfg.window))
        self.transfers = Transfers(TransferSettings.of(cfg), self.store, io, self.metrics, watch, self.peers,
                                   plane_ops=PlaneOps.from_env(self.plane) if self.plane is not None else None)
        tier = tier_peers_for(cfg, self.cache, self.memory, self.peers, self.directory)  # pages homed elsewhere
        on_peer, on_link = self.transfers.on_message, self.transfers.on_link_message
        if tier is not None:  # (the tier's peer messages are answered there; the rest are transfers')
            on_peer, on_link = tier.wrap(on_peer), tier.wrap(on_link)
        self.router = Router(RouterSettings.of(cfg), self.ctx, curve, self.peers, self.metrics, life.incarnation,
                             on_gone=self.transfers.on_lost, max_connections=max_peer_connections)
        try:
            self.router.start(on_peer)
        except zmq.ZMQError as exc:
            raise BadRequest(bind_failure(f"listen for peers on {cfg.listen}", exc, "--listen")) from None
        self.peers.start(on_link, self.transfers.on_lost)
        status = Status(StatusSettings.of(cfg), life, self.store, self.transfers, self.peers, self.local, self.metrics,
                        self.router.bound_endpoint, __version__, self.directory)
        self.metrics.registry.register(status)
        self.metrics.registry.register(CacheCollector(self.cache))
        status.cache = self.cache
        hello = HelloInfo(cfg.node_id, life.incarnation, self.memory.client_path, cfg.pool_size, cfg.block_size,
                          cfg.device, self.memory.ipc_handle)
        self.handlers = LocalHandlers(LocalSettings(hello, cfg.lease_timeout, cfg.scratch_max), self.store, watch,
                                      self.transfers, self.metrics, self.local, life, stats=status.snapshot,
                                      directory=self.directory, tier_pages=self.cache)
        self.handlers.cache = self._cache_service = CacheService(self.cache, cfg.block_size, cfg.lease_timeout,
                                                                 self.handlers.ledger)
        self._cache_service.peers = tier
        self._cache_service.reply = lambda rid, msg: self.local.send(rid, msg)
        self._cache_service.disk = self.disk
        media = Media(self.cache, self.disk, (lambda: tier.counts) if tier is not None else None)
        self.metrics.registry.register(media)
        status.media = self._cache_service.media = media.as_dict
        if self.disk is not None:
            self.disk.start(tier)
        self._sweeper = Sweeper(self.store, watch, self.handlers.puts.write_expired, self.metrics)
        if cfg.metrics_port:  # before the client socket: once a client is answered, /healthz answers too
            self.http = HttpEndpoint(cfg.metrics_host, cfg.metrics_port, self.metrics.render, lambda: life.ready,
                                     self.directory)
            try:
                await self.http.start()
            except OSError as exc:
                raise BadRequest(bind_failure(f"serve metrics on {cfg.metrics_host}:{cfg.metrics_port}", exc,
                                              "--metrics-port", " (0 turns it off)")) from None
        try:
            await self.local.start(cfg.socket, self.handlers.on_local_message, self.handlers.on_client_gone)
        except OSError as exc:
            raise BadRequest(bind_failure(f"serve clients on {cfg.socket}", exc, "--socket")) from None
        if self.directory is not None:
            await self.directory.start()  # registers in the background: a registry away never holds us up
        self._housekeeping = asyncio.get_running_loop().create_task(self._keep_house(), name="housekeeping")
        life.ready = True
        self.notifier.notify(f"READY=1\nSTATUS=serving {cfg.socket}, peers on {self.router.bound_endpoint}")
        log.info("kvd %s ready: pool %s on %s (%d blocks of %s), clients on %s, peers on %s, %d peer(s) "
                 "configured, metrics %s%s", cfg.node_id, format_size(cfg.pool_size), cfg.device, num_blocks,
                 format_size(cfg.block_size), cfg.socket, self.router.bound_endpoint, len(cfg.peers),
                 f"on http://{cfg.metrics_host}:{self.http.port}/metrics" if self.http else "off",
                 curve_summary(curve) + (f", registry {self.directory.url} (registering in the background)"
                                         if self.directory else ""))

    @staticmethod
    def _load_curve(cfg: Config):
        return load_keys(cfg.curve_secret_key, list(cfg.curve_allow), ca_file=cfg.curve_ca, cert_file=cfg.curve_cert,
                         deny_file=cfg.curve_deny, cluster=cfg.cluster, node_id=cfg.node_id)

    # --- run and stop ----------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop_requested.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        try:
            await self.start()
            await self._stop_requested.wait()
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Refuse new work, let in-flight transfers finish (up to drain_timeout), then close."""
        life = self.lifecycle
        if life.draining:
            return
        served = life.ready  # (a start that failed has nothing to drain: its error is what the log should say)
        life.draining = True
        life.ready = False  # /readyz fails from the start of the drain: send no new work here
        self.notifier.notify("STOPPING=1")
        (log.info if served else log.debug)("kvd %s shutting down (draining up to %gs)", self.config.node_id,
                                            self.config.drain_timeout)
        if self.directory is not None:  # leave the registry first: nobody should pull from us any more
            try:
                await asyncio.wait_for(self.directory.stop(), 2.0)
            except (TimeoutError, Exception) as exc:  # (a registry away: our lease runs out by itself)
                log.warning("leaving the cluster registry failed: %s", exc)
        deadline = time.monotonic() + self.config.drain_timeout
        while self.transfers is not None and self.transfers.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.transfers is not None:
            await self.transfers.close()  # aborts what is left, telling peers
            for _ in range(3):  # let the requests waiting on those transfers send their errors
                await asyncio.sleep(0)
        if self.handlers is not None:
            await self.handlers.close()
        if self._cache_service is not None:
            await self._cache_service.close()
        if self.disk is not None:  # (RAM's pages not on disk yet written out; before the pool goes)
            await self.disk.close(self.config.drain_timeout)
        if self._housekeeping is not None:
            self._housekeeping.cancel()
            await asyncio.gather(self._housekeeping, return_exceptions=True)
        if self.http is not None:
            await self.http.close()
        if self.local is not None:
            self.local.close()
            path = unix_path(self.config.socket)
            if path is not None:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        if self.router is not None:
            self.router.close()
        if self.peers is not None:
            self.peers.close()
        if self.authenticator is not None:
            self.authenticator.stop()
        if self.ctx is not None:
            self.ctx.destroy(linger=500)  # closes any socket a failed start left open
        if self.plane is not None:  # (after every transfer and connection: nothing reaches it any more)
            self.plane.close()
        if self.memory is not None:
            self.memory.close()
        if not served:
            for made in self._made_dirs:  # (innermost first; only what is still empty)
                try:
                    os.rmdir(made)
                except OSError:
                    break
        (log.info if served else log.debug)("kvd %s stopped", self.config.node_id)

    # --- reload ------------------------------------------------------------------------------------

    def reload(self) -> None:
        """SIGHUP: re-read the configuration; apply peers and log level, report the rest. The parts
        keep what they were given: nothing they read can change while running."""
        if self._reload_config is None:
            log.warning("SIGHUP: this daemon was started without a reloadable configuration")
            return
        try:
            new = self._reload_config()
        except (ValueError, OSError) as exc:
            log.error("SIGHUP: configuration not reloaded: %s", exc)
            return
        old = self.config
        changed = {f.name for f in dataclasses.fields(Config) if getattr(old, f.name) != getattr(new, f.name)}
        fixed = sorted(changed - RELOADABLE)
        if fixed:
            log.warning("SIGHUP: %s cannot change while running; restart kvd to apply", ", ".join(fixed))
        self.config = dataclasses.replace(old, peers=dict(new.peers), log_level=new.log_level,
                                          curve_allow=new.curve_allow)
        if "log_level" in changed:
            logging.getLogger().setLevel(new.log_level.upper())
        keys_changed = self._reload_curve() if self.curve is not None else set()
        if keys_changed:
            changed.add("curve_allow")
        if ("peers" in changed or keys_changed) and self.peers is not None:
            self.peers.set_peers(self.config.peers, rekey=keys_changed)
        log.info("SIGHUP: configuration reloaded (%s)", ", ".join(sorted(changed & RELOADABLE)) or "no changes")

    def _reload_curve(self) -> set[str]:
        """Re-read the CURVE allow list, the deny list and this node's cert (files and directories:
        a node added, a key rotated or revoked, a cert renewed need no restart). The ZAP handler
        checks the same sets, changed in place (first the new keys are added, then the old ones
        dropped: no key allowed before and after is ever missing). Peers that are no longer
        admitted are cut at once, and their transfers fail. Returns the peer names whose key
        changed: their links are dialled again."""
        try:
            fresh = self._load_curve(self.config)
        except BadRequest as exc:
            log.error("SIGHUP: CURVE keys not reloaded: %s", exc)
            return set()
        curve = self.curve
        added, removed = fresh.allowed - curve.allowed, curve.allowed - fresh.allowed
        newly_denied = fresh.denied - curve.denied
        revoked = curve.take_out(fresh)  # (with a CA, which would still admit them)
        curve.listed = fresh.listed
        curve.allowed.update(fresh.allowed)
        curve.denied = fresh.denied
        if curve.authority is not None:
            curve.authority.denied = fresh.denied
        curve.names = fresh.names
        curve.allowed.intersection_update(fresh.allowed)
        rekeyed = {name for name in set(curve.peer_keys) | set(fresh.peer_keys)
                   if curve.peer_keys.get(name) != fresh.peer_keys.get(name)}
        curve.peer_keys.clear()
        curve.peer_keys.update(fresh.peer_keys)
        curve.unusable = fresh.unusable  # (why a cert beside ours gives no key: for the dial's error)
        if fresh.cert is not None and curve.cert is not None and fresh.cert.raw != curve.cert.raw:
            curve.signer = fresh.signer  # a renewed cert: new hellos show it, the registry record carries it
            if self.directory is not None:
                self.directory.renew(fresh.signer)
            log.info("SIGHUP: this node's cert renewed, valid until %s",
                     time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(fresh.cert.not_after)))
        if added or removed or rekeyed or newly_denied:
            log.info("SIGHUP: CURVE keys reloaded: %d key(s) added, %d removed, %d newly denied; peer keys changed "
                     "for %s", len(added), len(removed), len(newly_denied), ", ".join(sorted(rekeyed)) or "none")
        if revoked:
            log.warning("SIGHUP: %d key(s) taken out of --curve-allow are refused from now on, and their connections "
                        "cut, though the cluster CA still vouches for them: until they are put back or kvd restarts "
                        "(to keep them out after a restart, add them to --curve-deny): %s", len(revoked),
                        ", ".join(sorted(k.decode(errors="replace") for k in revoked)))
        if removed or newly_denied or revoked:
            if self.router is not None:
                self.router.readmit()  # cut whoever is connected to us and no longer admitted
            if self.peers is not None:  # and our links whose peer's key is now refused
                rekeyed |= self.peers.names_with_keys(newly_denied | revoked)
        return rekeyed | ({"*"} if added or removed or newly_denied or revoked else set())

    # --- housekeeping ------------------------------------------------------------------------------

    async def _keep_house(self) -> None:
        last_watchdog = 0.0
        expected = time.monotonic() + HOUSEKEEPING_INTERVAL
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL)
            now = time.monotonic()
            self.metrics.lag(max(0.0, now - expected))
            expected = now + HOUSEKEEPING_INTERVAL
            self._sweeper.sweep(now)
            self._cache_service.sweep(now)
            self.local.enforce(now)
            self.router.enforce(now)
            self.transfers.tick(now)
            self.peers.heartbeat(now, self.transfers.busy_channels())
            interval = self.notifier.watchdog_interval
            if interval and now - last_watchdog >= interval:
                self.notifier.notify("WATCHDOG=1")
                last_watchdog = now


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


# descriptors kept free beyond the connection caps: the pool, ZeroMQ's own, the metrics endpoint,
# peer links, files a reload reads
FD_HEADROOM = 512


def raise_open_file_limit(connections: int) -> int:
    """Raise the soft limit on open files to the hard limit: the default 1024 is exhausted by a few
    hundred idle clients or peers, and then every client is refused. Returns the new limit; warns
    when even the hard limit leaves no room for the configured connection caps."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return soft


MIN_CAP = 16  # connections of each kind a daemon takes however few descriptors it has


def fit_connection_caps(fd_limit: int, max_clients: int, max_peer_connections: int) -> tuple[int, int]:
    """The connection caps the open-file limit can honour, keeping FD_HEADROOM free: the configured
    ones when they fit; else both cut down in proportion (at least MIN_CAP each), with a warning,
    so that the descriptors run out for neither kind before its cap turns new ones away."""
    budget = fd_limit - FD_HEADROOM
    wanted = max_clients + max_peer_connections
    if wanted <= budget:
        return max_clients, max_peer_connections
    clients = max(MIN_CAP, budget * max_clients // wanted)
    peers = max(MIN_CAP, budget - clients)
    log.warning("the open-file limit (%d) leaves room for %d connections beside %d kept free, not max_clients + "
                "max_peer_connections = %d: serving at most %d clients and %d peer connections (raise "
                "LimitNOFILE / ulimit -n, or lower those)", fd_limit, max(budget, 0), FD_HEADROOM, wanted, clients,
                peers)
    return clients, peers


def curve_summary(curve) -> str:
    if curve is None:
        return ""
    ways = ([f"cluster CA, this node's cert valid until "
             f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(curve.cert.not_after))}"] if curve.authority else [])
    ways += [f"{len(curve.allowed)} allowed keys"] if curve.allowed else []
    ways += [f"{len(curve.denied)} denied"] if curve.denied else []
    return f", CURVE on ({', '.join(ways)})"


def bind_failure(what: str, exc: Exception, option: str, hint: str = "") -> str:
    """Why a listener did not start. A port in use may be anyone's: say so, and what to change."""
    import errno

    if getattr(exc, "errno", None) == errno.EADDRINUSE:
        return (f"cannot {what}: the port is in use (by another kvd or another program): choose another "
                f"port for {option}{hint}")
    return f"cannot {what}: {getattr(exc, 'strerror', None) or exc}"
