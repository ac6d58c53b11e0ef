"""The data planes' benchmark without daemons (bench/planes.py measures): what its cells hold, the
daemons' /metrics read for a transfer's own time, bench/RESULTS.md's last recorded ZeroMQ rows, the
table rows, and issue 40's goals as ratios of the same run."""
from __future__ import annotations

import itertools
import math
import re
import statistics
from dataclasses import dataclass, field

from .measure import Sample, human

MIB = 1 << 20
Row = tuple[str, str, str, str, str, str]
Check = tuple[str, float, str, float, bool]  # (target, measured, op, goal, met): __main__'s targets table

# kvd's planes as the benchmark runs them: (--data-plane, UCX_TLS or None, the row's words)
PLANES = {"zmq": ("zmq", None, "zmq plane"),
          "nixl-tcp": ("nixl", "tcp", "NIXL plane, UCX tcp"),
          "nixl-shm": ("nixl", "sm,tcp", "NIXL plane, UCX sm,tcp (cma)")}
NIXL_PLANES = ("nixl-tcp", "nixl-shm")
PROGRESS = ("event", "busy")  # a bare NIXL write's progress threads: as kvd builds them, NIXL's default
PUSH_GOAL, CPU_GOAL, REGRESSION_GOAL = 0.8, 1.0, 0.9


def bare(plane: str, progress: str) -> str:
    """The cell of a bare NIXL write over a NIXL plane's transports."""
    return f"bare {plane} {progress}"


@dataclass
class Cell:
    """One case at one size, pooled over the rounds."""

    seconds: list[float] = field(default_factory=list)  # end to end, per run
    cpu: list[float] = field(default_factory=list)  # CPU-s per run, every process of the case
    transfer: list[float] = field(default_factory=list)  # the daemons' own time, per run (kvd's rows only)

    def add(self, sample: Sample, transfer: list[float] = ()) -> None:
        self.seconds += sample.seconds
        self.cpu += sample.cpu
        self.transfer += list(transfer)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def transfer_median(self) -> float | None:
        return statistics.median(self.transfer) if self.transfer else None

    def cpu_per_gb(self, nbytes: int) -> float | None:
        return statistics.fmean(self.cpu) / (nbytes / 1e9) if self.cpu else None


Cells = dict[tuple[str, int], Cell]  # (case, size) -> its runs; cases: "push zmq", "bare nixl-tcp event", "raw TCP"


def duration_totals(metrics: str, operation: str) -> tuple[int, float]:
    """(count, sum in seconds) of kvd_operation_duration_seconds{operation=...} in a /metrics page."""
    found: dict[str, float] = {}
    pattern = re.compile(r'^kvd_operation_duration_seconds_(count|sum)\{([^}]*)\}\s+(\S+)', re.M)
    for kind, labels, value in pattern.findall(metrics):
        if f'operation="{operation}"' in labels:
            found[kind] = float(value)
    return int(found.get("count", 0)), found.get("sum", 0.0)


def in_flight(metrics: str) -> int:
    """kvd_transfers_in_flight, every direction, in a /metrics page."""
    return sum(int(float(v)) for v in re.findall(r'^kvd_transfers_in_flight\{[^}]*\}\s+(\S+)', metrics, re.M))


def per_run(readings: list[tuple[int, float]]) -> list[float]:
    """Each run's own duration from the totals read before every run and after the last, one transfer
    each: a reading that counted any other number of transfers is an error, not a figure."""
    runs = []
    for (count0, sum0), (count1, sum1) in itertools.pairwise(readings):
        if count1 - count0 != 1:
            raise ValueError(f"expected one transfer between two readings of /metrics, counted {count1 - count0}")
        runs.append(sum1 - sum0)
    return runs


def recorded_rows(results_md: str, section: str = "## Latest run") -> dict[tuple[str, str], float]:
    """GB/s of each (case, size) in the first table under `section` of bench/RESULTS.md."""
    start = results_md.find(section)
    if start < 0:
        return {}
    rows: dict[tuple[str, str], float] = {}
    for line in results_md[start:].splitlines()[1:]:
        if line.startswith("## "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[2] and re.fullmatch(r"[\d.]+", cells[2]):
            rows.setdefault((cells[0], cells[1]), float(cells[2]))
        elif rows and not line.strip():
            break  # (the end of its first table)
    return rows


def gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f}"


def _cpu(cell: Cell, nbytes: int) -> str:
    value = cell.cpu_per_gb(nbytes)
    return f"{value:.2f}" if value is not None else ""


def plane_rows(cells: Cells, sizes: list[int]) -> list[Row]:
    """Every case by size, with each row's ratio to raw TCP and, for kvd's NIXL rows, to the bare write."""
    rows: list[Row] = []
    for n in sizes:
        tcp = cells.get(("raw TCP", n))
        for plane, (_, _, words) in PLANES.items():
            for op, how in (("push", "put(dest=B)"), ("pull", "get(source=A)")):
                cell = cells.get((f"{op} {plane}", n))
                if cell is None or not cell.seconds:
                    continue
                notes = [f"{tcp.median / cell.median:.2f}x raw TCP" if tcp else ""]
                best = best_bare(cells, plane, n)
                if best is not None:
                    notes.append(f"{best[1] / cell.median:.2f}x bare NIXL write ({best[0]} progress)")
                rows.append((f"kvd {op} {how}, {words}", human(n), gbps(n, cell.median), f"{cell.median * 1e3:.3f}",
                             _cpu(cell, n), ", ".join(x for x in notes if x)))
                if cell.transfer:
                    t = cell.transfer_median
                    side = "A's send: commit to B's done" if op == "push" else "B's receive: pull to published"
                    note = f"{best[1] / t:.2f}x bare NIXL write" if best is not None else ""
                    rows.append((f"  transfer only ({side})", human(n), gbps(n, t), f"{t * 1e3:.3f}", "", note))
        for plane in NIXL_PLANES:
            for progress in PROGRESS:
                cell = cells.get((bare(plane, progress), n))
                if cell is not None and cell.seconds:
                    note = f"{tcp.median / cell.median:.2f}x raw TCP" if tcp else ""
                    rows.append((f"bare NIXL write, UCX {PLANES[plane][1]}, {progress} progress", human(n),
                                 gbps(n, cell.median), f"{cell.median * 1e3:.3f}", _cpu(cell, n), note))
        if tcp is not None:
            rows.append(("raw TCP loopback", human(n), gbps(n, tcp.median), f"{tcp.median * 1e3:.3f}", _cpu(tcp, n),
                         ""))
    return rows


def best_bare(cells: Cells, plane: str, n: int) -> tuple[str, float] | None:
    """(progress, median seconds) of the faster bare NIXL write over this plane's transports, if any."""
    found = [(p, cells[(bare(plane, p), n)].median) for p in PROGRESS
             if cells.get((bare(plane, p), n)) and cells[(bare(plane, p), n)].seconds]
    return min(found, key=lambda item: item[1]) if found else None


def goals(cells: Cells, sizes: list[int], zmq_rtt: float | None, recorded: dict[tuple[str, str], float]) -> list[Check]:
    """Issue 40's goals, as ratios of this run (the regression one against RESULTS.md's last recorded run)."""
    checks: list[Check] = []

    def check(name: str, value: float, op: str, limit: float) -> None:
        if not math.isnan(value):
            checks.append((name, value, op, limit, value >= limit if op == ">=" else value <= limit))

    for plane in NIXL_PLANES:
        words = PLANES[plane][2]
        for n in sizes:
            push, best = cells.get((f"push {plane}", n)), best_bare(cells, plane, n)
            if push is None or not push.seconds or best is None:
                continue
            if n >= MIB:
                check(f"{human(n)} push, {words} / bare NIXL write ({best[0]} progress), end to end",
                      best[1] / push.median, ">=", PUSH_GOAL)
                if push.transfer:
                    check(f"{human(n)} push, {words} / bare NIXL write ({best[0]} progress), transfer only",
                          best[1] / push.transfer_median, ">=", PUSH_GOAL)
            elif zmq_rtt is not None:
                check(f"{human(n)} push on a {words} link / (bare NIXL write {best[1] * 1e6:.0f}us + ZeroMQ "
                      f"round trip {zmq_rtt * 1e6:.0f}us)", push.median / (best[1] + zmq_rtt), "<=", 1.0)
        for op in ("push", "pull"):
            ratios = [cpu_ratio(cells, f"{op} {plane}", f"{op} zmq", n) for n in sizes if n >= MIB]
            ratios = [r for r in ratios if r is not None]
            if ratios:
                check(f"CPU-s/GB, {op}, {words} / zmq plane (worst of {human(MIB)} and up)", max(ratios), "<=",
                      CPU_GOAL)
    for op, case in (("push", "kvd push put(dest=B)"), ("pull", "kvd pull get(source=A)")):
        value = regression(cells, sizes, op, case, recorded)
        if value is not None:
            check(f"zmq plane {op} against RESULTS.md's last recorded run (another run), each relative to its "
                  f"raw TCP, geometric mean of {len(sizes)} sizes", value, ">=", REGRESSION_GOAL)
    return checks


def cpu_ratio(cells: Cells, case: str, reference: str, n: int) -> float | None:
    a, b = cells.get((case, n)), cells.get((reference, n))
    if a is None or b is None:
        return None
    x, y = a.cpu_per_gb(n), b.cpu_per_gb(n)
    return x / y if x is not None and y else None


def regression(cells: Cells, sizes: list[int], op: str, case: str,
               recorded: dict[tuple[str, str], float]) -> float | None:
    """Geometric mean over sizes of (this run's zmq-plane GB/s / its raw TCP) over (the recorded run's
    kvd GB/s / its raw TCP): how the ZeroMQ plane fares against the machine, then and now."""
    logs = []
    for n in sizes:
        mine, tcp = cells.get((f"{op} zmq", n)), cells.get(("raw TCP", n))
        then, then_tcp = recorded.get((case, human(n))), recorded.get(("raw TCP loopback", human(n)))
        if mine is None or tcp is None or not then or not then_tcp or not mine.seconds or not tcp.seconds:
            continue
        logs.append(math.log((tcp.median / mine.median) / (then / then_tcp)))
    return math.exp(statistics.fmean(logs)) if logs else None


def regression_rows(cells: Cells, sizes: list[int], recorded: dict[tuple[str, str], float]) -> list[str]:
    """Lines of a table: the zmq plane now beside RESULTS.md's last recorded run, size by size."""
    lines = ["| zmq plane | size | GB/s now | GB/s recorded | now / recorded | x raw TCP now | x raw TCP recorded |",
             "|---|---|---|---|---|---|---|"]
    for op, case in (("push", "kvd push put(dest=B)"), ("pull", "kvd pull get(source=A)")):
        for n in sizes:
            mine, tcp = cells.get((f"{op} zmq", n)), cells.get(("raw TCP", n))
            then, then_tcp = recorded.get((case, human(n))), recorded.get(("raw TCP loopback", human(n)))
            if mine is None or not mine.seconds or not then:
                continue
            now = n / mine.median / 1e9
            rel_now = f"{tcp.median / mine.median:.2f}" if tcp and tcp.seconds else ""
            rel_then = f"{then / then_tcp:.2f}" if then_tcp else ""
            lines.append(f"| {op} | {human(n)} | {now:.2f} | {then:.2f} | {now / then:.2f} | {rel_now} | {rel_then} |")
    return lines


def matrix(cells: Cells, sizes: list[int]) -> list[str]:
    """Every case side by side by size: GB/s end to end (transfer only), and CPU-s/GB."""
    cases: list[tuple[str, str]] = []
    for plane, (_, _, words) in PLANES.items():
        cases += [(f"push {plane}", f"kvd push, {words}"), (f"pull {plane}", f"kvd pull, {words}")]
    for plane in NIXL_PLANES:
        cases += [(bare(plane, p), f"bare NIXL write, UCX {PLANES[plane][1]}, {p} progress") for p in PROGRESS]
    cases.append(("raw TCP", "raw TCP loopback"))
    head = " | ".join(human(n) for n in sizes)
    lines = [f"| GB/s end to end (transfer only) | {head} | CPU-s/GB: {head} |",
             "|---|" + "---|" * (2 * len(sizes))]
    for key, words in cases:
        found = [cells.get((key, n)) for n in sizes]
        if not any(c is not None and c.seconds for c in found):
            continue
        speed, cpu = [], []
        for n, cell in zip(sizes, found):
            if cell is None or not cell.seconds:
                speed.append("")
                cpu.append("")
                continue
            t = cell.transfer_median
            speed.append(gbps(n, cell.median) + (f" ({gbps(n, t)})" if t else ""))
            cpu.append(_cpu(cell, n))
        lines.append(f"| {words} | {' | '.join(speed)} | {' | '.join(cpu)} |")
    return lines
