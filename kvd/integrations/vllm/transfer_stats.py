"""The KVDConnector's transfer statistics for vLLM: the "KV Transfer metrics" log line and the
per-engine Prometheus metrics on vLLM's own /metrics (vLLM's worker and logger processes).

Workers report `KVDConnectorStats` each step; vLLM aggregates them across workers, logs their
reduction every interval and hands the aggregated data to `KVDPromMetrics.observe`. The daemons'
own /metrics still count every byte on the node; these say what one engine moved, and of it how
much each kind of KV cache group (`saved_bytes[sliding_window]`, ...; the `kind` label).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

COUNTERS = ("saves", "save_failures", "saved_bytes", "loads", "load_failures", "loaded_bytes",
            # prefix reuse through the KV tier: pages stored, prompts' hits loaded
            "tier_saves", "tier_save_failures", "tier_saved_bytes", "tier_loads", "tier_load_failures",
            "tier_loaded_bytes")
BY_KIND = {"saved_bytes_by_kind": "saved_bytes", "loaded_bytes_by_kind": "loaded_bytes"}  # {kind: bytes} each
TIMES = ("load_seconds", "save_seconds")  # a list of durations each: per load, per forward step that saved
# seconds a load takes, from 1 ms (a local read) to 30 s (kvd_load_timeout's default); a step's saves too
LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class KVDConnectorStats(KVConnectorStats):
    """Workers -> vLLM's stats logger ("KV Transfer metrics: ..." every logging interval)."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)
        for name in BY_KIND:
            self.data.setdefault(name, {})
        for name in TIMES:
            self.data.setdefault(name, [])

    def reset(self) -> None:
        self.data: dict[str, Any] = {}
        self.__post_init__()

    def aggregate(self, other: KVConnectorStats) -> KVDConnectorStats:
        for name in COUNTERS:
            self.data[name] += other.data.get(name, 0)
        for name in BY_KIND:
            mine = self.data[name] = dict(self.data[name])
            for kind, nbytes in (other.data.get(name) or {}).items():
                mine[kind] = mine.get(kind, 0) + nbytes
        for name in TIMES:
            self.data[name] = self.data[name] + list(other.data.get(name, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        summary: dict[str, int | float] = {name: self.data[name] for name in COUNTERS}
        for name, total in BY_KIND.items():
            summary.update((f"{total}[{kind}]", n) for kind, n in sorted(self.data[name].items()))
        for name in TIMES:
            times = sorted(self.data[name])
            if times:
                prefix = name.removesuffix("_seconds")
                summary[f"{prefix}_ms_avg"] = round(sum(times) / len(times) * 1e3, 2)
                summary[f"{prefix}_ms_p90"] = round(times[min(len(times) - 1, int(len(times) * 0.9))] * 1e3, 2)
        return summary

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in COUNTERS)


class KVDPromMetrics(KVConnectorPromMetrics):
    """`vllm:kvd_*` counters and the load-time histogram, one child per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        helps = {"saves": "Requests whose KV this engine handed to kvd",
                 "save_failures": "Hand-offs to kvd that failed (decode recomputes those prompts)",
                 "saved_bytes": "KV bytes this engine wrote to kvd",
                 "loads": "Requests whose KV this engine loaded from kvd",
                 "load_failures": "Loads from kvd that failed (the prompt is recomputed)",
                 "loaded_bytes": "KV bytes this engine scattered into its cache from kvd",
                 "tier_saves": "Prefix pages (a block of a KV cache group) this engine stored in kvd's tier",
                 "tier_save_failures": "Prefix pages the tier refused or lost (a later miss, nothing worse)",
                 "tier_saved_bytes": "KV bytes this engine stored in kvd's tier",
                 "tier_loads": "Prompts whose prefix this engine loaded from kvd's tier",
                 "tier_load_failures": "Prefix loads that lost pages (those blocks are recomputed)",
                 "tier_loaded_bytes": "KV bytes this engine loaded from kvd's tier"}
        self.counters = {
            name: create_metric_per_engine(self._counter_cls(
                name=f"vllm:kvd_{name}" if name.endswith("bytes") else f"vllm:kvd_{name}_total",
                documentation=helps[name], labelnames=labelnames), per_engine_labelvalues)
            for name in COUNTERS}
        self.load_seconds = create_metric_per_engine(self._histogram_cls(
            name="vllm:kvd_load_seconds", documentation="Time from a load's start until its KV is in the cache",
            buckets=list(LOAD_BUCKETS), labelnames=labelnames), per_engine_labelvalues)
        self.save_seconds = create_metric_per_engine(self._histogram_cls(
            name="vllm:kvd_save_step_seconds",
            documentation="Time a forward step that saved spent in kvd (its layers' gathers and its commits)",
            buckets=list(LOAD_BUCKETS), labelnames=labelnames), per_engine_labelvalues)
        # children per (engine, kind), made as kinds appear
        self._labels = per_engine_labelvalues
        self.by_kind = {name: self._counter_cls(
            name=f"vllm:kvd_group_{total}", documentation=f"{helps[total]}, by kind of KV cache group",
            labelnames=[*labelnames, "kind"]) for name, total in BY_KIND.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name in COUNTERS:
            value = transfer_stats_data.get(name, 0)
            if value:
                self.counters[name][engine_idx].inc(value)
        for name, counter in self.by_kind.items():
            for kind, nbytes in (transfer_stats_data.get(name) or {}).items():
                if nbytes:
                    counter.labels(*self._labels[engine_idx], kind).inc(nbytes)
        for seconds in transfer_stats_data.get("load_seconds", ()):
            self.load_seconds[engine_idx].observe(seconds)
        for seconds in transfer_stats_data.get("save_seconds", ()):
            self.save_seconds[engine_idx].observe(seconds)
