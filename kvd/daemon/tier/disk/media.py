"""The KV tier by medium (daemon process): RAM and, with `--cache-dir`, disk, for `cache_stats()`,
`kvd status` and Prometheus (`kvd_cache_medium_*{medium=...}`, `kvd_cache_disk_*`).

RAM's hits are the gets' hits less those read back from disk and those fetched from a page's home
for them; its misses are the keys a get did not find in RAM (then asked of the disk or the home).
Read and write latency are the disk's: RAM's copies are the clients' own (bench.kv_tier measures them).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from ...store.page_store import CacheStore
from .level import DiskTier

SHARED = ("pages", "bytes", "used_bytes", "budget", "hits", "misses", "evictions", "corrupt")


class Media(Collector):
    def __init__(self, store: CacheStore, disk: DiskTier | None, cluster: Callable[[], dict] | None = None) -> None:
        self.store = store
        self.disk = disk
        self.cluster = cluster  # the tier's exchanges with other homes (its "fetched" pages), with a registry

    def as_dict(self) -> dict:
        stats = self.store.stats()
        disk = self.disk.stats() if self.disk is not None else None
        fetched = (self.cluster() or {}).get("fetched", 0) if self.cluster is not None else 0
        served_elsewhere = (disk["hits"] if disk else 0) + fetched
        media = {"ram": {"pages": stats["entries"], "bytes": stats["bytes"], "used_bytes": stats["used_bytes"],
                         "budget": stats["budget"], "hits": max(0, stats["hits"] - served_elsewhere),
                         "misses": stats["misses"] + served_elsewhere, "evictions": stats["evictions"], "corrupt": 0}}
        if disk is not None:
            media["disk"] = {"pages": disk["entries"], **disk}
        return media

    def collect(self) -> Iterator:
        media = self.as_dict()
        for name, help_text, kind in (
                ("pages", "KV tier pages held, by medium", GaugeMetricFamily),
                ("bytes", "KV tier page bytes held, by medium", GaugeMetricFamily),
                ("used_bytes", "Bytes the medium spends on KV tier pages (whole pool blocks; whole file-system "
                 "blocks and a 4 KiB header a page on disk)", GaugeMetricFamily),
                ("budget", "KV tier budget by medium (--cache-size, --cache-disk-size)", GaugeMetricFamily),
                ("hits", "KV tier pages a get found, by the medium that gave them", CounterMetricFamily),
                ("misses", "KV tier pages a get asked of the medium that it did not give", CounterMetricFamily),
                ("evictions", "KV tier pages evicted from the medium for its budget", CounterMetricFamily),
                ("corrupt", "KV tier pages dropped as their checks failed (digest, key, namespace, size)",
                 CounterMetricFamily)):
            metric = f"kvd_cache_medium_{name}" + ("_bytes" if name == "budget" else "")
            family = kind(metric, help_text, labels=["medium"])
            for medium, figures in media.items():
                family.add_metric([medium], figures[name])
            yield family
        disk, tier = media.get("disk"), self.disk
        if disk is None or tier is None:
            return
        for name, help_text in (("spilled", "Pages written to the disk level"),
                                ("refused", "Pages the disk level did not take: no room, the disk full or failing, "
                                 "evicted before their turn with the staging full"),
                                ("stale", "Disk pages of another format version, dropped"),
                                ("busy", "Disk reads not done in time for their get, or refused with the queue full"),
                                ("found", "Pages found on disk by the start's scan")):
            yield CounterMetricFamily(f"kvd_cache_disk_{name}", help_text, value=disk[name])
        yield GaugeMetricFamily("kvd_cache_disk_staged_bytes", "Bytes of pages evicted from RAM, copied out and "
                                "waiting for the disk", value=disk["staged_bytes"])
        yield GaugeMetricFamily("kvd_cache_disk_unwritten_pages", "RAM pages of this home not on disk yet",
                                value=disk["unwritten"])
        for op, latency in (("read", tier.read_latency), ("write", tier.write_latency)):
            yield HistogramMetricFamily(f"kvd_cache_disk_{op}_seconds", f"Time to {op} one page's file (in a worker "
                                        "thread: open, I/O, digest)", buckets=latency.buckets(),
                                        sum_value=latency.sum)
