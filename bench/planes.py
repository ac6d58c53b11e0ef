"""kvd's data planes side by side in one run (issue 40): `python -m bench --planes`, and a section of
every full `python -m bench`.

Three pairs of real daemons on loopback, all up at once: `--data-plane zmq` (chunk frames), and
`--data-plane nixl` with UCX held to TCP (UCX_TLS=tcp: as between hosts) and let onto shared memory
(UCX_TLS=sm,tcp: cma moves the bytes, as two daemons of one host). Each pushes (put with dest, on A)
and pulls (get with source and out, on B) the same sizes, timed end to end as bench/cases.py times
them, CPU of both daemons and the client per run. Beside them, in the same rounds: a bare NIXL write
of the same size between two processes (bench/peers/nixl_write.py, run with kvd's .venv: NIXL is
kvd's there) over the same transports, its progress threads built as kvd's daemons build theirs
(event-driven) and as NIXL's Python API does (busy-polling), and raw TCP (bench/baselines.py).

End to end includes the client's copy into the pool (push) and out of it (pull), ~2.4 GB/s of
memcpy here, which a bare write does not do. So kvd's rows also say how long the transfer itself
took: the daemons' own kvd_operation_duration_seconds on /metrics, read before and after every run
(push: A's send, from the put's commit to B's done; pull: B's receive, from its pull to the entry
published), one transfer between two readings or the run is an error.

The cases alternate in rounds (a VM's speed drifts by a third over minutes): every round measures
every size of every case, the planes in the other order on odd rounds; the rounds' runs are pooled.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvd.testing.daemons import DaemonFactory, DaemonProc, free_port, wait_ready

from . import baselines, peers
from .measure import Sample, human, repeat
from .plane_report import (
    NIXL_PLANES,
    PLANES,
    PROGRESS,
    Cell,
    Cells,
    Check,
    Row,
    bare,
    duration_totals,
    goals,
    in_flight,
    matrix,
    per_run,
    plane_rows,
    recorded_rows,
    regression_rows,
)

SIZES = [64 << 10, 1 << 20, 16 << 20, 256 << 20]
ROUNDS = 3
REPEATS = {64 << 10: (10, 40), 1 << 20: (5, 20), 16 << 20: (3, 6), 256 << 20: (1, 2)}  # per round: quick, full
POOL = "640MiB"  # a 256 MiB entry on each side, and room
METRICS_TIMEOUT = 30.0  # seconds a daemon may still have a transfer in flight between runs


def repeats_for(nbytes: int, quick: bool) -> int:
    quick_n, full_n = REPEATS.get(nbytes, (3, 10) if nbytes >= 16 << 20 else (10, 30))
    return quick_n if quick else full_n


def nixl_installed() -> bool:
    from kvd.daemon.plane.nixl import available

    return available()


@dataclass
class Pair:
    """Two daemons, each the other's peer, on one plane; their /metrics ports."""

    plane: str
    a: DaemonProc
    b: DaemonProc
    metrics: dict[str, int] = field(default_factory=dict)  # "A" / "B" -> port


def start_pair(factory: DaemonFactory, plane: str, pool_size: str = POOL,
               env: dict[str, str] | None = None) -> Pair:
    """A and B on `plane` (a key of PLANES), env added to both daemons' (the bench knobs)."""
    mode, tls, _ = PLANES[plane]
    env = {**({"UCX_TLS": tls} if tls else {}), **(env or {})}
    ports = {"A": free_port(), "B": free_port()}
    metrics = {"A": free_port(), "B": free_port()}
    started = {}
    for me, other in (("A", "B"), ("B", "A")):
        started[me] = factory.start(me, port=ports[me], pool_size=pool_size, wait=False, env=env,
                                    extra=["--data-plane", mode, "--metrics-port", str(metrics[me])],
                                    peers={other: f"tcp://127.0.0.1:{ports[other]}"})
    for daemon in started.values():
        wait_ready(daemon)
    return Pair(plane, started["A"], started["B"], metrics)


class Probe:
    """One daemon's kvd_operation_duration_seconds{operation} totals, read between runs."""

    def __init__(self, port: int, operation: str) -> None:
        self.url, self.operation = f"http://127.0.0.1:{port}/metrics", operation
        self.readings: list[tuple[int, float]] = []

    def now(self) -> tuple[int, float]:
        """The totals once the daemon has no transfer in flight (a pull's holder ends its part when the
        puller's done reaches it, which can be after the puller's get returned)."""
        deadline = time.monotonic() + METRICS_TIMEOUT
        while True:
            with urllib.request.urlopen(self.url, timeout=10) as response:
                page = response.read().decode()
            if in_flight(page) == 0:
                return duration_totals(page, self.operation)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.url}: transfers still in flight after {METRICS_TIMEOUT:.0f}s")
            time.sleep(0.001)

    def wait(self, count: int) -> None:
        """Read the totals, which must count `count` transfers: a daemon counts a transfer before its
        client is answered, and now() waits for any other to end."""
        reading = self.now()
        if reading[0] != count:
            raise ValueError(f"{self.url}: {self.operation} count {reading[0]}, expected {count}")
        self.readings.append(reading)


def _tensor(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _timed(probe: Probe, once: Callable[[], None], prepare: Callable[[], None], repeats: int,
           pids: tuple[int, ...]) -> tuple[Sample, list[float]]:
    """One untimed run, then `repeats` timed, the probe read before each and after the last."""
    first = probe.now()[0]
    prepare()
    once()
    runs = [0]

    def setup() -> None:
        prepare()
        probe.wait(first + 1 + runs[0])
        runs[0] += 1

    sample = repeat(once, repeats, warmup=0, pids=pids, setup=setup)
    probe.wait(first + 1 + repeats)
    return sample, per_run(probe.readings)


def push(pair: Pair, nbytes: int, repeats: int) -> tuple[Sample, list[float]]:
    """put(dest=B) on A until B verified and published it; A's send time from /metrics."""
    data = _tensor(nbytes, 1)
    with pair.a.client() as ca, pair.b.client() as cb:
        sample, transfer = _timed(Probe(pair.metrics["A"], "send"), lambda: ca.put("plane-push", {"x": data}, dest="B"),
                                  lambda: cb.delete("plane-push"), repeats, (pair.a.pid, pair.b.pid))
        out = cb.get("plane-push", timeout=10)["x"]
    assert torch.equal(out, data), f"a push on the {pair.plane} plane delivered different bytes"
    return sample, transfer


def pull(pair: Pair, nbytes: int, repeats: int) -> tuple[Sample, list[float]]:
    """get(source=A, out=...) on B: B's daemon pulls, the client copies out; B's receive time from /metrics."""
    data, out = _tensor(nbytes, 2), torch.ones(nbytes, dtype=torch.uint8)
    with pair.a.client() as ca, pair.b.client() as cb:
        def fresh_entry() -> None:  # (A drops its copy once B's done reaches it)
            ca.delete("plane-pull")
            ca.put("plane-pull", {"x": data})

        sample, transfer = _timed(Probe(pair.metrics["B"], "receive"),
                                  lambda: cb.get("plane-pull", source="A", out={"x": out}), fresh_entry, repeats,
                                  (pair.a.pid, pair.b.pid))
    assert torch.equal(out, data), f"a pull on the {pair.plane} plane delivered different bytes"
    return sample, transfer


def bare_writes(plane: str, progress: str, sizes: list[int], repeats: list[int], into: Cells) -> str | None:
    """A bare NIXL write of each size over the plane's transports (bench/peers/nixl_write.py, with this
    interpreter); None, or the line saying why there are no such rows."""
    env = {"UCX_TLS": PLANES[plane][1], "NIXL_BENCH_PROGRESS": progress}
    case = f"bare NIXL write, UCX {env['UCX_TLS']}, {progress} progress"
    code, out, err = peers.run_script(Path(sys.executable), peers.SCRIPTS / "nixl_write.py", sizes, repeats, env=env)
    result = peers.parse_result(out)
    line = peers.failure_line(case, code, result, err)
    if line is not None:
        return line
    for entry in result["results"]:
        if not entry.get("verified"):
            return f"{case}: the bytes written at {human(entry['size'])} differ: no rows"
        into[(bare(plane, progress), entry["size"])].add(Sample(entry["seconds"], entry["cpu"]))
    return None


@dataclass
class PlaneRun:
    cells: Cells
    zmq_rtt: float | None  # median seconds of a 256-byte ZeroMQ round trip over loopback TCP
    zmq_rtt_64k: float | None
    skipped: list[str]  # lines: what could not be measured, and why
    planes: list[str]


def measure(quick: bool, sizes: list[int] = SIZES, rounds: int | None = None) -> PlaneRun:
    """Every plane's push and pull, the bare NIXL writes and raw TCP, in alternating rounds."""
    cells: Cells = defaultdict(Cell)
    skipped: list[str] = []
    planes = [p for p in PLANES if p == "zmq" or nixl_installed()]
    if len(planes) < len(PLANES):
        skipped.append("planes: NIXL is not installed: zmq rows only (./dev setup installs it into .venv)")
    rtts: dict[str, list[float]] = {"small": [], "64k": []}
    rounds = rounds or (1 if quick else ROUNDS)
    with tempfile.TemporaryDirectory() as workdir:
        factory = DaemonFactory(Path(workdir), log_level="warning")
        try:
            pairs = {}
            for plane in planes:
                try:
                    pairs[plane] = start_pair(factory, plane)
                except AssertionError as exc:  # (a daemon that exited: its log's last line says why)
                    skipped.append(f"planes: the {plane} daemons did not start, no rows: "
                                   f"{[x for x in str(exc).splitlines() if x.strip()][-1]}")
            planes = list(pairs)
            for r in range(rounds):
                print(f"planes: round {r + 1} of {rounds} ...", flush=True)
                order = planes if r % 2 == 0 else planes[::-1]
                for n in sizes:
                    reps = repeats_for(n, quick)
                    for plane in order:
                        for op, run in (("push", push), ("pull", pull)):
                            cells[(f"{op} {plane}", n)].add(*run(pairs[plane], n, reps))
                    cells[("raw TCP", n)].add(baselines.tcp_throughput(n, reps))
                for plane in [p for p in order if p in NIXL_PLANES]:
                    for progress in PROGRESS if r % 2 == 0 else PROGRESS[::-1]:
                        line = bare_writes(plane, progress, sizes, [repeats_for(n, quick) for n in sizes], cells)
                        if line is not None and line not in skipped:
                            skipped.append(line)
                rtts["small"].append(baselines.zmq_pingpong(256, 200, "tcp"))
                rtts["64k"].append(baselines.zmq_pingpong(64 << 10, 200, "tcp"))
        finally:
            failures = factory.stop_all()
            if failures:
                print("\n".join(failures))
    return PlaneRun(dict(cells), statistics.median(rtts["small"]) if rtts["small"] else None,
                    statistics.median(rtts["64k"]) if rtts["64k"] else None, skipped, planes)


RESULTS = Path(__file__).resolve().with_name("RESULTS.md")


def section(quick: bool, sizes: list[int] = SIZES) -> tuple[list[Row], list[Check], list[str]]:
    """The planes' rows, goals and side-by-side tables, for __main__'s report."""
    run = measure(quick, sizes)
    recorded = recorded_rows(RESULTS.read_text()) if RESULTS.exists() else {}
    rtt = ""
    if run.zmq_rtt and run.zmq_rtt_64k:
        rtt = (f"ZeroMQ round trip over loopback TCP (pyzmq DEALER-ROUTER, median of the rounds): 256 B "
               f"{run.zmq_rtt * 1e6:.0f}us, 64 KiB {run.zmq_rtt_64k * 1e6:.0f}us")
    lines = ["", "Data planes side by side (bench/planes.py; GB/s of the median run; transfer only: the daemons' own "
             "time on /metrics, without the client's copy into or out of the pool):", "", *matrix(run.cells, sizes),
             "", rtt, "", "The ZeroMQ plane against bench/RESULTS.md's last recorded run (another run, another "
             "load: compare the ratios to raw TCP):", "", *regression_rows(run.cells, sizes, recorded),
             *(["", *run.skipped] if run.skipped else [])]
    return plane_rows(run.cells, sizes), goals(run.cells, sizes, run.zmq_rtt, recorded), lines
