"""Prometheus counters and histograms of the daemon's events (daemon process): a leaf.

Counters and histograms are updated where events happen (a transfer ends, an error is
returned). Gauges of live state (pool use, entries, peers, in-flight transfers) are not kept
here: `status.py` reads them from the parts when Prometheus scrapes. The totals `kvd status`
shows (`tally`) and the last errors returned to clients live here too, so that the handlers and
the transfers record into one place and the status reader reads from one.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvd.errors import ERROR_NAMES
from kvd.throttle import Throttle

# transfer durations: a 64 KiB local handoff takes ~0.1 ms, a 4 GiB push several seconds
DURATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                    1.0, 2.5, 5.0, 10.0, 30.0)
RECENT_ERRORS = 20  # kept for `kvd status`
UNDECODABLE_LOG_INTERVAL = 10.0  # seconds: one log line per socket kind, however many arrive
MAX_PEER_LABELS = 256  # distinct `peer` label values, then "other"
# the longest peer name with a label of its own (a node id is at most 128 characters); a longer
# name, or one with control characters, quotes or backslashes (escaped on the page: twice as
# long), is no daemon's: it counts as "other". So the page stays under a megabyte.
MAX_PEER_LABEL_BYTES = 128
OTHER = "other"
RENDER_CACHE = 1.0  # seconds a rendered /metrics page is served again (many scrapers, one render)
RENDER_SLICE = 0.002  # seconds of writing the page out after which a render lets the loop run
RENDER_SHARE = 0.2  # the most of the loop's time rendering /metrics takes, however often it is scraped


class _Children:
    """A labelled metric whose children are looked up once: prometheus_client's `labels()`
    validates and stringifies its values under a lock on every call, which cost more than the
    rest of a small transfer's bookkeeping. The label sets are bounded (peers: MAX_PEER_LABELS)."""

    def __init__(self, metric) -> None:
        self.metric = metric
        self._children: dict[tuple, object] = {}

    def labels(self, *values: str):
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


class _Collected:
    """Families already collected, for generate_latest."""

    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self) -> list:
        return self.families


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.bytes = _Children(Counter("kvd_transfer_bytes", "Payload bytes moved to or from peers",
                                       ["peer", "direction"], registry=r))
        self.transfers = _Children(Counter("kvd_transfers", "Peer transfers finished, by outcome",
                                           ["peer", "direction", "outcome"], registry=r))
        self.duration = _Children(Histogram("kvd_operation_duration_seconds",
                                            "Time from request to completion, by operation",
                                            ["operation"], buckets=DURATION_BUCKETS, registry=r))
        self.local_bytes = _Children(Counter("kvd_local_bytes", "Bytes handed over through the shared pool",
                                             ["direction"], registry=r))
        self.errors = _Children(Counter("kvd_errors", "Errors returned to clients or peers, by code", ["code"],
                                        registry=r))
        self.expired = Counter("kvd_expired_entries", "Entries dropped because their ttl ran out", registry=r)
        self.abandoned = Counter("kvd_abandoned_writes", "Puts dropped because the writer never finished",
                                 registry=r)
        self.lease_expiries = Counter("kvd_expired_leases", "Read leases given back after their holder vanished",
                                      registry=r)
        self.undecodable = Counter("kvd_undecodable_messages", "Messages that could not be decoded, by socket",
                                   ["socket"], registry=r)
        self.loop_lag = Gauge("kvd_event_loop_lag_seconds", "How late the last housekeeping tick ran", registry=r)
        self.loop_lag_max = Gauge("kvd_event_loop_lag_max_seconds", "Largest housekeeping delay seen", registry=r)
        self.max_loop_lag = 0.0
        # totals for `kvd status`: puts, gets, errors, sent/received bytes, pushes, pulls, failures
        self.tally: collections.Counter = collections.Counter()
        self.recent_errors: collections.deque = collections.deque(maxlen=RECENT_ERRORS)
        self.waiting_reads = 0  # gets and get_streams waiting for their entry now
        self._undecodable_logged = Throttle(UNDECODABLE_LOG_INTERVAL)  # by socket
        self._peer_labels: set[str] = set()
        self._rendered: tuple[float, bytes] = (-RENDER_CACHE, b"")
        self._rendering: asyncio.Task | None = None  # the render in progress
        self._queued: asyncio.Task | None = None  # the next render, waiting for its turn
        self._render_cost, self._render_end = 0.0, 0.0  # the last render's time on the loop, and its end

    def error(self, code: int) -> None:
        self.errors.labels(ERROR_NAMES.get(code, str(code))).inc()

    def peer(self, name: str) -> str:
        """The `peer` label for a peer name, in every family that has one: the first MAX_PEER_LABELS
        names seen that could be a node's (at most MAX_PEER_LABEL_BYTES, printable, nothing to
        escape), then "other". A peer may call itself anything: one label per claimed name, or a
        label of 64 KB, would let it grow /metrics without bound."""
        if name in self._peer_labels:
            return name
        if (len(self._peer_labels) < MAX_PEER_LABELS and len(name) <= MAX_PEER_LABEL_BYTES and name != OTHER
                and len(name.encode()) <= MAX_PEER_LABEL_BYTES and name.isprintable()
                and '"' not in name and "\\" not in name):
            self._peer_labels.add(name)
            return name
        return OTHER

    def transfer_bytes(self, peer: str, direction: str, nbytes: int) -> None:
        self.bytes.labels(self.peer(peer), direction).inc(nbytes)

    def transfer_done(self, peer: str, direction: str, outcome: str, seconds: float | None) -> None:
        self.transfers.labels(self.peer(peer), direction, outcome).inc()
        if seconds is not None and outcome == "ok":
            # what this daemon did, whoever started it: a pull it serves is a send, a push to it a receive
            self.duration.labels("send" if direction == "sent" else "receive").observe(seconds)

    def lag(self, seconds: float) -> None:
        self.loop_lag.set(seconds)
        if seconds > self.max_loop_lag:
            self.max_loop_lag = seconds
            self.loop_lag_max.set(seconds)

    def report_undecodable(self, socket: str, source: str, error: Exception, log: logging.Logger) -> None:
        """The one policy for input that does not decode, on every socket: count it, log it at
        most once per interval per socket (a flood must not flood the log), never raise. The
        caller answers it where it can (an error or abort naming it)."""
        self.undecodable.labels(socket).inc()
        if self._undecodable_logged.allow(socket):
            log.warning("undecodable message on the %s socket from %s: %.200s (further ones for %gs: counted in "
                        "kvd_undecodable_messages_total)", socket, source, error, UNDECODABLE_LOG_INTERVAL)

    def render(self, busy: bool = False) -> bytes | Awaitable[bytes]:
        """The /metrics page: the page itself when a recent one will do, else an awaitable of it.

        A scrape is answered with a render that reads the values after it came: its own, or the
        next one, which every scrape until then shares. One render runs at a time, and the next
        starts once the loop has had (1 - RENDER_SHARE) of the time since for everything else:
        scrapers without pause get slower answers, the daemon's clients do not. While many scrapes
        are in flight (busy), one rendered less than RENDER_CACHE ago, or the render in progress,
        is served again: a thousand concurrent scrapes make one render."""
        if busy and time.monotonic() - self._rendered[0] < RENDER_CACHE:
            return self._rendered[1]
        if self._queued is not None:  # (it has read nothing yet: as fresh as one of this scrape's own)
            return asyncio.shield(self._queued)
        if busy and self._rendering is not None:
            return asyncio.shield(self._rendering)
        self._queued = asyncio.get_running_loop().create_task(self._render(self._rendering), name="render metrics")
        return asyncio.shield(self._queued)  # (a scrape that gives up leaves it to the others)

    async def _render(self, previous: asyncio.Task | None) -> bytes:
        """Every value is read at once (the collectors' snapshot: bounded, peer labels included),
        then written out family by family, letting the loop run whenever RENDER_SLICE is spent:
        no scrape holds the loop, and its clients, for the whole page."""
        this = asyncio.current_task()
        try:
            if previous is not None:
                await asyncio.wait([previous])
            pause = self._render_end + self._render_cost * (1 / RENDER_SHARE - 1) - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
        finally:
            if self._queued is this:
                self._queued = None
        self._rendering = this
        try:
            started, cost, since = time.monotonic(), 0.0, time.perf_counter()
            families = list(self.registry.collect())
            parts = []
            for family in families:
                parts.append(generate_latest(_Collected([family])))
                if time.perf_counter() - since >= RENDER_SLICE:
                    cost += time.perf_counter() - since
                    await asyncio.sleep(0)
                    since = time.perf_counter()
            page = b"".join(parts)
            self._rendered = (started, page)
            self._render_cost, self._render_end = cost + time.perf_counter() - since, time.monotonic()
            return page
        finally:
            if self._rendering is this:
                self._rendering = None
