"""The kvd daemon's process (daemon process): builds the parts, starts them, runs the process's life.

One asyncio loop (uvloop). `start` has `startup.build` make every part, each given its
collaborators, then starts them: the peer side (the ROUTER and the links), the disk level, the HTTP
endpoint, the client socket, the registration. Then it keeps house (expiry, deadlines, heartbeats,
watchdog), reloads what can change on SIGHUP, and on SIGTERM drains in-flight work before it
releases the pool and exits. No part below this module receives the Daemon.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Callable

import zmq

from kvd.errors import BadRequest
from kvd.memory.heap import keep_receive_buffers
from kvd.units import format_size
from kvd.wire.endpoints import unix_path

from .config import Config
from .lifecycle import Lifecycle
from .metrics import Metrics
from .peer.auth import CurveKeys
from .startup import Parts, build, leave_registry, load_curve
from .systemd import Notifier

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
        self.parts: Parts | None = None  # built by start(); stop() closes them
        self._housekeeping: asyncio.Task | None = None
        self._made_dirs: list[str] = []  # socket directories this start created

    # --- start ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Build every part, then start them."""
        cfg = self.config
        keep_receive_buffers()  # (the process's malloc: before the first big receive)
        caps = fit_connection_caps(raise_open_file_limit(cfg.max_clients + cfg.max_peer_connections),
                                   cfg.max_clients, cfg.max_peer_connections)
        self.parts = await build(cfg, self.lifecycle, self.metrics, self._made_dirs, caps)
        await self._serve(self.parts)

    async def _serve(self, parts: Parts) -> None:
        """Start the parts, each given the callbacks it needs of parts built after it; the client
        socket last but the registration: once a client is answered, everything answers."""
        cfg, life = self.config, self.lifecycle
        if parts.handshake is not None:  # (a peer's agent gone for good: the transfers let go of it)
            parts.handshake.start(parts.transfers.plane.peer_gone)
        on_peer, on_link = parts.peer_callbacks()
        try:
            parts.router.start(on_peer)
        except zmq.ZMQError as exc:
            raise BadRequest(bind_failure(f"listen for peers on {cfg.listen}", exc, "--listen")) from None
        parts.peers.start(on_link, parts.transfers.on_lost)
        if parts.disk is not None:
            parts.disk.start(parts.tier.is_home if parts.tier is not None else None)
        if parts.http is not None:  # before the client socket: once a client is answered, /healthz answers too
            try:
                await parts.http.start()
            except OSError as exc:
                raise BadRequest(bind_failure(f"serve metrics on {cfg.metrics_host}:{cfg.metrics_port}", exc,
                                              "--metrics-port", " (0 turns it off)")) from None
        handlers = parts.handlers
        try:
            await parts.local.start(cfg.socket, handlers.on_local_message, handlers.on_client_gone, handlers.uses)
        except OSError as exc:
            raise BadRequest(bind_failure(f"serve clients on {cfg.socket}", exc, "--socket")) from None
        if parts.directory is not None:
            await parts.directory.start()  # registers in the background: a registry away never holds us up
        self._housekeeping = asyncio.get_running_loop().create_task(self._keep_house(parts), name="housekeeping")
        life.ready = True
        endpoint = parts.router.bound_endpoint
        self.notifier.notify(f"READY=1\nSTATUS=serving {cfg.socket}, peers on {endpoint}")
        log.info("kvd %s ready: pool %s on %s (%d blocks of %s), clients on %s, peers on %s, %d peer(s) "
                 "configured, metrics %s%s", cfg.node_id, format_size(cfg.pool_size), cfg.device,
                 cfg.pool_size // cfg.block_size, format_size(cfg.block_size), cfg.socket, endpoint, len(cfg.peers),
                 f"on http://{cfg.metrics_host}:{parts.http.port}/metrics" if parts.http else "off",
                 curve_summary(parts.curve) + (f", registry {parts.directory.url} (registering in the background)"
                                               if parts.directory else ""))

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
        if self.parts is not None:  # (a build that failed closed what it had made)
            await self._close(self.parts)
        if not served:
            for made in self._made_dirs:  # (innermost first; only what is still empty)
                try:
                    os.rmdir(made)
                except OSError:
                    break
        (log.info if served else log.debug)("kvd %s stopped", self.config.node_id)

    async def _close(self, parts: Parts) -> None:
        if parts.directory is not None:  # leave the registry first: nobody should pull from us any more
            await leave_registry(parts.directory)
        deadline = time.monotonic() + self.config.drain_timeout
        while parts.transfers.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await parts.transfers.close()  # aborts what is left, telling peers
        for _ in range(3):  # let the requests waiting on those transfers send their errors
            await asyncio.sleep(0)
        await parts.handlers.close()
        await parts.tier_service.close()
        if parts.disk is not None:  # (RAM's pages not on disk yet written out; before the pool goes)
            await parts.disk.close(self.config.drain_timeout)
        if self._housekeeping is not None:
            self._housekeeping.cancel()
            await asyncio.gather(self._housekeeping, return_exceptions=True)
        if parts.http is not None:
            await parts.http.close()
        parts.local.close()
        path = unix_path(self.config.socket)
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        parts.router.close()
        parts.peers.close()
        if parts.authenticator is not None:
            parts.authenticator.stop()
        parts.ctx.destroy(linger=500)  # closes any socket a failed start left open
        if parts.plane is not None:  # (after every transfer and connection: nothing reaches it any more)
            parts.plane.close()
        parts.memory.close()

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
        parts = self.parts
        keys_changed = (self._reload_curve(parts, parts.curve) if parts is not None and parts.curve is not None
                        else set())
        if keys_changed:
            changed.add("curve_allow")
        if ("peers" in changed or keys_changed) and parts is not None:
            parts.peers.set_peers(dict(self.config.peers), rekey=keys_changed)
        log.info("SIGHUP: configuration reloaded (%s)", ", ".join(sorted(changed & RELOADABLE)) or "no changes")

    def _reload_curve(self, parts: Parts, curve: CurveKeys) -> set[str]:
        """Re-read the CURVE allow list, the deny list and this node's cert (files and directories:
        a node added, a key rotated or revoked, a cert renewed need no restart). The ZAP handler
        checks the same sets, changed in place (first the new keys are added, then the old ones
        dropped: no key allowed before and after is ever missing). Peers that are no longer
        admitted are cut at once, and their transfers fail. Returns the peer names whose key
        changed: their links are dialled again."""
        try:
            fresh = load_curve(self.config)
        except BadRequest as exc:
            log.error("SIGHUP: CURVE keys not reloaded: %s", exc)
            return set()
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
        # (a cert comes with its signer: CurveKeys.cert is the signer's)
        if fresh.signer is not None and curve.cert is not None and fresh.signer.cert.raw != curve.cert.raw:
            curve.signer = fresh.signer  # a renewed cert: new hellos show it, the registry record carries it
            if parts.directory is not None:
                parts.directory.renew(fresh.signer)
            log.info("SIGHUP: this node's cert renewed, valid until %s",
                     time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(fresh.signer.cert.not_after)))
        if added or removed or rekeyed or newly_denied:
            log.info("SIGHUP: CURVE keys reloaded: %d key(s) added, %d removed, %d newly denied; peer keys changed "
                     "for %s", len(added), len(removed), len(newly_denied), ", ".join(sorted(rekeyed)) or "none")
        if revoked:
            log.warning("SIGHUP: %d key(s) taken out of --curve-allow are refused from now on, and their connections "
                        "cut, though the cluster CA still vouches for them: until they are put back or kvd restarts "
                        "(to keep them out after a restart, add them to --curve-deny): %s", len(revoked),
                        ", ".join(sorted(k.decode(errors="replace") for k in revoked)))
        if removed or newly_denied or revoked:
            parts.router.readmit()  # cut whoever is connected to us and no longer admitted
            rekeyed |= parts.peers.names_with_keys(newly_denied | revoked)  # and our links whose peer's key is refused
        return rekeyed | ({"*"} if added or removed or newly_denied or revoked else set())

    # --- housekeeping ------------------------------------------------------------------------------

    async def _keep_house(self, parts: Parts) -> None:
        last_watchdog = 0.0
        expected = time.monotonic() + HOUSEKEEPING_INTERVAL
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL)
            now = time.monotonic()
            self.metrics.lag(max(0.0, now - expected))
            expected = now + HOUSEKEEPING_INTERVAL
            parts.sweeper.sweep(now)
            parts.tier_service.sweep(now)
            parts.local.enforce(now)
            parts.router.enforce(now)
            parts.transfers.tick(now)
            parts.peers.heartbeat(now, parts.transfers.busy_channels())
            interval = self.notifier.watchdog_interval
            if interval and now - last_watchdog >= interval:
                self.notifier.notify("WATCHDOG=1")
                last_watchdog = now


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


def curve_summary(curve: CurveKeys | None) -> str:
    if curve is None:
        return ""
    cert = curve.cert  # (there is one exactly when there is a cluster CA: load_keys loads it with the CA)
    ways = ([f"cluster CA, this node's cert valid until "
             f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(cert.not_after))}"] if cert is not None else [])
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
