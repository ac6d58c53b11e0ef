"""Timing and resource helpers shared by the baselines and the kvd cases."""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_cpu(stat: str) -> float:
    """User + system CPU seconds from the text of a /proc .../stat file."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (and its threads) from /proc."""
    with open(f"/proc/{pid}/stat") as handle:
        return _stat_cpu(handle.read())


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name of a process (threads of the same name summed)."""
    totals: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as handle:
                stat = handle.read()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        totals[name] = totals.get(name, 0.0) + _stat_cpu(stat)
    return totals


def system_cpu() -> tuple[int, int]:
    """(all, idle) clock ticks of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as handle:
        ticks = [int(x) for x in handle.readline().split()[1:]]
    return sum(ticks), ticks[3] + ticks[4]  # idle + iowait


def busy_between(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Fraction of all cores' time that was busy between two system_cpu() readings."""
    total, idle = after[0] - before[0], after[1] - before[1]
    return 1 - idle / total if total else float("nan")


def rss_beyond_shared(pid: int) -> int:
    """Resident bytes that are not shared memory (so the mapped pool is not counted)."""
    values = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssShmem"):
                values[key] = int(rest.split()[0]) * 1024
    return values.get("VmRSS", 0) - values.get("RssShmem", 0)


@dataclass
class Sample:
    seconds: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def cpu_per_run(self) -> float:
        """Mean CPU seconds per run. Not the median: other processes' CPU is read from /proc in
        10 ms clock ticks, so a 2 ms run reads 0 or 10 ms; the mean of many runs is still right."""
        return statistics.fmean(self.cpu) if self.cpu else float("nan")


def pooled(samples: list[Sample]) -> Sample:
    """One sample of every run of several (rounds of the same case, interleaved with others)."""
    return Sample([t for s in samples for t in s.seconds], [c for s in samples for c in s.cpu])


def repeat(fn: Callable[[], None], repeats: int, warmup: int = 1, pids: tuple[int, ...] = (),
           setup: Callable[[], None] | None = None) -> Sample:
    """Median-able timings of fn; CPU is this process plus `pids`, per run."""
    sample = Sample()
    for i in range(warmup + repeats):
        if setup is not None:
            setup()
        cpu0 = time.process_time() + sum(cpu_seconds(p) for p in pids)
        t0 = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() + sum(cpu_seconds(p) for p in pids) - cpu0
        if i >= warmup:
            sample.seconds.append(elapsed)
            sample.cpu.append(cpu)
    return sample


def human(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes // size}{unit}"
    return f"{nbytes}B"
