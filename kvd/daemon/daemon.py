"""The kvd daemon: owns the pool and the sockets, and runs the process's life.

One asyncio loop (uvloop). Local clients talk to a unix socket at `--socket`
(`kvd.localsock`), served by `kvd.service`; peers talk ZeroMQ to `kvd.exchange`. This
module starts them in order, keeps house (expiry, deadlines, heartbeats, watchdog), reloads
what can change on SIGHUP, and on SIGTERM drains in-flight work before it releases the pool
and exits.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import platform
import random
import signal
import time
from typing import Callable

import zmq

from kvd.errors import BadRequest
from kvd.memory import open_staging_memory
from kvd.units import format_size
from kvd.wire.endpoints import unix_path

from .config import Config
from .handlers import ClientService
from .http import HttpEndpoint
from .local_server import LocalServer
from .metrics import Metrics, StateCollector
from .peer.auth import load_keys, start_authenticator
from .peer.transfers import Exchange
from .store.allocator import BlockAllocator
from .store.entries import Store
from .systemd import Notifier

log = logging.getLogger(__name__)

HOUSEKEEPING_INTERVAL = 0.2  # seconds between expiry/deadline sweeps
# glibc malloc: serve ZeroMQ's chunk-sized receive buffers from the heap and keep up to this much
# freed heap instead of returning it to the kernel after every chunk (see keep_receive_buffers)
MALLOC_MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value
MALLOC_TRIM_THRESHOLD = 64 << 20
RELOADABLE = {"peers", "log_level"}  # what SIGHUP can change without a restart


class Daemon:
    def __init__(self, config: Config, reload_config: Callable[[], Config] | None = None) -> None:
        self.config = config
        self._reload_config = reload_config
        self.incarnation = random.getrandbits(63)  # new on every start: tells peers we restarted
        self.metrics = Metrics()
        self.notifier = Notifier()
        self.memory = None
        self.store: Store | None = None
        self.exchange: Exchange | None = None
        self.service: ClientService | None = None
        self.ctx: zmq.Context | None = None
        self.local: LocalServer | None = None
        self.http: HttpEndpoint | None = None
        self.authenticator = None
        self._tasks: set[asyncio.Task] = set()
        self._stop_requested = asyncio.Event()
        self.draining = False
        self.started_at = time.time()
        self.ready = False
        self.metrics.registry.register(StateCollector(self))

    # --- start ---------------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        keep_receive_buffers()
        self.memory = open_staging_memory(cfg.device, cfg.pool_size, cfg.pool_path, cfg.pool_prefault)
        num_blocks = cfg.pool_size // cfg.block_size
        self.store = Store(BlockAllocator(num_blocks), cfg.block_size, cfg.default_ttl or None)
        self.ctx = zmq.Context(io_threads=cfg.io_threads)
        curve = None
        if cfg.curve_secret_key:
            curve = load_keys(cfg.curve_secret_key, list(cfg.curve_allow))
            self.authenticator = start_authenticator(self.ctx, curve)
        self._claim_socket_path(cfg.socket)  # before anything binds: a second daemon stops here
        if curve is None and not _is_loopback(cfg.listen):
            log.warning("peers are not authenticated: %s is reachable beyond this host and CURVE is off, so any "
                        "host that reaches it can read and consume every entry (set --curve-secret-key, or "
                        "firewall the port)", cfg.listen)
        self.exchange = Exchange(cfg, self.store, self.memory.io(cfg.chunk_size, cfg.window), self.ctx,
                                 self.incarnation, self.metrics)
        self.exchange.curve = curve
        self.service = ClientService(self)
        self.exchange.events = self.service  # arrivals wake waiters and stream readers
        await self.exchange.start()
        if cfg.metrics_port:  # before the client socket: once a client is answered, /healthz answers too
            self.http = HttpEndpoint(cfg.metrics_host, cfg.metrics_port, self.metrics.render, lambda: self.ready)
            await self.http.start()
        self.local = LocalServer(self.service.on_local_message, self.service.on_client_gone)
        await self.local.start(cfg.socket)
        self.spawn(self._housekeeping(), "housekeeping")
        self.ready = True
        self.notifier.notify(f"READY=1\nSTATUS=serving {cfg.socket}, peers on {self.exchange.bound_endpoint}")
        log.info("kvd %s ready: pool %s on %s (%d blocks of %s), clients on %s, peers on %s, %d peer(s) "
                 "configured, metrics %s%s", cfg.node_id, format_size(cfg.pool_size), cfg.device, num_blocks,
                 format_size(cfg.block_size), cfg.socket, self.exchange.bound_endpoint, len(cfg.peers),
                 f"on http://{cfg.metrics_host}:{self.http.port}/metrics" if self.http else "off",
                 f", CURVE on ({len(curve.allowed)} allowed keys)" if curve else "")

    @staticmethod
    def _claim_socket_path(endpoint: str) -> None:
        """Make room for the client socket file: refuse a live daemon's, remove a stale one."""
        path = unix_path(endpoint)
        if path is None:
            return
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        if os.path.exists(path):
            if _socket_in_use(path):
                raise BadRequest(f"{endpoint} is in use by another daemon")
            os.unlink(path)  # stale socket of a daemon that did not exit cleanly

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
        if self.draining:
            return
        self.draining = True
        self.ready = False  # /readyz fails from the start of the drain: send no new work here
        self.notifier.notify("STOPPING=1")
        log.info("kvd %s shutting down (draining up to %gs)", self.config.node_id, self.config.drain_timeout)
        deadline = time.monotonic() + self.config.drain_timeout
        while self._in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.exchange is not None:
            await self.exchange.close()  # aborts what is left, telling peers
            for _ in range(3):  # let the requests waiting on those transfers send their errors
                await asyncio.sleep(0)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
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
        if self.authenticator is not None:
            self.authenticator.stop()
        if self.ctx is not None:
            self.ctx.destroy(linger=500)  # closes any socket a failed start left open
        self.exchange = None
        if self.memory is not None:
            self.memory.close()
        log.info("kvd %s stopped", self.config.node_id)

    def _in_flight(self) -> bool:
        """Transfers are running, or a push is still connecting to its peer (what the drain waits for)."""
        return (self.exchange is not None and self.exchange.busy()) or (
            self.service is not None and self.service.pushing())

    def spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- reload ------------------------------------------------------------------------------------

    def reload(self) -> None:
        """SIGHUP: re-read the configuration; apply peers and log level, report the rest."""
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
        self.config = dataclasses.replace(old, peers=dict(new.peers), log_level=new.log_level)
        if "log_level" in changed:
            logging.getLogger().setLevel(new.log_level.upper())
        if "peers" in changed:
            self.exchange.set_peers(self.config.peers)
        self.exchange.config = self.service.config = self.config
        log.info("SIGHUP: configuration reloaded (%s)", ", ".join(sorted(changed & RELOADABLE)) or "no changes")

    # --- housekeeping ------------------------------------------------------------------------------

    async def _housekeeping(self) -> None:
        last_watchdog = 0.0
        expected = time.monotonic() + HOUSEKEEPING_INTERVAL
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL)
            now = time.monotonic()
            lag = max(0.0, now - expected)
            expected = now + HOUSEKEEPING_INTERVAL
            self.metrics.loop_lag.set(lag)
            if lag > self.metrics.loop_lag_max._value.get():
                self.metrics.loop_lag_max.set(lag)
            self._sweep(now)
            self.exchange.check_deadlines(now)
            self.exchange.heartbeat(now)
            interval = self.notifier.watchdog_interval
            if interval and now - last_watchdog >= interval:
                self.notifier.notify("WATCHDOG=1")
                last_watchdog = now

    def _sweep(self, now: float) -> None:
        expired, abandoned, stale = self.store.sweep(now)
        for entry in expired:
            log.info("expired %s (ttl)", entry.request_id)
        self.metrics.expired.inc(len(expired))
        for entry in abandoned:
            log.warning("dropped %s: its writer did not finish within the lease", entry.request_id)
            self.service.write_expired(entry)
        self.metrics.abandoned.inc(len(abandoned))
        for lease in stale:
            self.service.lease_expired(lease)
            log.warning("read lease on %s expired; entry given back", lease.request_id)
        self.metrics.lease_expiries.inc(len(stale))

    def stats(self) -> dict:
        cfg, store = self.config, self.store
        return {
            "node_id": cfg.node_id,
            "incarnation": self.incarnation,
            "device": cfg.device,
            "uptime_s": round(time.time() - self.started_at, 3),
            "ready": self.ready,
            "draining": self.draining,
            "pool": {
                "capacity_bytes": store.allocator.num_blocks * cfg.block_size,
                "used_bytes": store.used_bytes,
                # of used_bytes: removed entries whose blocks a client or ZeroMQ may still touch
                "parked_bytes": store.parked_bytes,
                "scratch_bytes": store.scratch_bytes,  # lent to connected clients for their next put
                "block_size": cfg.block_size,
                "free_blocks": store.allocator.free_blocks,
                "largest_free_extent_blocks": store.allocator.largest_free_extent(),
            },
            "entries": len(store.entries),
            "entries_by_state": store.counts(),
            "expired_total": store.expired_total,
            "transfers_in_flight": len(self.exchange.transfers),
            "local_clients": self.local.connections if self.local is not None else 0,
            "peers": self.exchange.peer_states(),
            "counters": {**self.service.counters, **self.exchange.counters},
            "recent_errors": list(self.service.recent_errors),
            "listen": self.exchange.bound_endpoint,
            "metrics": f"http://{cfg.metrics_host}:{self.http.port}/metrics" if self.http else None,
        }


def keep_receive_buffers() -> bool:
    """Stop glibc from handing each received chunk's buffer back to the kernel.

    libzmq mallocs a fresh buffer for every chunk it receives (4 MiB). By default glibc serves
    that with mmap, or trims it off the heap once freed, so every chunk's pages are faulted in
    and zeroed again: measured 20-50 thousand page faults in the receiving I/O thread per
    768 MiB. Keeping up to 64 MiB of freed heap removes them: 256 MiB pushes 1.38-1.51 ->
    1.44-2.01 GB/s and 1.0-1.1 -> 0.8-1.0 CPU-s/GB in an interleaved A/B, for +25-40 MB of RSS.
    A no-op (False) off glibc or when GLIBC_TUNABLES already tunes malloc.
    """
    if platform.libc_ver()[0] != "glibc" or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    import ctypes

    libc = ctypes.CDLL(None)
    m_trim_threshold, m_mmap_threshold = -1, -3  # from malloc.h
    return bool(libc.mallopt(m_mmap_threshold, MALLOC_MMAP_THRESHOLD)
                and libc.mallopt(m_trim_threshold, MALLOC_TRIM_THRESHOLD))


def _is_loopback(endpoint: str) -> bool:
    """tcp://127.0.0.1:7470, tcp://[::1]:7470, tcp://localhost:7470 (a wildcard or a name is not)."""
    import ipaddress

    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _socket_in_use(path: str) -> bool:
    """True if something accepts connections on this unix socket path."""
    import socket as pysocket

    probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()
