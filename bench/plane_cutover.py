"""Where the NIXL plane starts to pay, and how to slice it: `python -m bench --plane-cutover`.

Entries under PLANE_MIN_BYTES (kvd/daemon/transfer/limits.py) go as chunk frames even on a NIXL link: a
plane adds a grant's round trip. Here daemons on the NIXL plane are forced onto it at every size
(KVD_TEST_PLANE_MIN_BYTES=1, a bench knob read at start: kvd/daemon/peer/transfers.py) and push and
pull 64 KiB to 2 MiB beside a ZeroMQ-plane pair, all three pairs up at once, in alternating rounds
(bench/planes.py's way, transfer-only times included). The cut-over is the smallest size from which
the plane is at least as fast at every size measured.

Then the slices: pushes and pulls of 16 MiB and 256 MiB with SLICE_BYTES x PLANE_IN_FLIGHT of 16 MiB x 2
(kvd's), 4 MiB x 4 and 8 MiB x 4 (KVD_TEST_PLANE_SLICE_BYTES, KVD_TEST_PLANE_IN_FLIGHT), each a pair
of its own, started and stopped in turn within each round (all up at once would hold 12 pools).
"""
from __future__ import annotations

import tempfile
from collections import defaultdict
from pathlib import Path

from kvd.daemon.transfer.limits import PLANE_IN_FLIGHT, PLANE_MIN_BYTES, SLICE_BYTES
from kvd.testing.daemons import DaemonFactory

from .measure import human
from .plane_report import NIXL_PLANES, PLANES, Cell, Cells, Check, Row, gbps
from .planes import ROUNDS, nixl_installed, pull, push, start_pair

KIB, MIB = 1 << 10, 1 << 20
CUT_SIZES = [64 * KIB, 128 * KIB, 256 * KIB, 512 * KIB, 1 * MIB, 2 * MIB]  # (64 KiB: what a grant costs there)
CUT_REPEATS = (10, 30)  # per round: quick, full
FORCED = {"KVD_TEST_PLANE_MIN_BYTES": "1"}
SLICE_SIZES = [16 * MIB, 256 * MIB]
SLICINGS = [(SLICE_BYTES, PLANE_IN_FLIGHT), (4 * MIB, 4), (8 * MIB, 4)]  # kvd's first: the others' reference
SLICE_REPEATS = {16 * MIB: (3, 8), 256 * MIB: (1, 2)}


def slicing_name(slicing: tuple[int, int]) -> str:
    return f"{human(slicing[0])} x {slicing[1]}"


def cutover(cells: Cells, sizes: list[int], case: str, reference: str) -> int | None:
    """The smallest size from which `case` (end to end median) is no slower than `reference` at every
    size measured from there up; None where it is slower at the largest."""
    found = None
    for n in sorted(sizes, reverse=True):
        mine, theirs = cells.get((case, n)), cells.get((reference, n))
        if mine is None or theirs is None or not mine.seconds or not theirs.seconds or mine.median > theirs.median:
            break
        found = n
    return found


def compare_rows(cells: Cells, sizes: list[int], cases: list[tuple[str, str]], reference: str,
                 words: str) -> list[Row]:
    """A row per case and size (and its transfer-only row), with how much faster than `reference` it was."""
    rows: list[Row] = []
    for n in sizes:
        ref = cells.get((reference, n))
        for key, label in cases:
            cell = cells.get((key, n))
            if cell is None or not cell.seconds:
                continue
            note = f"{ref.median / cell.median:.2f}x {words}" if ref and ref.seconds and key != reference else ""
            cpu = cell.cpu_per_gb(n)
            rows.append((label, human(n), gbps(n, cell.median), f"{cell.median * 1e3:.3f}",
                         f"{cpu:.2f}" if cpu is not None else "", note))
            t, ref_t = cell.transfer_median, ref.transfer_median if ref else None
            if t:
                rows.append(("  transfer only", human(n), gbps(n, t), f"{t * 1e3:.3f}", "",
                             f"{ref_t / t:.2f}x {words}" if ref_t and key != reference else ""))
    return rows


def measure_cutover(quick: bool, rounds: int) -> Cells:
    cells: Cells = defaultdict(Cell)
    planes = ["zmq", *NIXL_PLANES]
    repeats = CUT_REPEATS[0 if quick else 1]
    with tempfile.TemporaryDirectory() as workdir:
        factory = DaemonFactory(Path(workdir), log_level="warning")
        try:
            pairs = {plane: start_pair(factory, plane, "64MiB", env=None if plane == "zmq" else FORCED)
                     for plane in planes}
            for r in range(rounds):
                print(f"plane cut-over: round {r + 1} of {rounds} ...", flush=True)
                for n in CUT_SIZES:
                    for plane in planes if r % 2 == 0 else planes[::-1]:
                        cells[(f"push {plane}", n)].add(*push(pairs[plane], n, repeats))
                        cells[(f"pull {plane}", n)].add(*pull(pairs[plane], n, repeats))
        finally:
            failures = factory.stop_all()
            if failures:
                print("\n".join(failures))
    return dict(cells)


def measure_slices(quick: bool, rounds: int) -> Cells:
    cells: Cells = defaultdict(Cell)
    configs = [(plane, slicing) for plane in NIXL_PLANES for slicing in SLICINGS]
    with tempfile.TemporaryDirectory() as workdir:
        factory = DaemonFactory(Path(workdir), log_level="warning")
        try:
            for r in range(rounds):
                print(f"plane slices: round {r + 1} of {rounds} ...", flush=True)
                for plane, slicing in configs if r % 2 == 0 else configs[::-1]:
                    knobs = {"KVD_TEST_PLANE_SLICE_BYTES": str(slicing[0]), "KVD_TEST_PLANE_IN_FLIGHT": str(slicing[1])}
                    pair = start_pair(factory, plane, env=knobs)
                    try:
                        for n in SLICE_SIZES:
                            repeats = SLICE_REPEATS[n][0 if quick else 1]
                            key = f"{plane} {slicing_name(slicing)}"
                            cells[(f"push {key}", n)].add(*push(pair, n, repeats))
                            cells[(f"pull {key}", n)].add(*pull(pair, n, repeats))
                    finally:
                        pair.a.stop()
                        pair.b.stop()
        finally:
            failures = factory.stop_all()
            if failures:
                print("\n".join(failures))
    return dict(cells)


def section(quick: bool) -> tuple[list[Row], list[Check], list[str]]:
    """Rows and lines for __main__'s report (no targets: these measurements choose, they do not judge)."""
    if not nixl_installed():
        return [], [], ["", "plane cut-over: NIXL is not installed (./dev setup installs it into .venv): nothing "
                            "to measure"]
    rounds = 1 if quick else ROUNDS
    cut, sliced = measure_cutover(quick, rounds), measure_slices(quick, rounds)
    rows: list[Row] = []
    lines = ["", f"The cut-over (kvd's PLANE_MIN_BYTES is {human(PLANE_MIN_BYTES)}; end to end medians; the NIXL "
                 "rows forced onto the plane at every size):", ""]
    for op in ("push", "pull"):
        cases = [(f"{op} zmq", f"kvd {op}, zmq plane")] + [
            (f"{op} {plane}", f"kvd {op}, {PLANES[plane][2]}, forced onto the plane") for plane in NIXL_PLANES]
        rows += compare_rows(cut, CUT_SIZES, cases, f"{op} zmq", "zmq plane")
        for plane in NIXL_PLANES:
            at = cutover(cut, CUT_SIZES, f"{op} {plane}", f"{op} zmq")
            where = (f"from {human(at)} up" if at is not None
                     else f"at none of {human(CUT_SIZES[0])}-{human(CUT_SIZES[-1])}")
            lines.append(f"- {op}, {PLANES[plane][2]}: the plane is at least as fast as frames {where}")
    lines += ["", f"Slices: the rows \"slices A x B\" in the table, each against kvd's {slicing_name(SLICINGS[0])} "
                  f"(SLICE_BYTES x PLANE_IN_FLIGHT; a pair of daemons each, started in turn)."]
    for op in ("push", "pull"):
        for plane in NIXL_PLANES:
            cases = [(f"{op} {plane} {slicing_name(s)}", f"kvd {op}, {PLANES[plane][2]}, slices {slicing_name(s)}")
                     for s in SLICINGS]
            rows += compare_rows(sliced, SLICE_SIZES, cases, cases[0][0], slicing_name(SLICINGS[0]))
    return rows, [], lines
