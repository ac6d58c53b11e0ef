"""What the daemon reports about itself (daemon process): one reader of the parts' state for both
`kvd status` (`snapshot`, the Stats reply) and Prometheus (`collect`, gauges read at scrape time).

It is given the parts it reads and computes every figure once, so the two views cannot drift.
It changes nothing.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from .config import Config
from .lifecycle import Lifecycle
from .local.server import LocalServer
from .membership import Directory
from .metrics import OTHER, Metrics
from .peer.peers import PeerSet
from .peer.transfers import Transfers
from .store.entries import Store
from .store.page_store import CacheStore


@dataclass(frozen=True, slots=True)
class StatusSettings:
    """What the status report reads of the daemon's configuration."""

    node_id: str
    device: str
    block_size: int
    metrics_host: str
    metrics_port: int

    @classmethod
    def of(cls, config: Config) -> StatusSettings:
        return cls(config.node_id, config.device, config.block_size, config.metrics_host, config.metrics_port)


class Status(Collector):
    def __init__(self, config: StatusSettings, lifecycle: Lifecycle, store: Store, transfers: Transfers, peers: PeerSet,
                 clients: LocalServer, metrics: Metrics, listen: Callable[[], str], version: str,
                 directory: Directory | None = None, cache: CacheStore | None = None,
                 media: Callable[[], dict] | None = None) -> None:
        self.config = config
        self.directory = directory
        self.lifecycle = lifecycle
        self.store = store
        self.transfers = transfers
        self.peers = peers
        self.clients = clients
        self.metrics = metrics
        self.listen = listen  # the peer endpoint as bound (once the ROUTER has started)
        self.version = version
        self.cache = cache  # the KV tier's store
        self.media = media  # its figures by medium, RAM and disk (tier/disk/media.py)

    def pool(self) -> dict:
        store, block_size = self.store, self.config.block_size
        return {
            "capacity_bytes": store.allocator.num_blocks * block_size,
            "used_bytes": store.used_bytes,
            "scratch_bytes": store.scratch_bytes,  # lent to connected clients for their next put
            # of used_bytes: removed entries whose blocks a client or ZeroMQ may still touch
            "parked_bytes": store.parked_bytes,
            "block_size": block_size,
            "free_blocks": store.allocator.free_blocks,
            "largest_free_extent_blocks": store.allocator.largest_free_extent(),
        }

    def _cache(self) -> dict | None:
        if self.cache is None:
            return None
        return {**self.cache.stats(), **({"media": self.media()} if self.media is not None else {})}

    def snapshot(self) -> dict:
        cfg, life = self.config, self.lifecycle
        in_flight = self.transfers.in_flight()
        return {
            "node_id": cfg.node_id,
            "incarnation": life.incarnation,
            "device": cfg.device,
            "uptime_s": round(time.time() - life.started_at, 3),
            "ready": life.ready,
            "draining": life.draining,
            "pool": self.pool(),
            "entries": len(self.store.entries),
            "entries_by_state": self.store.counts(),
            "expired_total": self.store.expired_total,
            "transfers_in_flight": sum(in_flight.values()),
            "local_clients": self.clients.connections,
            "waiting_reads": self.metrics.waiting_reads,  # gets waiting for their entry
            "peers": self.peers.states(),
            "counters": {key: self.metrics.tally[key] for key in COUNTERS},
            "recent_errors": list(self.metrics.recent_errors),
            "recent_failed_transfers": self.transfers.machine.recent_failures(),  # with their stories
            "listen": self.listen(),
            "metrics": f"http://{cfg.metrics_host}:{cfg.metrics_port}/metrics" if cfg.metrics_port else None,
            "registry": self.directory.status() if self.directory is not None else None,
            "cache": self._cache(),
            "plane": self.plane(),
        }

    def plane(self) -> dict | None:
        """The one-sided data plane: its agent and peers, operations, and what it holds for peers."""
        if self.peers.plane is None:
            return None
        return {**self.peers.plane.stats(), **self.transfers.plane.summary()}

    def collect(self) -> Iterator:
        cfg, life = self.config, self.lifecycle
        info = InfoMetricFamily("kvd_build", "Daemon identity")
        info.add_metric([], {"version": self.version, "node_id": cfg.node_id, "device": cfg.device,
                             "incarnation": f"{life.incarnation:x}"})
        yield info
        pool = self.pool()
        yield GaugeMetricFamily("kvd_pool_capacity_bytes", "Staging pool size", value=pool["capacity_bytes"])
        yield GaugeMetricFamily("kvd_pool_used_bytes", "Staging pool bytes held by entries", value=pool["used_bytes"])
        yield GaugeMetricFamily("kvd_pool_scratch_bytes", "Staging pool bytes lent to clients for their next put",
                                value=pool["scratch_bytes"])
        yield GaugeMetricFamily("kvd_pool_parked_bytes", "Staging pool bytes of removed entries that a client or "
                                "ZeroMQ may still touch (part of used bytes)", value=pool["parked_bytes"])
        yield GaugeMetricFamily("kvd_pool_largest_free_bytes", "Largest contiguous free run (fragmentation)",
                                value=pool["largest_free_extent_blocks"] * pool["block_size"])
        entries = GaugeMetricFamily("kvd_pool_entries", "Entries held, by state", labels=["state"])
        for state, count in self.store.counts().items():
            entries.add_metric([state], count)
        yield entries
        in_flight = GaugeMetricFamily("kvd_transfers_in_flight", "Peer transfers in progress", labels=["direction"])
        for direction, count in self.transfers.in_flight().items():
            in_flight.add_metric([direction], count)
        yield in_flight
        # labelled as in the transfer families (Metrics.peer: bounded in number and length); the
        # peers past those share "other", 1 while every one of them answers
        peers = GaugeMetricFamily("kvd_peer_up", "1 if the peer answered its last heartbeat (\"other\": all the "
                                  "peers without a label of their own did)", labels=["peer"])
        others: list[bool] = []
        for name, peer_state in self.peers.states().items():
            label = self.metrics.peer(name)
            if label == OTHER:
                others.append(peer_state["connected"])
            else:
                peers.add_metric([label], 1 if peer_state["connected"] else 0)
        if others:
            peers.add_metric([OTHER], 1 if all(others) else 0)
        yield peers
        yield GaugeMetricFamily("kvd_ready", "1 once the pool and listeners are up", value=1 if life.ready else 0)
        yield GaugeMetricFamily("kvd_local_clients", "Client connections open on the local socket",
                                value=self.clients.connections)
        if self.directory is not None:
            yield from registry_metrics(self.directory.status())


def registry_metrics(status: dict) -> Iterator:
    """The cluster registry's gauges and counters, read from the member's status at scrape time."""
    yield GaugeMetricFamily("kvd_registry_up", "1 while the cluster registry answers", value=1 if status["up"] else 0)
    yield GaugeMetricFamily("kvd_registry_registered", "1 while this node is registered (0: away, or its id is "
                            "held by another live daemon)", value=1 if status["registered"] else 0)
    yield GaugeMetricFamily("kvd_registry_outbox_entries", "Holder records waiting to be written",
                            value=status["outbox"])
    yield GaugeMetricFamily("kvd_registry_listed_entries", "Entries this node lists in the holder directory",
                            value=status["listed"])
    yield GaugeMetricFamily("kvd_cluster_nodes", "Nodes of the cluster this daemon sees", value=status["nodes"])
    ops = CounterMetricFamily("kvd_registry_ops", "Registry calls, by operation and result", labels=["op", "result"])
    for key, count in status["ops"].items():
        ops.add_metric(key.split(":", 1), count)
    yield ops
    lookups = CounterMetricFamily("kvd_directory_lookups", "Holder lookups, by result", labels=["result"])
    for result in ("hit", "miss", "stale", "unavailable"):
        lookups.add_metric([result], status["lookups"].get(result, 0))
    yield lookups
    yield CounterMetricFamily("kvd_registry_resyncs", "Re-registrations with a full re-publication",
                              value=status["resyncs"])
    dropped = CounterMetricFamily("kvd_registry_records_dropped", "Registry records not believed, by kind and reason "
                                  "(unsigned, bad_signature, wrong_node, expired, too_large, key_mismatch, ...)",
                                  labels=["kind", "reason"])
    for key, count in status["dropped"].items():  # (reasons are a fixed set of words: the series stay few)
        dropped.add_metric(key.split(":", 1), count)
    yield dropped
    yield GaugeMetricFamily("kvd_registry_refused", "1 while the registry refuses this daemon's credentials",
                            value=1 if status.get("refused") else 0)


# the totals `kvd status` shows, in this order (recorded in Metrics.tally by handlers and transfers)
COUNTERS = ("puts", "gets", "errors", "sent_bytes", "received_bytes", "pushes", "pulls", "failures")
