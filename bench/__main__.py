"""Run every baseline and kvd case in one go and print one table with ratios and targets.

    python -m bench            # full run (a few minutes on 2 cores)
    python -m bench --quick    # fewer repeats, for a smoke check
    python -m bench --peers    # also Mooncake and NIXL rows (bench/peers.py; own venv, .venv-peers)
    python -m bench --planes   # only kvd's data planes side by side (bench/planes.py; part of every full run)
    python -m bench --plane-cutover   # where the NIXL plane starts to pay, and its slices (bench/plane_cutover.py)
    python -m bench --sglang   # only SGLang's HiCache L3: kvd's backend against its file backend (sglang_tier.py)
    python -m bench --disk-tier   # only the KV tier's disk level: against raw pwrite/pread and SGLang's file
                               # backend, on this machine's disk and tmpfs, restart to first hit (bench/disk_tier.py;
                               # part of every full run)
    python -m bench --connector [--sizes ... --requests N --rows ...]   # TTFT through vLLM engines
                               # (bench/connector.py: kvd's connector, NixlConnector, one engine alone)
    python -m bench --connector --prefix   # prefix reuse through kvd's tier (bench/connector_prefix.py)
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvd.testing.daemons import DaemonFactory

from . import baselines, cases, disk_tier, peers, planes
from .measure import human, pooled

SIZES = [64 << 10, 1 << 20, 16 << 20, 256 << 20]
BIG = 256 << 20  # the size the throughput and CPU targets are set at
SMALL_ROUNDS = 3
# the 256 MiB push and pull are timed in rounds alternating with raw TCP (and pooled with the
# first baseline pass): minutes apart, this VM's loopback speed can differ by a third
PAIRED_ROUNDS = 3
# layer-streamed handoffs: (bytes per layer, seconds of "compute" per layer), 32 layers each
STREAM_LAYERS = 32
STREAM_CASES = [(2 << 20, 0.005), (8 << 20, 0.010)]


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def repeats_for(nbytes: int, quick: bool) -> int:
    if nbytes >= 256 << 20:
        return 3 if quick else 5
    if nbytes >= 16 << 20:
        return 5 if quick else 10
    return 20 if quick else 100


def main() -> int:
    if "--connector" in sys.argv[1:]:  # a benchmark of its own, with its own options
        from . import connector

        return connector.main([arg for arg in sys.argv[1:] if arg != "--connector"])
    args = _parse_args()
    if args.sglang:
        from . import sglang_tier

        return sglang_tier.main(["--quick"] if args.quick else [])
    if args.planes or args.plane_cutover or args.disk_tier:
        return planes_only(args)
    return full_run(args)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--output", type=Path, help="also write the report (markdown) to this file")
    parser.add_argument("--peers", action="store_true",
                        help="also measure Mooncake Transfer Engine and NIXL (installed into .venv-peers on first use)")
    parser.add_argument("--sglang", action="store_true",
                        help="only the SGLang HiCache backends side by side: kvd against SGLang's file backend "
                             "on tmpfs (bench/sglang_tier.py; --quick: fewer pages)")
    parser.add_argument("--planes", action="store_true",
                        help="only kvd's push and pull over each data plane (zmq; NIXL on UCX tcp and sm,tcp) beside "
                             "a bare NIXL write and raw TCP, with issue 40's goals (bench/planes.py)")
    parser.add_argument("--disk-tier", action="store_true",
                        help="only the KV tier's disk level (issue 43): page write and read against raw pwrite and "
                             "pread, SGLang's file backend, restart to first hit, on this disk and tmpfs "
                             "(bench/disk_tier.py)")
    parser.add_argument("--plane-cutover", action="store_true",
                        help="only the NIXL plane against frames at 64 KiB-2 MiB (where to set PLANE_MIN_BYTES), and "
                             "its slice size and slices in flight (bench/plane_cutover.py)")
    return parser.parse_args()


Row = tuple[str, str, str, str, str, str]
Check = tuple[str, float, str, float, bool]


def table_row(case: str, size: int, seconds: float, cpu: float | None, baseline: str, ratio: float | None) -> Row:
    """A row of the report's table: the case, its size, GB/s, median ms, CPU-s per GB, vs its baseline."""
    cpu_text = f"{cpu / (size / 1e9):.2f}" if cpu is not None else ""
    return (case, human(size), f"{gbps(size, seconds):.2f}", f"{seconds * 1e3:.3f}", cpu_text,
            f"{ratio:.2f}x {baseline}" if ratio is not None else "")


def target_check(name: str, value: float, op: str, limit: float) -> Check:
    """A target: the measured value against its limit (op ">=" or "<=")."""
    ok = value >= limit if op == ">=" else value <= limit
    return (name, value, op, limit, ok)


def full_run(args: argparse.Namespace) -> int:
    """Every baseline and kvd case, the planes' and the disk level's sections, and the peers' with --peers."""
    started = time.time()
    rows: list[Row] = []  # kvd's cases, in the order measured
    checks: list[tuple[str, float, str, float, bool]] = []

    def row(case: str, size: int, seconds: float, cpu: float | None, baseline: str, ratio: float | None,
            into: list[Row] | None = None) -> None:
        (rows if into is None else into).append(table_row(case, size, seconds, cpu, baseline, ratio))

    def target(name: str, value: float, op: str, limit: float) -> None:
        checks.append(target_check(name, value, op, limit))

    print("measuring baselines ...", flush=True)
    memcpy = {n: baselines.memcpy(n, repeats_for(n, args.quick)).median for n in SIZES}
    hashing = baselines.checksum(BIG, repeats_for(BIG, args.quick)).median
    tcp_samples = {n: baselines.tcp_throughput(n, repeats_for(n, args.quick)) for n in SIZES}
    zmq_samples = {n: baselines.zmq_throughput(n, repeats_for(n, args.quick), chunk=min(n, baselines.CHUNK))
                   for n in SIZES}
    tcp = {n: sample.median for n, sample in tcp_samples.items()}
    # what this machine allows, from the same run's baselines: (what, kvd's value, the floor)
    floors: list[tuple[str, float, float]] = []

    with tempfile.TemporaryDirectory() as workdir:
        factory = DaemonFactory(Path(workdir), log_level="warning")
        try:
            a, b = factory.pair(pool_size="1GiB")
            print("measuring kvd ...", flush=True)
            pushed_by_size = {}
            for n in SIZES:
                put, get = cases.local_put_get(a, n, repeats_for(n, args.quick))
                row("kvd local put", n, put.median, put.cpu_per_run, "memcpy", memcpy[n] / put.median)
                row("kvd local get(out=)", n, get.median, get.cpu_per_run, "memcpy", memcpy[n] / get.median)
                if n == BIG:
                    target("local put 256MiB vs memcpy", memcpy[n] / put.median, ">=", 0.7)
                    target("local get(out) 256MiB vs memcpy", memcpy[n] / get.median, ">=", 0.7)
            for n in SIZES:
                if n == BIG:
                    paired = 1 if args.quick else PAIRED_ROUNDS
                    tcp_runs, push_runs, pull_runs = [tcp_samples[n]], [], []
                    for _ in range(paired):
                        push_runs.append(cases.push(a, b, n, 3))
                        pull_runs.append(cases.pull(a, b, n, 3))
                        tcp_runs.append(baselines.tcp_throughput(n, 3))
                    tcp_samples[n] = pooled(tcp_runs)
                    tcp[n] = tcp_samples[n].median
                    pushed, pulled = pooled(push_runs), pooled(pull_runs)
                else:
                    pushed = cases.push(a, b, n, repeats_for(n, args.quick))
                    pulled = cases.pull(a, b, n, repeats_for(n, args.quick))
                pushed_by_size[n] = pushed
                row("kvd push put(dest=B)", n, pushed.median, pushed.cpu_per_run, "raw TCP", tcp[n] / pushed.median)
                row("kvd pull get(source=A)", n, pulled.median, pulled.cpu_per_run, "raw TCP", tcp[n] / pulled.median)
                if n == 1 << 20:
                    target("1MiB push vs raw TCP", tcp[n] / pushed.median, ">=", 0.25)
                if n == 16 << 20:
                    target("16MiB push vs raw TCP", tcp[n] / pushed.median, ">=", 0.7)
                if n == BIG:
                    target("push 256MiB vs raw TCP", tcp[n] / pushed.median, ">=", 0.8)
                    # in every round, against that round's raw TCP (not only pooled)
                    worst = min(tcp_run.median / push_run.median
                                for tcp_run, push_run in zip(tcp_runs[1:], push_runs))
                    target("push 256MiB vs raw TCP, worst round", worst, ">=", 0.8)
                    target("pull 256MiB vs raw TCP", tcp[n] / pulled.median, ">=", 0.8)
                    gigabytes = n / 1e9
                    target(f"CPU-s per GB, 256MiB push (both daemons + client; raw TCP "
                           f"{tcp_samples[n].cpu_per_run / gigabytes:.2f}, raw pyzmq "
                           f"{zmq_samples[n].cpu_per_run / gigabytes:.2f})", pushed.cpu_per_run / gigabytes, "<=", 0.6)
                    # the least a push can cost here: ZeroMQ moving the bytes, the client's copy
                    # into the pool, the receiver's copy from ZeroMQ's frame into its pool, and
                    # the checksum computed by the sender and checked by the receiver
                    transport = zmq_samples[n].cpu_per_run / gigabytes
                    copy, check = memcpy[n] / gigabytes, hashing / gigabytes
                    floors.append((f"CPU-s/GB of a push: raw pyzmq {transport:.2f} + 2 memcpy {2 * copy:.2f} "
                                   f"+ 2 xxh3 {2 * check:.2f}", pushed.cpu_per_run / gigabytes,
                                   transport + 2 * copy + 2 * check))
            # small messages: the ping-pong baselines swing 2-3x with the VM's state, so they are
            # measured interleaved with kvd's small cases, in rounds, and the medians compared
            rounds: dict[str, list[float]] = {"zmq": [], "zmq_tcp": [], "tcp": [], "unix": [], "rt": [], "push": []}
            for _ in range(1 if args.quick else SMALL_ROUNDS):
                rounds["zmq"].append(baselines.zmq_pingpong(64 << 10, 200, "ipc"))
                rounds["zmq_tcp"].append(baselines.zmq_pingpong(64 << 10, 200, "tcp"))
                rounds["tcp"].append(baselines.tcp_pingpong(64 << 10, 200))
                rounds["unix"].append(baselines.unix_pingpong(256, 200))  # a control message's size
                rounds["rt"].append(cases.local_round_trip(a, 64 << 10, 200))
                rounds["push"].append(cases.push(a, b, 64 << 10, 200).median)
            zmq_pp, zmq_tcp_pp, tcp_pp, unix_pp, small_rt, small_push = (
                statistics.median(rounds[k]) for k in ("zmq", "zmq_tcp", "tcp", "unix", "rt", "push"))
            rows.append(("kvd 64KiB local put+get", "64KiB", "", f"{small_rt * 1e3:.3f}", "",
                         f"{small_rt / zmq_pp:.2f}x zmq ipc ping-pong ({zmq_pp * 1e6:.0f}us), "
                         f"{small_rt / unix_pp:.1f}x unix ping-pong ({unix_pp * 1e6:.0f}us)"))
            rows.append(("kvd 64KiB push", "64KiB", "", f"{small_push * 1e3:.3f}", "",
                         f"{small_push / tcp_pp:.2f}x TCP ping-pong ({tcp_pp * 1e6:.0f}us)"))
            target("64KiB local put+get / zmq ipc ping-pong", small_rt / zmq_pp, "<=", 2.0)
            target("64KiB push / TCP ping-pong", small_push / tcp_pp, "<=", 3.0)
            # a push is a request to the local daemon and a ZeroMQ exchange between the daemons
            floors.append((f"64KiB push, ms: unix ping-pong {unix_pp * 1e3:.3f} + zmq tcp ping-pong "
                           f"{zmq_tcp_pp * 1e3:.3f}", small_push * 1e3, (unix_pp + zmq_tcp_pp) * 1e3))
            target("64KiB push / (unix + zmq tcp 64KiB ping-pongs)", small_push / (unix_pp + zmq_tcp_pp), "<=", 2.0)
            # pushes in flight from one AsyncClient, against the same run's sequential pushes
            sequential = {64 << 10: small_push, 1 << 20: pushed_by_size[1 << 20].median}
            in_flight_rows, in_flight_checks = _in_flight(a, b, args.quick, sequential, tcp)
            rows += in_flight_rows
            checks += in_flight_checks
            gets = cases.first_get_after_push(a, b, 16 << 20, 20 if args.quick else 100)
            ratios = gets.ratios
            rows.append(("kvd first get(out=) on B after a push", "16MiB", "",
                         f"{statistics.median(gets.first) * 1e3:.3f}", "",
                         f"{statistics.median(ratios):.2f}x the same get repeated (median), "
                         f"{max(ratios):.2f}x at most"))
            target("first get after a 16MiB push / repeated get (median)", statistics.median(ratios), "<=", 1.5)
            target("first get after a 16MiB push / repeated get (max)", max(ratios), "<=", 3.0)
            # the worst pair is as much the VM's noise as anything the push left behind: the slowest
            # first get against the slowest repeated one says whether the first is any worse
            rows.append(("kvd slowest first get / slowest repeated get", "16MiB", "",
                         f"{max(gets.first) * 1e3:.3f}", "",
                         f"{max(gets.first) / max(gets.repeated):.2f}x (repeated: slowest "
                         f"{max(gets.repeated) / statistics.median(gets.repeated):.2f}x its median)"))
            put_faults, get_faults = cases.fresh_client_faults(a, BIG)
            rows.append(("kvd fresh client's first put, get: page faults", human(BIG), "", "", "",
                         f"{put_faults} and {get_faults} minor faults ({BIG // 4096} pages moved each way)"))
            target("page faults in a fresh client's first 256MiB put + get", put_faults + get_faults, "<=", 1024)
            streaming_rows, streaming_checks = _layer_streaming(a, b, args.quick)
            rows += streaming_rows
            checks += streaming_checks
            # one run is ~0.2 s of a noisy machine: the median of several
            concurrent = [cases.concurrent_pushes(a, b, processes=4, per_process=16, nbytes=4 << 20)
                          for _ in range(1 if args.quick else 3)]
            aggregate = statistics.median(rate for rate, _ in concurrent)
            busy = statistics.median(share for _, share in concurrent)
            rows.append(("kvd 64 x 4MiB pushes, 4 procs", "256MiB", f"{aggregate / 1e9:.2f}", "", "",
                         f"{aggregate / BIG * tcp[BIG]:.2f}x raw TCP; machine {busy:.0%} busy "
                         f"({os.cpu_count()} cores)"))
            target("64 concurrent 4MiB pushes vs raw TCP", aggregate / BIG * tcp[BIG], ">=", 0.7)
            rss = cases.daemon_rss(a, b)
            target("daemon RSS beyond the pool (MB)", rss / 1e6, "<=", 150)
        finally:
            failures = factory.stop_all()
            if failures:
                print("\n".join(failures))
    # kvd's data planes side by side, after the daemons above are gone (their own three pairs)
    plane_rows, plane_checks, plane_lines = planes.section(args.quick)
    rows += plane_rows
    checks += plane_checks
    disk_rows, disk_checks, disk_lines = disk_tier.section(args.quick)  # (its own daemons, after the planes')
    rows += disk_rows
    checks += disk_checks
    plane_lines += disk_lines
    if args.peers:  # after kvd's daemons are gone, so they share the machine with nothing of ours
        rows += peers.peer_rows({n: repeats_for(n, args.quick) for n in SIZES}, tcp,
                                {n: sample.median for n, sample in pushed_by_size.items()})

    baseline_rows: list = []
    for n in SIZES:
        row("memcpy (numpy, 1 thread)", n, memcpy[n], None, "", None, into=baseline_rows)
        # CPU of both ends: what moving the bytes costs without kvd, beside kvd's own CPU-s/GB
        row("raw TCP loopback", n, tcp[n], tcp_samples[n].cpu_per_run, "", None, into=baseline_rows)
        row("raw pyzmq tcp (4MiB frames)", n, zmq_samples[n].median, zmq_samples[n].cpu_per_run, "", None,
            into=baseline_rows)
    row("xxh3_64 checksum (1 thread)", BIG, hashing, None, "", None, into=baseline_rows)
    return emit(_report(baseline_rows + rows, checks, floors, plane_lines, started), args.output)


def _in_flight(a: Any, b: Any, quick: bool, sequential: dict[int, float],
               tcp: dict[int, float]) -> tuple[list[Row], list[Check]]:
    """Pushes in flight from one AsyncClient, against the same run's sequential pushes."""
    rows, checks = [], []
    for n, inflight, count, goal in ((64 << 10, 16, 400, None), (1 << 20, 16, 160, 0.5)):
        per_push = statistics.median(cases.pushes_in_flight(a, b, n, inflight, count)
                                     for _ in range(1 if quick else 3))
        rows.append((f"kvd push, {inflight} in flight", human(n), f"{gbps(n, per_push):.2f}",
                     f"{per_push * 1e3:.3f}", "",
                     f"{sequential[n] / per_push:.2f}x sequential, {tcp[n] / per_push:.2f}x raw TCP"))
        name = f"{human(n)} pushes, {inflight} in flight"
        if goal is None:
            checks.append(target_check(f"{name} / sequential", sequential[n] / per_push, ">=", 5.0))
        else:
            checks.append(target_check(f"{name} vs raw TCP", tcp[n] / per_push, ">=", goal))
    return rows, checks


def _layer_streaming(a: Any, b: Any, quick: bool) -> tuple[list[Row], list[Check]]:
    """Layer-streamed handoffs: how long after the last write the last layer lands."""
    rows, checks = [], []
    for layer_bytes, pace in STREAM_CASES:
        one_layer = cases.push(a, b, layer_bytes, 10 if quick else 20).median
        whole = cases.push(a, b, STREAM_LAYERS * layer_bytes, 3 if quick else 5).median
        runs = [cases.layer_streaming(a, b, STREAM_LAYERS, layer_bytes, pace, f"stream-{i}")
                for i in range(3 if quick else 7)]
        tail = statistics.median(run.tail for run in runs)
        case = f"{STREAM_LAYERS} x {human(layer_bytes)}, {pace * 1e3:g} ms/layer"
        rows.append((f"kvd layer streaming, {case}", human(STREAM_LAYERS * layer_bytes), "",
                     f"{tail * 1e3:.3f}", "",
                     f"last layer {tail / one_layer:.2f}x one-layer push ({one_layer * 1e3:.2f} ms) after the "
                     f"last write; overlap {1 - tail / whole:.0%} of the whole push ({whole * 1e3:.1f} ms)"))
        checks.append(target_check(f"layer streaming {case}: tail / one-layer push", tail / one_layer, "<=", 1.5))
    return rows, checks


def _report(rows: list[Row], checks: list[tuple[str, float, str, float, bool]],
            floors: list[tuple[str, float, float]], plane_lines: list[str], started: float) -> str:
    """The markdown report: the cases' table, the targets, the floors, the planes' own lines."""
    lines = [
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, run took {time.time() - started:.0f}s",
        "",
        "| case | size | GB/s | median ms | CPU-s/GB | vs baseline |",
        "|---|---|---|---|---|---|",
        *[f"| {' | '.join(r)} |" for r in rows],
        "",
        "| target | measured | goal | result |",
        "|---|---|---|---|",
        *[f"| {name} | {value:.2f} | {op} {limit} | {'PASS' if ok else 'FAIL'} |"
          for name, value, op, limit, ok in checks],
        "",
        "What this machine allows, from this run's baselines (the least kvd's design can cost here):",
        "",
        "| floor | kvd | floor | kvd / floor |",
        "|---|---|---|---|",
        *[f"| {name} | {value:.2f} | {floor:.2f} | {value / floor:.2f} |" for name, value, floor in floors],
        *plane_lines,
    ]
    return "\n".join(lines)


def emit(report: str, output: Path | None) -> int:
    print(report)
    if output:
        output.write_text(report + "\n")
    return 0


def planes_only(args: argparse.Namespace) -> int:
    """`--planes`, `--plane-cutover` and `--disk-tier`: their own table, targets and lines."""
    started = time.time()
    if args.plane_cutover:
        from . import plane_cutover

        rows, checks, extra = plane_cutover.section(args.quick)
    elif args.disk_tier:
        rows, checks, extra = disk_tier.section(args.quick)
    else:
        rows, checks, extra = planes.section(args.quick)
    lines = [
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, run took {time.time() - started:.0f}s, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end",
        "",
        "| case | size | GB/s | median ms | CPU-s/GB | vs baseline |",
        "|---|---|---|---|---|---|",
        *[f"| {' | '.join(r)} |" for r in rows],
        *(["", "| target | measured | goal | result |", "|---|---|---|---|"] if checks else []),
        *[f"| {name} | {value:.2f} | {op} {limit} | {'PASS' if ok else 'FAIL'} |"
          for name, value, op, limit, ok in checks],
        *extra,
    ]
    return emit("\n".join(lines), args.output)


if __name__ == "__main__":
    raise SystemExit(main())
