"""`python -m bench --planes` and `--plane-cutover` without daemons: the /metrics totals a transfer's own
time is read from, RESULTS.md's last recorded rows, the rows, issue 40's goals as ratios, the cut-over.
(The daemons' side, the bench knobs, is tested in tests/system/test_plane.py.)"""
from __future__ import annotations

import math

import pytest

from bench.measure import Sample
from bench.plane_cutover import compare_rows, cutover
from bench.plane_report import (
    Cell,
    bare,
    best_bare,
    duration_totals,
    goals,
    in_flight,
    matrix,
    per_run,
    plane_rows,
    recorded_rows,
    regression,
)

KIB64, MIB, BIG = 64 << 10, 1 << 20, 256 << 20

METRICS = """# HELP kvd_operation_duration_seconds Time from request to completion, by operation
# TYPE kvd_operation_duration_seconds histogram
kvd_operation_duration_seconds_bucket{le="0.0001",operation="send"} 0.0
kvd_operation_duration_seconds_count{operation="send"} 3.0
kvd_operation_duration_seconds_sum{operation="send"} 0.0125
kvd_operation_duration_seconds_count{operation="receive"} 7.0
kvd_operation_duration_seconds_sum{operation="receive"} 0.5
kvd_operation_duration_seconds_created{operation="send"} 1.7e9
# TYPE kvd_transfers_in_flight gauge
kvd_transfers_in_flight{direction="sent"} 1.0
kvd_transfers_in_flight{direction="received"} 2.0
"""


def test_a_transfers_own_time_is_read_from_the_daemons_histogram_one_transfer_a_run():
    assert duration_totals(METRICS, "send") == (3, 0.0125)
    assert duration_totals(METRICS, "receive") == (7, 0.5)
    assert duration_totals(METRICS, "local_get") == (0, 0.0)
    assert in_flight(METRICS) == 3
    assert in_flight("kvd_pool_used_bytes 0.0\n") == 0
    assert per_run([(3, 0.5), (4, 0.75), (5, 1.0)]) == [0.25, 0.25]
    # a reading that counted two transfers (or none) cannot be split into runs: an error, not a figure
    with pytest.raises(ValueError, match="counted 2"):
        per_run([(3, 0.5), (5, 0.75)])
    with pytest.raises(ValueError, match="counted 0"):
        per_run([(3, 0.5), (3, 0.5)])


RESULTS = """# Benchmark results

## Latest run

machine: x86_64, 2 cores

| case | size | GB/s | median ms | CPU-s/GB | vs baseline |
|---|---|---|---|---|---|
| raw TCP loopback | 1MiB | 6.05 | 0.173 | 0.28 |  |
| kvd push put(dest=B) | 1MiB | 0.68 | 1.535 | 1.74 | 0.11x raw TCP |
| kvd 64KiB push | 64KiB |  | 0.795 |  | 20.09x TCP ping-pong (40us) |

| target | measured | goal | result |
|---|---|---|---|
| 1MiB push vs raw TCP | 0.11 | >= 0.25 | FAIL |

## Peer rows

| case | size | GB/s | median ms | CPU-s/GB | vs baseline |
|---|---|---|---|---|---|
| kvd push put(dest=B) | 1MiB | 9.99 | 0.1 | 0.1 |  |
"""


def test_the_last_recorded_run_is_the_first_table_under_latest_run():
    assert recorded_rows(RESULTS) == {("raw TCP loopback", "1MiB"): 6.05, ("kvd push put(dest=B)", "1MiB"): 0.68}
    assert recorded_rows("# nothing recorded yet\n") == {}


def cell(median_s: float, cpu_s: float = 0.0, transfer_s: float | None = None) -> Cell:
    c = Cell()
    c.add(Sample([median_s * 0.9, median_s, median_s * 1.5], [cpu_s] * 3),
          [transfer_s] * 3 if transfer_s is not None else ())
    return c


def run_cells() -> dict:
    """A run where the TCP plane meets its goals and the shared-memory one misses them."""
    return {
        ("push zmq", KIB64): cell(800e-6, 0.001), ("push zmq", MIB): cell(1e-3, 0.002),
        ("pull zmq", MIB): cell(1e-3, 0.002),
        ("push nixl-tcp", KIB64): cell(300e-6, 0.001), ("push nixl-tcp", MIB): cell(0.5e-3, 0.001, 0.4e-3),
        ("pull nixl-tcp", MIB): cell(1e-3, 0.0015),
        (bare("nixl-tcp", "event"), KIB64): cell(100e-6), (bare("nixl-tcp", "busy"), KIB64): cell(900e-6),
        (bare("nixl-tcp", "event"), MIB): cell(0.45e-3), (bare("nixl-tcp", "busy"), MIB): cell(2e-3),
        ("push nixl-shm", KIB64): cell(400e-6), ("push nixl-shm", MIB): cell(1e-3, 0.003, 0.5e-3),
        (bare("nixl-shm", "busy"), KIB64): cell(20e-6), (bare("nixl-shm", "busy"), MIB): cell(0.1e-3),
        ("raw TCP", KIB64): cell(40e-6), ("raw TCP", MIB): cell(0.2e-3),
    }


def by_name(checks: list) -> dict:
    return {name: (value, ok) for name, value, _, _, ok in checks}


def test_each_goal_is_a_ratio_of_the_same_run_against_the_faster_bare_write():
    cells = run_cells()
    assert best_bare(cells, "nixl-tcp", MIB) == ("event", pytest.approx(0.45e-3))
    assert best_bare(cells, "nixl-shm", MIB) == ("busy", pytest.approx(0.1e-3))
    assert best_bare(cells, "nixl-tcp", BIG) is None
    checks = by_name(goals(cells, [KIB64, MIB], zmq_rtt=80e-6, recorded={}))
    tcp = "1MiB push, NIXL plane, UCX tcp / bare NIXL write (event progress)"
    assert checks[f"{tcp}, end to end"] == (pytest.approx(0.45 / 0.5), True)
    assert checks[f"{tcp}, transfer only"] == (pytest.approx(0.45 / 0.4), True)
    shm = "1MiB push, NIXL plane, UCX sm,tcp (cma) / bare NIXL write (busy progress)"
    assert checks[f"{shm}, end to end"] == (pytest.approx(0.1), False)
    assert checks[f"{shm}, transfer only"] == (pytest.approx(0.2), False)
    # 64 KiB: one push against one bare write plus one ZeroMQ round trip
    small = "64KiB push on a NIXL plane, UCX tcp link / (bare NIXL write 100us + ZeroMQ round trip 80us)"
    assert checks[small] == (pytest.approx(300 / 180), False)
    # CPU-s/GB against the zmq plane's, the worst size of 1 MiB and up
    cpu = "CPU-s/GB, {}, NIXL plane, {} / zmq plane (worst of 1MiB and up)"
    assert checks[cpu.format("push", "UCX tcp")] == (pytest.approx(0.5), True)
    assert checks[cpu.format("pull", "UCX tcp")] == (pytest.approx(0.75), True)
    assert checks[cpu.format("push", "UCX sm,tcp (cma)")] == (pytest.approx(1.5), False)
    # no pull on shared memory was measured: no goal invented for it
    assert not any("pull, NIXL plane, UCX sm,tcp" in name for name in checks)


def test_the_zmq_plane_is_compared_with_the_recorded_run_relative_to_each_runs_raw_tcp():
    cells = run_cells()
    recorded = recorded_rows(RESULTS)
    # now: 0.2 ms raw TCP / 1 ms push = 0.2x; then: 0.68 / 6.05 GB/s = 0.112x
    assert regression(cells, [KIB64, MIB], "push", "kvd push put(dest=B)", recorded) == pytest.approx(
        0.2 / (0.68 / 6.05))
    assert regression(cells, [KIB64, MIB], "pull", "kvd pull get(source=A)", recorded) is None  # never recorded
    checks = by_name(goals(cells, [KIB64, MIB], None, recorded))
    name = next(n for n in checks if n.startswith("zmq plane push against RESULTS.md"))
    assert checks[name] == (pytest.approx(1.78, abs=0.01), True)
    assert not any("64KiB push on a" in n for n in checks)  # no round trip measured: no small-push goal


def test_rows_carry_both_timings_and_the_ratios_to_raw_tcp_and_the_bare_write():
    rows = plane_rows(run_cells(), [MIB])
    push = next(r for r in rows if r[0] == "kvd push put(dest=B), NIXL plane, UCX tcp")
    assert push[1:5] == ("1MiB", f"{MIB / 0.5e-3 / 1e9:.2f}", "0.500", f"{0.001 / (MIB / 1e9):.2f}")
    assert push[5] == "0.40x raw TCP, 0.90x bare NIXL write (event progress)"
    transfer = rows[rows.index(push) + 1]
    assert transfer[0] == "  transfer only (A's send: commit to B's done)" and transfer[3] == "0.400"
    assert transfer[5] == "1.12x bare NIXL write"
    busy = next(r for r in rows if r[0].startswith("bare NIXL write, UCX sm,tcp"))
    assert busy[:2] == ("bare NIXL write, UCX sm,tcp, busy progress", "1MiB")
    assert rows[-1][0] == "raw TCP loopback"
    table = matrix(run_cells(), [KIB64, MIB])
    assert table[0] == "| GB/s end to end (transfer only) | 64KiB | 1MiB | CPU-s/GB: 64KiB | 1MiB |"
    line = next(x for x in table if x.startswith("| kvd push, NIXL plane, UCX tcp |"))
    assert f"| {MIB / 0.5e-3 / 1e9:.2f} ({MIB / 0.4e-3 / 1e9:.2f}) |" in line
    assert not any("kvd pull, NIXL plane, UCX sm,tcp" in x for x in table)  # nothing measured: no row


def test_the_cut_over_is_where_the_plane_stays_at_least_as_fast_as_frames():
    sizes = [128 << 10, 256 << 10, 512 << 10, MIB]
    cells = {("push zmq", n): cell(t) for n, t in zip(sizes, (0.5e-3, 0.6e-3, 0.8e-3, 1.2e-3))}
    plane = dict(zip(sizes, (0.9e-3, 0.5e-3, 1.0e-3, 1.0e-3)))  # faster at 256 KiB, slower at 512 KiB again
    cells |= {("push nixl-tcp", n): cell(t) for n, t in plane.items()}
    assert cutover(cells, sizes, "push nixl-tcp", "push zmq") == MIB
    cells[("push nixl-tcp", 512 << 10)] = cell(0.7e-3)
    assert cutover(cells, sizes, "push nixl-tcp", "push zmq") == 256 << 10
    cells[("push nixl-tcp", MIB)] = cell(2e-3)
    assert cutover(cells, sizes, "push nixl-tcp", "push zmq") is None  # slower at the largest: nowhere
    rows = compare_rows(cells, [MIB], [("push zmq", "frames"), ("push nixl-tcp", "plane")], "push zmq", "zmq plane")
    assert [r[0] for r in rows] == ["frames", "plane"]
    assert rows[0][5] == "" and rows[1][5] == "0.60x zmq plane"


def test_a_cell_pools_rounds_and_has_no_cpu_figure_without_cpu_readings():
    c = Cell()
    c.add(Sample([1.0, 3.0], [0.1, 0.3]), [0.5, 0.7])
    c.add(Sample([2.0], [0.2]))
    assert c.median == 2.0 and c.transfer_median == pytest.approx(0.6)
    assert c.cpu_per_gb(int(1e9)) == pytest.approx(0.2)
    assert Cell(seconds=[1.0]).cpu_per_gb(MIB) is None and Cell(seconds=[1.0]).transfer_median is None
    assert math.isclose(cell(1e-3).median, 1e-3)
