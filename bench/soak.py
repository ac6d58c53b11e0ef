"""A bounded soak: two daemons and 4 client processes churning for N minutes, watched for leaks.

    python -m bench.soak                 # 10 minutes
    python -m bench.soak --minutes 3     # shorter; --output FILE also writes the report

Each client process loops over random operations on 64 KiB - 16 MiB caches (1-4 tensors of
random dtypes): local put+get on either daemon, pushes both ways, pulls, keep-reads then delete,
puts deleted before anyone reads them, streamed puts (pushed, or aborted half-written), stream
readers that stop early, and puts with a short random ttl read back maybe after it ran out. Every
byte read back is compared with what was put. Clients reconnect every so often (connection churn).

At each sample (every minute; a quarter of the run for runs under 4 minutes) the clients pause
between operations so both daemons are idle, and the soak records each daemon's open FDs, RSS
beyond shared memory (the pool is shared memory, so it is not counted), pool bytes in use, entries,
and error counters. At the end it prints a markdown table and exits non-zero if, between the first
sample under load (minute 1) and the last, a daemon's FDs grew by more than --fd-bound or its RSS
by more than --rss-bound-mb; or if any read returned other bytes than were put, any operation
failed in a way it should not, a pool did not return to 0 bytes once the clients stopped, a client
process died, or a daemon did not exit cleanly.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing as mp
import os
import platform
import queue
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .measure import rss_beyond_shared

CACHE_MIN, CACHE_MAX = 64 << 10, 16 << 20
DTYPES = ["float32", "float16", "bfloat16", "int8", "uint8", "int32"]
OPS = {  # name: weight
    "local": 3, "push": 3, "pull": 2, "keep_then_delete": 1, "delete_unread": 1,
    "stream_push": 1, "stream_abort": 1, "reader_stops_early": 1, "short_ttl": 1,
}
RECONNECT_EVERY = 40  # operations between a client process's reconnects
REPORT_EVERY = 2.0  # seconds between a client process's counter reports
DRAIN_LIMIT = 20.0  # seconds the pools get to empty once the clients have stopped


class Abandon(Exception):
    """Raised inside a put_stream block to abort it."""


# --- client processes ------------------------------------------------------------------------------

class _Churn:
    """One client process's operations on the two daemons, with what it saw of them. Each
    operation is a method, found by name in `_OPS`; the random draws come in a fixed order, so a
    seed replays the same run."""

    def __init__(self, sockets: dict[str, str], seed: int) -> None:
        import torch

        self.torch = torch
        self.dtypes = {name: getattr(torch, name) for name in DTYPES}
        self.sockets = sockets
        self.rng = random.Random(seed)
        self.source = torch.randint(0, 256, (CACHE_MAX + 4096,), dtype=torch.uint8,
                                    generator=torch.Generator().manual_seed(seed))
        self.ops: Counter[str] = Counter()
        self.expected: Counter[str] = Counter()
        self.unexpected: Counter[str] = Counter()
        self.mismatches = 0
        self.samples: list[str] = []
        self.clients: dict[str, Any] = {}  # node -> its kvd.Client

    def connect(self) -> None:
        import kvd

        for c in self.clients.values():
            c.close()
        self.clients.update({node: kvd.Client(sock).connect() for node, sock in self.sockets.items()})

    def close(self) -> None:
        for c in self.clients.values():
            c.close()

    def report(self, final: bool) -> tuple[Any, ...]:
        return (dict(self.ops), dict(self.expected), dict(self.unexpected), self.mismatches, self.samples, final)

    def cache(self) -> dict[str, Any]:
        torch, rng = self.torch, self.rng
        total = int(math.exp(rng.uniform(math.log(CACHE_MIN), math.log(CACHE_MAX))))
        count = rng.randint(1, 4)
        kv = {}
        for i in range(count):
            dtype = self.dtypes[rng.choice(DTYPES)]
            size = torch.empty(0, dtype=dtype).element_size()
            numel = max(1, total // count // size)
            offset = rng.randrange(0, self.source.numel() - numel * size) // 8 * 8
            kv[f"layer.{i}"] = self.source[offset:offset + numel * size].view(dtype).clone()
        return kv

    def check(self, got: dict[str, Any], kv: dict[str, Any]) -> None:
        uint8 = self.torch.uint8
        same = sorted(got) == sorted(kv) and all(
            got[n].dtype == t.dtype and got[n].shape == t.shape
            and self.torch.equal(got[n].view(uint8), t.view(uint8))
            for n, t in kv.items())
        if not same:
            self.mismatches += 1

    def run(self, op: str, rid: str) -> None:
        nodes = ["A", "B"]
        self.rng.shuffle(nodes)
        here, there = nodes
        kv = self.cache()
        _OPS[op](self, _Pair(self.clients[here], self.clients[there], here, there), rid, kv)

    # --- the operations: c is a client of one daemon, d of the other ---------------------------------

    def local(self, pair: _Pair, rid: str, kv: dict[str, Any]) -> None:
        pair.c.put(rid, kv, ttl=self.rng.choice([None, 60.0]))
        self.check(pair.c.get(rid, timeout=5), kv)

    def push(self, pair: _Pair, rid: str, kv: dict[str, Any]) -> None:
        pair.c.put(rid, kv, dest=pair.there)
        self.check(pair.d.get(rid, timeout=10), kv)

    def pull(self, pair: _Pair, rid: str, kv: dict[str, Any]) -> None:
        pair.c.put(rid, kv)
        self.check(pair.d.get(rid, source=pair.here, timeout=10), kv)

    def keep_then_delete(self, pair: _Pair, rid: str, kv: dict[str, Any]) -> None:
        c = pair.c
        c.put(rid, kv)
        self.check(c.get(rid, keep=True), kv)
        self.check(c.get(rid, keep=True), kv)
        if not c.delete(rid):
            raise AssertionError("delete of a held entry returned False")

    def delete_unread(self, pair: _Pair, rid: str, kv: dict[str, Any]) -> None:
        import kvd

        pushed = self.rng.random() < 0.5
        pair.c.put(rid, kv, dest=pair.there if pushed else None)
        holder = pair.d if pushed else pair.c
        if not holder.delete(rid):
            raise AssertionError("delete of a held entry returned False")
        try:
            holder.get(rid, timeout=0)
            raise AssertionError("a deleted entry is readable")
        except kvd.NotFound:
            self.expected["NotFound (deleted)"] += 1

    def stream_push(self, pair: _Pair, rid: str, kv: dict[str, Any]) -> None:
        layout = {n: (tuple(t.shape), t.dtype) for n, t in kv.items()}
        names = list(kv)
        with pair.c.put_stream(rid, layout, dest=pair.there) as stream:
            split = self.rng.randint(1, len(names))
            stream.write({n: kv[n] for n in names[:split]})
            if names[split:]:
                stream.write({n: kv[n] for n in names[split:]})
        self.check(pair.d.get(rid, timeout=10), kv)

    def stream_abort(self, pair: _Pair, rid: str, kv: dict[str, Any]) -> None:
        import kvd

        layout = {n: (tuple(t.shape), t.dtype) for n, t in kv.items()}
        names = list(kv)
        # at least one tensor stays unwritten: a pushed stream aborted after its last write is
        # delivered anyway (a known bug, see tests/system/test_stateful.py), which would read as a leak here
        written = names[:self.rng.randrange(len(names))]
        try:
            with pair.c.put_stream(rid, layout, dest=self.rng.choice([None, pair.there])) as stream:
                if written:
                    stream.write({n: kv[n] for n in written})
                raise Abandon()
        except Abandon:
            pass
        try:
            pair.c.get(rid, timeout=0)
            raise AssertionError("an aborted stream is readable")
        except kvd.NotFound:
            self.expected["NotFound (aborted stream)"] += 1

    def reader_stops_early(self, pair: _Pair, rid: str, kv: dict[str, Any]) -> None:
        pair.c.put(rid, kv)
        for _group in pair.c.get_stream(rid, timeout=5):
            break  # gives the entry back
        self.check(pair.c.get(rid, timeout=5), kv)

    def short_ttl(self, pair: _Pair, rid: str, kv: dict[str, Any]) -> None:
        import kvd

        pushed = self.rng.random() < 0.5
        pair.c.put(rid, kv, ttl=self.rng.uniform(0.2, 1.0), dest=pair.there if pushed else None)
        time.sleep(self.rng.uniform(0.0, 1.5))
        try:
            self.check((pair.d if pushed else pair.c).get(rid, timeout=0), kv)
        except kvd.NotFound:
            self.expected["NotFound (ttl ran out)"] += 1


@dataclass
class _Pair:
    """The two daemons of one operation, drawn at random: c and d are clients of here and there."""

    c: Any
    d: Any
    here: str
    there: str


_OPS: dict[str, Callable[[_Churn, _Pair, str, dict[str, Any]], None]] = {
    "local": _Churn.local, "push": _Churn.push, "pull": _Churn.pull, "keep_then_delete": _Churn.keep_then_delete,
    "delete_unread": _Churn.delete_unread, "stream_push": _Churn.stream_push, "stream_abort": _Churn.stream_abort,
    "reader_stops_early": _Churn.reader_stops_early, "short_ttl": _Churn.short_ttl,
}
assert set(_OPS) == set(OPS)  # every weighted operation has its method


def _worker(wid: int, sockets: dict[str, str], stop: Any, seed: int, reports: Any, pause: Any, paused: Any) -> None:
    import kvd

    churn = _Churn(sockets, seed)
    names, weights = list(OPS), list(OPS.values())
    last_report = 0.0
    try:
        churn.connect()
        i = 0
        while not stop.is_set():
            if pause.is_set():
                _pause(pause, paused, stop)
                continue
            if i and i % RECONNECT_EVERY == 0:
                churn.connect()
            op = churn.rng.choices(names, weights)[0]
            rid = f"soak-{wid}-{i}-{op}"
            i += 1
            try:
                churn.run(op, rid)
                churn.ops[op] += 1
            except kvd.PoolFull:
                churn.expected["PoolFull"] += 1  # back-pressure under load is allowed, never a hang
                for c in churn.clients.values():
                    c.delete(rid)
            except Exception as exc:
                churn.unexpected[f"{op}: {type(exc).__name__}"] += 1
                if len(churn.samples) < 10:
                    churn.samples.append(f"{op} {rid}: {type(exc).__name__}: {exc}")
                for c in churn.clients.values():
                    with contextlib.suppress(Exception):
                        c.delete(rid)
            if time.time() - last_report > REPORT_EVERY:
                reports.put((wid, *churn.report(False)))
                last_report = time.time()
    finally:
        reports.put((wid, *churn.report(True)))
        churn.close()


def _pause(pause: Any, paused: Any, stop: Any) -> None:
    """Wait between operations while the soak samples the idle daemons (counted in `paused`)."""
    with paused.get_lock():
        paused.value += 1
    while pause.is_set() and not stop.is_set():
        time.sleep(0.01)
    with paused.get_lock():
        paused.value -= 1


# --- the soak -----------------------------------------------------------------------------------------

def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to churn (default: 10)")
    parser.add_argument("--workers", type=int, default=4, help="client processes (default: 4)")
    parser.add_argument("--pool-size", default="384MiB", help="each daemon's pool (default: 384MiB)")
    parser.add_argument("--fd-bound", type=int, default=8, help="allowed FD growth per daemon (default: 8)")
    parser.add_argument("--rss-bound-mb", type=float, default=32.0,
                        help="allowed growth of RSS beyond shared memory per daemon, MB (default: 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="also write the report (markdown) to this file")
    args = parser.parse_args(argv)

    from kvd.testing.daemons import DaemonFactory

    duration = args.minutes * 60
    interval = 60.0 if args.minutes >= 4 else duration / 4
    started = time.time()
    ctx = mp.get_context("spawn")
    problems: list[str] = []
    rows: list[dict] = []
    totals: dict[int, tuple] = {}

    with tempfile.TemporaryDirectory() as workdir:
        factory = DaemonFactory(Path(workdir), log_level="warning")
        a, b = factory.pair(pool_size=args.pool_size, extra=["--lease-timeout", "5s"])
        daemons = {"A": a, "B": b}
        sockets = {name: d.socket for name, d in daemons.items()}
        reports, pause, paused, stop = ctx.Queue(), ctx.Event(), ctx.Value("i", 0), ctx.Event()

        samples = _Samples(daemons, reports, pause, paused, rows, totals)
        drain, sample = samples.drain, samples.take

        try:
            sample("start (no clients)", [])
            workers = [ctx.Process(target=_worker, args=(w, sockets, stop, args.seed * 100 + w, reports,
                                                         pause, paused), daemon=True)
                       for w in range(args.workers)]
            for w in workers:
                w.start()
            t0 = time.time()
            deadline = t0 + duration
            next_sample = t0 + interval
            while True:
                now = time.time()
                if now >= next_sample - 0.01:
                    sample(f"{(now - t0) / 60:.1f} min", workers)
                    next_sample += interval
                    if next_sample > deadline + 1:
                        break  # that was the last one, taken with the clients still connected
                    continue
                drain()
                if not all(w.is_alive() for w in workers):
                    problems.append("a client process died during the run")
                    break
                time.sleep(min(0.5, max(0.0, next_sample - now)))
            stop.set()
            for w in workers:
                w.join(120)
            drain()
            for w in workers:
                if w.exitcode != 0:
                    problems.append(f"client process {w.name} exited with {w.exitcode}")
            used, drained_after = _left_in_pools(daemons)
            for name, (nbytes, entries) in used.items():
                if nbytes or entries:
                    left = ", ".join(f"{e['request_id']} ({e['state']}, ttl {e['ttl_s']})" for e in entries[:8])
                    problems.append(f"{name}: {nbytes} pool bytes / {len(entries)} entries left "
                                    f"{DRAIN_LIMIT}s after the clients stopped: {left}")
            sample(f"idle, {drained_after:.1f}s after the clients stopped", [])
        finally:
            pause.clear()
            problems.extend(factory.stop_all())

    report = _verdict(args, rows, totals, problems, started)
    print(report)
    if args.output:
        args.output.write_text(report + "\n")
    return 1 if problems else 0


class _Samples:
    """The daemons as the clients left them, at each sample: the clients pause between operations
    (the daemons go idle), then each daemon's FDs, RSS, pool and counters are read into `rows`;
    the clients' own counts arrive on `reports` (drained into `totals`)."""

    def __init__(self, daemons: dict[str, Any], reports: Any, pause: Any, paused: Any, rows: list[dict[str, Any]],
                 totals: dict[int, tuple[Any, ...]]) -> None:
        self.daemons, self.reports, self.pause, self.paused = daemons, reports, pause, paused
        self.rows, self.totals = rows, totals

    def drain(self) -> None:
        while True:
            try:
                report = self.reports.get_nowait()
            except queue.Empty:
                return
            self.totals[report[0]] = report[1:]

    def take(self, label: str, workers: list[Any]) -> None:
        import kvd

        totals, rows = self.totals, self.rows
        alive = [w for w in workers if w.is_alive()]
        self.pause.set()
        wait_until = time.time() + 60
        while self.paused.value < len([w for w in alive if w.is_alive()]) and time.time() < wait_until:
            self.drain()
            time.sleep(0.02)
        time.sleep(0.5)  # let deferred frees and ttl sweeps run on idle daemons
        self.drain()
        ops_so_far = sum(sum(t[0].values()) for t in totals.values())
        unexpected = sum(sum(t[2].values()) for t in totals.values())
        mism = sum(t[3] for t in totals.values())
        for name, d in self.daemons.items():
            with kvd.Client(d.socket) as c:
                stats = c.stats()
                held = [f"{e['request_id']} ({e['state']}, ttl {e['ttl_s']})" for e in c.list()[:3]]
            rows.append({
                "t": label, "daemon": name, "fds": fd_count(d.pid), "rss": rss_beyond_shared(d.pid),
                "used": stats["pool"]["used_bytes"], "entries": stats["entries"],
                "daemon_errors": stats["counters"].get("errors", 0),
                "xfer_failures": stats["counters"].get("failures", 0),
                "ops": ops_so_far, "unexpected": unexpected, "mismatches": mism, "held": held,
            })
        self.pause.clear()
        print(f"[{label}] " + "; ".join(
            f"{r['daemon']}: fds {r['fds']}, rss {r['rss'] / 1e6:.1f} MB, pool {r['used'] >> 20} MiB"
            + (f" held by {', '.join(r['held'])}" if r["held"] else "") for r in rows[-2:])
            + f"; client ops {ops_so_far}, unexpected errors {unexpected}, "
            f"mismatches {mism}", flush=True)


def _left_in_pools(daemons: dict[str, Any]) -> tuple[dict[str, tuple[int, list[dict[str, Any]]]], float]:
    """Once the clients are gone, nothing may stay in the pools (an aborted push may hold its
    receiver's reservation until that daemon's transfer timeout, 15 s): what is left in each, by
    DRAIN_LIMIT at the latest, and how long it took to empty."""
    import kvd

    idle_start = time.time()
    while True:
        used = {}
        for name, d in daemons.items():
            with kvd.Client(d.socket) as c:
                pool = c.stats()["pool"]
                # entries' blocks and blocks lent to clients (those must be back too)
                used[name] = (pool["used_bytes"] + pool["scratch_bytes"], c.list())
        if all(u == (0, []) for u in used.values()) or time.time() > idle_start + DRAIN_LIMIT:
            return used, time.time() - idle_start
        time.sleep(0.2)


def _verdict(args: argparse.Namespace, rows: list[dict[str, Any]], totals: dict[int, tuple[Any, ...]],
             problems: list[str], started: float) -> str:
    """The report: the samples' table, the clients' counts, and the problems found (added to)."""
    ops = sum((Counter(t[0]) for t in totals.values()), Counter())
    expected = sum((Counter(t[1]) for t in totals.values()), Counter())
    unexpected = sum((Counter(t[2]) for t in totals.values()), Counter())
    mismatches = sum(t[3] for t in totals.values())
    examples = [s for t in totals.values() for s in t[4]]
    if len(totals) < args.workers:
        problems.append(f"only {len(totals)} of {args.workers} client processes reported")
    if mismatches:
        problems.append(f"{mismatches} reads returned other bytes than were put")
    if unexpected:
        problems.append(f"{sum(unexpected.values())} operations failed unexpectedly: {dict(unexpected)}")
    problems += _growth(args, rows)
    return _report(args, rows, problems, started, ops, expected, unexpected, mismatches, examples)


def _growth(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[str]:
    """FDs and RSS that grew past their bounds between the first sample under load and the last."""
    problems = []
    for name in ("A", "B"):
        series = [r for r in rows if r["daemon"] == name and r["t"].endswith("min")]  # under load
        if len(series) >= 2:
            first, last = series[0], series[-1]  # minute 1 (the first sample under load) and the end
            if last["fds"] - first["fds"] > args.fd_bound:
                problems.append(f"{name}: FDs grew {first['fds']} -> {last['fds']} (bound {args.fd_bound})")
            if (last["rss"] - first["rss"]) / 1e6 > args.rss_bound_mb:
                problems.append(f"{name}: RSS beyond shared memory grew {first['rss'] / 1e6:.1f} -> "
                                f"{last['rss'] / 1e6:.1f} MB (bound {args.rss_bound_mb} MB)")
    return problems


def _report(args: argparse.Namespace, rows: list[dict[str, Any]], problems: list[str], started: float,
            ops: Counter[str], expected: Counter[str], unexpected: Counter[str], mismatches: int,
            examples: list[str]) -> str:
    lines = [
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.workers} client processes, "
        f"{args.minutes:g} min, pools {args.pool_size}, run took {time.time() - started:.0f}s",
        "",
        "| t | daemon | FDs | RSS beyond shm (MB) | pool used (MiB) | entries | daemon error replies | "
        "transfer failures | client ops | unexpected errors | mismatches |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *[f"| {r['t']} | {r['daemon']} | {r['fds']} | {r['rss'] / 1e6:.1f} | {r['used'] / (1 << 20):.1f} | "
          f"{r['entries']} | {r['daemon_errors']} | {r['xfer_failures']} | {r['ops']} | {r['unexpected']} | "
          f"{r['mismatches']} |" for r in rows],
        "",
        f"- operations: {sum(ops.values())} ({', '.join(f'{k} {v}' for k, v in sorted(ops.items()))})",
        f"- expected refusals: {', '.join(f'{k} {v}' for k, v in sorted(expected.items())) or 'none'}",
        f"- unexpected errors: {sum(unexpected.values())}; data mismatches: {mismatches}",
        f"- bounds: FD growth <= {args.fd_bound}, RSS growth <= {args.rss_bound_mb:g} MB per daemon, "
        "first sample under load vs the last",
        "- result: " + ("PASS" if not problems else "FAIL"),
        *[f"  - {p}" for p in problems],
        *([f"  - e.g. {e}" for e in examples[:5]] if unexpected else []),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
