"""Latency of the disk level's page reads and writes (daemon process): a fixed-bucket histogram, fed
on the event loop with what each worker measured, read by the stats and by Prometheus."""
from __future__ import annotations

import bisect

BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1.0, 5.0)


class Latency:
    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)  # the last: above every bucket
        self.count = 0
        self.sum = 0.0
        self.bytes = 0

    def observe(self, seconds: float, nbytes: int) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.count += 1
        self.sum += seconds
        self.bytes += nbytes

    def quantile(self, q: float) -> float:
        """The upper bound of the bucket holding the q-th observation (0 with none)."""
        if not self.count:
            return 0.0
        rank, seen = q * self.count, 0
        for bound, n in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            seen += n
            if seen >= rank:
                return bound if bound != float("inf") else BUCKETS[-1]
        return BUCKETS[-1]

    def as_dict(self) -> dict:
        return {"count": self.count, "sum_s": round(self.sum, 6),
                "mean_ms": round(self.sum / self.count * 1e3, 3) if self.count else 0.0,
                "p99_ms": round(self.quantile(0.99) * 1e3, 3), "bytes": self.bytes,
                "gbps": round(self.bytes / self.sum / 1e9, 3) if self.sum else 0.0}

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative counts by upper bound, as Prometheus wants them."""
        out, seen = [], 0
        for bound, n in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            seen += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), seen))
        return out
