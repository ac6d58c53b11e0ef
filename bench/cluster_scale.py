"""The cluster registry at scale: N real `kvd serve` daemons (small pools) on one real etcd and one
real Redis, all on loopback.

    python -m bench.cluster_scale                       # 100 daemons, etcd then Redis
    python -m bench.cluster_scale --nodes 200 --backends redis --json out.json

For each backend it starts the registry server (tests/cluster/servers.py: free ports, temp dir),
spawns N daemons in parallel batches, and measures:

- registration: spawn -> all N listed in the registry (a router's view, `kvd.cluster.Registry`),
  and per daemon spawn -> ready (answers a hello) and ready -> listed;
- idle: daemon RSS (median, max, total; PSS total, which counts shared pages once), open fds, daemon
  and registry CPU over a quiet period, and the peer links each daemon holds (found through the
  registry, nodes are linked on demand: an idle cluster must not be a full mesh of heartbeats);
- lookups per second, each with several concurrent client processes: `cluster_locate` through the
  daemons, `Registry.locate` from a router, and gets by request id with no source (the reader's
  daemon asks the registry for the holder and pulls the bytes from another node; every byte checked);
- a dead node: SIGKILL one daemon and time until the registry listing, another daemon's view and
  the registry's holder records have lost it, against 2 x --registry-ttl.

It prints a markdown table and, with --json, writes every number. Every process it starts is
killed on the way out, Ctrl-C and failures included (the daemons also die with it if it is killed).
tests/cluster/test_scale.py runs the same steps at 100 nodes and asserts the contract.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import multiprocessing as mp
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvd.client.connection import BlockingConnection, ask
from kvd.cluster import Registry, RegistryUnavailable
from kvd.errors import KvdError
from kvd.testing.daemons import DaemonProc, _answers_hello, free_port
from kvd.wire import protocol as p
from kvd.wire.endpoints import unix_path
from tests.cluster.servers import (
    EtcdServer,
    RedisServer,
    Server,
    find_etcd,
    find_redis,
    start_server,
    stop_server,
)

from .measure import cpu_seconds, system_cpu

# 4 MiB pools of 4 KiB blocks: room for a few hundred small entries, and nothing big to map
POOL_FLAGS = ["--pool-size", "4MiB", "--block-size", "4KiB", "--scratch-max", "64KiB"]
MiB = 1 << 20
POLL = 0.02  # seconds between looks while timing something


@dataclass
class Options:
    nodes: int = 100
    ttl: float = 5.0  # --registry-ttl
    batch: int = 25  # daemons spawned at once; the next batch starts when these answer
    clients: int = 4  # concurrent client processes in each lookup phase
    seconds: float = 8.0  # length of each lookup phase
    pulls: int = 0  # stop the pull phase after this many gets (0: only the time limit)
    idle_seconds: float = 10.0
    entries: int = 16  # entries each daemon holds (put locally, no destination: published)
    entry_bytes: int = 4096
    register_timeout: float = 180.0


# ---- results ------------------------------------------------------------------------------------


@dataclass
class Spread:
    median: float
    p90: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        if not values:
            return cls(float("nan"), float("nan"), float("nan"))
        ordered = sorted(values)
        return cls(statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], ordered[-1])


@dataclass
class Registration:
    nodes: int
    all_listed_s: float  # first spawn -> the registry lists every node
    spawn_to_ready_s: Spread
    spawn_to_listed_s: Spread
    ready_to_listed_s: Spread  # the registry's part: the daemon is up, its record not yet readable
    respawned: int  # daemons started again (their port was taken between choosing and binding it)


@dataclass
class Idle:
    seconds: float
    rss_mib: Spread
    rss_total_mib: float
    pss_total_mib: float
    fds_max: int
    daemon_cpu_pct_each: Spread  # % of one core, per daemon
    daemons_cpu_pct: float  # all daemons together
    registry_cpu_pct: float
    registry_rss_mib: float
    registry_fds: int
    machine_busy_pct: float  # of both cores, everything on the machine
    links_max: int  # peer links of the busiest daemon
    links_total: int


@dataclass
class Throughput:
    name: str
    clients: int
    ops: int
    seconds: float
    per_s: float
    errors: int
    mismatches: int  # a wrong holder (locate) or wrong bytes (get)
    latency_ms: Spread
    registry_cpu_pct: float
    daemons_cpu_pct: float
    machine_busy_pct: float
    first_error: str = ""
    # pulls only: the first get from a holder (links it: TCP, ZeroMQ, the peer handshake), the others
    first_contact_ms: Spread | None = None
    linked_ms: Spread | None = None


@dataclass
class DeadNode:
    ttl_s: float
    bound_s: float  # 2 x TTL
    registry_listing_s: float  # SIGKILL -> gone from the router's listing
    daemon_view_s: float  # SIGKILL -> gone from another daemon's cluster_nodes
    holders_s: float  # SIGKILL -> its entries no longer located


@dataclass
class Health:
    """What the daemons say about the registry, summed over the fleet (each daemon's `kvd status`)."""

    record_problems: list[str]  # the listing against the daemons we started, once all were listed
    op_errors: dict[str, int]  # failed registry calls, by operation
    reregistrations: int  # sessions opened again after a loss (0 on a healthy run)
    unregistered: int  # daemons not registered when asked
    view_sizes: Spread  # nodes each daemon's own view holds


@dataclass
class BackendResult:
    backend: str
    nodes: int
    ttl_s: float
    registration: Registration
    idle: Idle
    locate: Throughput
    router_locate: Throughput
    pulls: Throughput
    links_after: dict[str, int]
    health: Health
    dead: DeadNode
    unclean_exits: int = 0


# ---- /proc ------------------------------------------------------------------------------------------


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS etc. in bytes, from /proc/PID/status."""
    out = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0]) * 1024
    return out


def pss(pid: int) -> int:
    """Proportional set size: shared pages (libraries, the interpreter) divided among their users."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            for line in handle:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def fd_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


class CpuMeter:
    """CPU seconds of some processes (and of the whole machine) between start and stop."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.t0 = time.monotonic()
        self.before = {pid: _cpu(pid) for pid in pids}
        self.sys0 = system_cpu()

    def stop(self) -> tuple[float, dict[int, float], float]:
        """(wall seconds, {pid: % of one core}, machine busy % of all cores)."""
        wall = time.monotonic() - self.t0
        after = {pid: _cpu(pid) for pid in self.pids}
        sys1 = system_cpu()
        total, idle = sys1[0] - self.sys0[0], sys1[1] - self.sys0[1]
        busy = 100 * (1 - idle / total) if total else float("nan")
        return wall, {pid: 100 * (after[pid] - self.before[pid]) / wall for pid in self.pids}, busy


def _cpu(pid: int) -> float:
    try:
        return cpu_seconds(pid)
    except OSError:  # it died meanwhile (the dead-node step)
        return 0.0


# ---- the entries --------------------------------------------------------------------------------------


def rid_of(node: int, k: int) -> str:
    return f"e-{node:03d}-{k:03d}"


def kv_for(rid: str, nbytes: int) -> dict:
    """Bytes that say which request they belong to: every get checks them without coordination."""
    import torch

    seed = zlib.crc32(rid.encode())
    return {"kv": torch.arange(nbytes // 8, dtype=torch.int64) * 1_000_003 + seed}


def exact(rid: str, kv: dict, nbytes: int) -> bool:
    import torch

    return set(kv) == {"kv"} and torch.equal(kv["kv"], kv_for(rid, nbytes)["kv"])


# ---- the fleet ------------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG: a bench killed outright (SIGKILL) must not leave its daemons behind
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


@dataclass
class Node:
    index: int
    daemon: DaemonProc
    spawned: float
    ready: float | None = None

    @property
    def node_id(self) -> str:
        return self.daemon.node_id

    @property
    def alive(self) -> bool:
        return self.daemon.proc.poll() is None


class Fleet:
    """N daemons of one cluster on one registry, spawned and (always) killed by this process."""

    def __init__(self, url: str, workdir: Path, opts: Options) -> None:
        self.url, self.workdir, self.opts = url, workdir, opts
        self.cluster = f"scale-{uuid.uuid4().hex[:8]}"
        self.nodes: list[Node] = []
        self.respawned = 0
        self.victim: Node | None = None  # killed on purpose: its exit is not unclean

    def node_id(self, index: int) -> str:
        return f"n{index:03d}"

    def spawn(self, index: int) -> Node:
        node_id, port = self.node_id(index), free_port()
        sock = f"unix://{self.workdir}/{node_id}.sock"
        listen = f"tcp://127.0.0.1:{port}"
        args = [sys.executable, "-m", "kvd", "serve", "--node-id", node_id, "--listen", listen, "--socket", sock,
                *POOL_FLAGS, "--metrics-port", "0", "--log-level", "info", "--registry", self.url,
                "--cluster", self.cluster, "--registry-ttl", f"{self.opts.ttl}s"]
        log_path = self.workdir / f"{node_id}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=_die_with_parent)
        return Node(index, DaemonProc(node_id, sock, listen, proc, log_path, args), time.monotonic())

    def start(self) -> None:
        """Spawn in batches; each batch is polled until every daemon answers a hello."""
        n, batch = self.opts.nodes, self.opts.batch
        for first in range(0, n, batch):
            fresh = [self.spawn(i) for i in range(first, min(n, first + batch))]
            self.nodes.extend(fresh)
            self._wait_ready(fresh, timeout=60.0)

    def _wait_ready(self, pending: list[Node], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(pending)
        while pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(pending)} daemons not ready after {timeout}s, e.g. "
                                   f"{pending[0].node_id}:\n{pending[0].daemon.log()[-2000:]}")
            for node in list(pending):
                if not node.alive:
                    pending.remove(node)
                    pending.append(self._respawn(node))
                elif os.path.exists(unix_path(node.daemon.socket) or "") and _answers_hello(node.daemon.socket):
                    node.ready = time.monotonic()
                    pending.remove(node)
            time.sleep(POLL)

    def _respawn(self, node: Node) -> Node:
        """A daemon that exited at start: its port was taken between free_port() and its bind."""
        log = node.daemon.log()
        if "cannot listen" not in log or self.respawned > self.opts.nodes // 10:
            raise RuntimeError(f"daemon {node.node_id} exited with {node.daemon.proc.returncode}:\n{log[-3000:]}")
        self.respawned += 1
        fresh = self.spawn(node.index)
        fresh.spawned = node.spawned  # its time to ready counts from the first try
        self.nodes[self.nodes.index(node)] = fresh
        return fresh

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.alive]

    def pids(self) -> list[int]:
        return [n.daemon.pid for n in self.live()]

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM every daemon at once, SIGKILL what is left at the deadline; the unclean exits."""
        for node in self.live():
            node.daemon.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        unclean = 0
        for node in self.nodes:
            proc = node.daemon.proc
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.returncode not in (0, -signal.SIGKILL) and node is not self.victim:
                unclean += 1
        return unclean

    def kill_all(self) -> None:
        for node in self.nodes:
            if node.alive:
                node.daemon.proc.kill()
        for node in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.daemon.proc.wait(10)


# ---- the registry, as a router sees it -------------------------------------------------------------------


class ListingWatcher(threading.Thread):
    """Polls the registry's node listing from a thread of its own (its own event loop) and notes
    when each node first appears, while the main thread spawns daemons."""

    def __init__(self, url: str, cluster: str, interval: float = 0.05) -> None:
        super().__init__(daemon=True, name="listing-watcher")
        self.url, self.cluster, self.interval = url, cluster, interval
        self.first_seen: dict[str, float] = {}
        self.error: BaseException | None = None
        self._done = threading.Event()

    def run(self) -> None:
        try:
            asyncio.run(self._poll())
        except BaseException as exc:  # seen by the main thread, not lost in this one
            self.error = exc

    async def _poll(self) -> None:
        async with Registry(self.url, cluster=self.cluster) as reg:
            while not self._done.is_set():
                try:
                    nodes = await reg.nodes()
                except RegistryUnavailable:
                    nodes = []
                now = time.monotonic()
                for n in nodes:
                    self.first_seen.setdefault(n.node_id, now)
                await asyncio.sleep(self.interval)

    def wait_for(self, node_ids: set[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not node_ids <= self.first_seen.keys():
            if self.error is not None:
                raise self.error
            if time.monotonic() > deadline:
                missing = sorted(node_ids - self.first_seen.keys())
                raise RuntimeError(f"{len(missing)} nodes not listed after {timeout}s: {missing[:10]}")
            time.sleep(POLL)

    def stop(self) -> None:
        self._done.set()
        self.join(5)


def record_problems(records: list, fleet: Fleet) -> list[str]:
    """What is wrong with the registry's node records, compared with the daemons we started."""
    want = {n.node_id: n for n in fleet.live()}
    got = {r.node_id: r for r in records}
    problems = [f"{i} is not listed" for i in sorted(want.keys() - got.keys())]
    problems += [f"{i} is listed but not running" for i in sorted(got.keys() - want.keys())]
    for node_id in sorted(want.keys() & got.keys()):
        r, d = got[node_id], want[node_id].daemon
        checks = {"endpoint": (r.endpoint, d.listen), "role": (r.role, "any"), "pool_bytes": (r.pool_bytes, 4 * MiB),
                  "block_size": (r.block_size, 4096), "device": (r.device, "cpu")}
        problems += [f"{node_id}: {k} is {a!r}, not {b!r}" for k, (a, b) in checks.items() if a != b]
    return problems


async def listed_ids(reg: Registry) -> set[str]:
    return {n.node_id for n in await reg.nodes()}


# ---- the client processes of the lookup phases ---------------------------------------------------------


@dataclass
class WorkerResult:
    ops: int = 0
    errors: int = 0
    mismatches: int = 0
    latencies: list[float] = field(default_factory=list)
    first_contact: list[bool] = field(default_factory=list)  # per latency: the first from its holder
    first_error: str = ""


def _locate_worker(sock: str, targets: list[tuple[str, str]], seconds: float, limit: int,
                   ready: Any, go: Any, out: Any) -> None:
    """cluster_locate on one persistent connection to a daemon, one request in flight."""
    res = WorkerResult()
    conn = BlockingConnection(sock, 5.0)
    ready.release()
    go.wait()
    end = time.monotonic() + seconds
    req = 0
    while time.monotonic() < end and (not limit or req < limit):
        rid, holder = targets[req % len(targets)]
        req += 1
        t0 = time.perf_counter()
        conn.send(p.encode(p.ClusterLocate(req=req, request_id=rid)))
        frames = conn.receive(10.0)
        res.latencies.append(time.perf_counter() - t0)
        reply = p.decode(frames) if frames is not None else None
        if not isinstance(reply, p.Ok):
            res.errors += 1
            res.first_error = res.first_error or repr(reply)
        elif not reply.value or reply.value[0]["node_id"] != holder:
            res.mismatches += 1
        else:
            res.ops += 1
    conn.close()
    out.put(res)


def _pull_worker(sock: str, targets: list[tuple[str, str]], seconds: float, limit: int, nbytes: int,
                 ready: Any, go: Any, out: Any) -> None:
    """Gets by request id with no source: the daemon finds the holder in the registry and pulls.
    `targets` are (rid, holder), a holder's entries in a row: the first links to it, the rest reuse it."""
    import kvd

    res = WorkerResult()
    client = kvd.Client(sock)
    client.connect()
    ready.release()
    go.wait()
    end = time.monotonic() + seconds
    seen: set[str] = set()
    for i, (rid, holder) in enumerate(targets):
        if time.monotonic() >= end or (limit and i >= limit):
            break
        t0 = time.perf_counter()
        try:
            got = client.get(rid, timeout=10.0)
        except KvdError as exc:
            res.errors += 1
            res.first_error = res.first_error or f"{rid}: {exc}"
            continue
        res.latencies.append(time.perf_counter() - t0)
        res.first_contact.append(holder not in seen)
        seen.add(holder)
        if exact(rid, got, nbytes):
            res.ops += 1
        else:
            res.mismatches += 1
    client.close()
    out.put(res)


def run_workers(target, jobs: list[tuple], meter_pids: list[int],
                registry_pid: int) -> tuple[list[WorkerResult], float, dict[int, float], float]:
    """Start one process per job, wait until all are connected, then time them from one start
    signal to the last result: (results, wall seconds, CPU % by pid, machine busy %)."""
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*job, ready, go, out), daemon=True) for job in jobs]
    for proc in procs:
        proc.start()
    try:
        for _ in procs:
            if not ready.acquire(timeout=60):
                raise RuntimeError("a client process did not connect within 60 s")
        meter = CpuMeter([registry_pid, *meter_pids])
        go.set()
        results = [out.get(timeout=120) for _ in procs]
        wall, cpu, busy = meter.stop()
        return results, wall, cpu, busy
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()


def throughput(name: str, results: list[WorkerResult], wall: float, cpu: dict[int, float], busy: float,
               registry_pid: int) -> Throughput:
    ops = sum(r.ops for r in results)
    return Throughput(
        name=name, clients=len(results), ops=ops, seconds=round(wall, 3), per_s=ops / wall if wall else 0.0,
        errors=sum(r.errors for r in results), mismatches=sum(r.mismatches for r in results),
        latency_ms=Spread.of([1000 * t for r in results for t in r.latencies]),
        registry_cpu_pct=cpu.get(registry_pid, 0.0),
        daemons_cpu_pct=sum(v for pid, v in cpu.items() if pid != registry_pid), machine_busy_pct=busy,
        first_error=next((r.first_error for r in results if r.first_error), ""))


def split_latencies(tp: Throughput, results: list[WorkerResult]) -> Throughput:
    """Pull latencies of first contacts with a holder apart from those on a link already up."""
    pairs = [(1000 * t, first) for r in results for t, first in zip(r.latencies, r.first_contact)]
    tp.first_contact_ms = Spread.of([t for t, first in pairs if first])
    tp.linked_ms = Spread.of([t for t, first in pairs if not first])
    return tp


# ---- one backend, step by step ---------------------------------------------------------------------------


class ScaleRun:
    """The steps, in order: start, put_entries, idle, locate, router_locate, pulls, kill_one. The
    bench runs them all and reports; the test runs them and asserts on what they return."""

    def __init__(self, kind: str, opts: Options) -> None:
        self.kind, self.opts = kind, opts
        self.server: Server | None = None
        self.fleet: Fleet | None = None
        self.workdir = Path(tempfile.mkdtemp(prefix=f"kvd-scale-{kind}-"))
        self.runner = asyncio.Runner()
        self.reg: Registry | None = None
        self.held: dict[str, str] = {}  # request id -> the node it was put on (pulls move some away)
        self.victim: Node | None = None

    # lifecycle
    def __enter__(self) -> ScaleRun:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> int:
        """Stop everything this run started (also after a failure); the unclean daemon exits."""
        unclean, fleet, reg, server = 0, self.fleet, self.reg, self.server
        self.fleet = self.reg = self.server = None  # a second close does nothing
        try:
            if fleet is not None:
                try:
                    unclean = fleet.stop()
                finally:
                    fleet.kill_all()
            if reg is not None:
                self.runner.run(reg.close())
        finally:
            self.runner.close()
            if server is not None:
                stop_server(server)
            shutil.rmtree(self.workdir, ignore_errors=True)
        return unclean

    @property
    def registry_pid(self) -> int:
        assert self.server is not None and self.server.proc is not None
        return self.server.proc.pid

    def _start_server(self) -> None:
        binary = find_etcd() if self.kind == "etcd" else find_redis()
        if binary is None:
            raise RuntimeError(f"no {self.kind} server binary (./dev installs etcd-server and redis-server)")
        self.server = start_server(EtcdServer if self.kind == "etcd" else RedisServer, binary)

    # steps
    def start(self) -> Registration:
        self._start_server()
        assert self.server is not None
        self.fleet = Fleet(self.server.url, self.workdir, self.opts)
        watcher = ListingWatcher(self.server.url, self.fleet.cluster)
        watcher.start()
        try:
            t0 = time.monotonic()
            self.fleet.start()
            watcher.wait_for({n.node_id for n in self.fleet.nodes}, self.opts.register_timeout)
        finally:
            watcher.stop()
        self.reg = Registry(self.server.url, cluster=self.fleet.cluster)
        nodes = self.fleet.nodes
        listed = {n.node_id: watcher.first_seen[n.node_id] for n in nodes}
        return Registration(
            nodes=len(nodes), all_listed_s=max(listed.values()) - t0,
            spawn_to_ready_s=Spread.of([n.ready - n.spawned for n in nodes if n.ready is not None]),
            spawn_to_listed_s=Spread.of([listed[n.node_id] - n.spawned for n in nodes]),
            ready_to_listed_s=Spread.of([max(0.0, listed[n.node_id] - n.ready) for n in nodes if n.ready is not None]),
            respawned=self.fleet.respawned)

    def records(self) -> list:
        assert self.reg is not None
        return self.runner.run(self.reg.nodes())

    def put_entries(self, timeout: float = 60.0) -> None:
        """Every daemon holds `entries` entries, put locally with no destination (so published)."""
        import kvd

        assert self.fleet is not None
        for node in self.fleet.nodes:
            with kvd.Client(node.daemon.socket) as client:
                for k in range(self.opts.entries):
                    rid = rid_of(node.index, k)
                    client.put(rid, kv_for(rid, self.opts.entry_bytes))
                    self.held[rid] = node.node_id
        self._wait_published(timeout)

    def _wait_published(self, timeout: float) -> None:
        assert self.fleet is not None
        deadline = time.monotonic() + timeout
        for node in self.fleet.nodes:
            while True:
                reg = ask(p.Stats(req=1), node.daemon.socket)["registry"]
                if reg["published"] >= self.opts.entries and reg["outbox"] == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{node.node_id} published {reg['published']} of {self.opts.entries} entries")
                time.sleep(POLL)

    def health(self, problems: list[str]) -> Health:
        assert self.fleet is not None
        errors: dict[str, int] = {}
        rereg = unregistered = 0
        views = []
        for node in self.fleet.live():
            reg = ask(p.Stats(req=1), node.daemon.socket)["registry"]
            for key, count in reg["ops"].items():
                op, _, result = key.partition(":")
                if result == "error":
                    errors[op] = errors.get(op, 0) + count
            rereg += max(0, reg["resyncs"] - 1)  # the first registration is a resync too
            unregistered += not reg["registered"]
            views.append(float(reg["nodes"]))
        return Health(problems, errors, rereg, unregistered, Spread.of(views))

    def links(self) -> dict[str, int]:
        """Peer links each daemon holds (what `kvd status` shows under peers)."""
        assert self.fleet is not None
        return {n.node_id: len(ask(p.Stats(req=1), n.daemon.socket)["peers"]) for n in self.fleet.live()}

    def idle(self, seconds: float | None = None) -> Idle:
        assert self.fleet is not None
        seconds = self.opts.idle_seconds if seconds is None else seconds
        pids = self.fleet.pids()
        meter = CpuMeter([self.registry_pid, *pids])
        time.sleep(seconds)
        wall, cpu, busy = meter.stop()
        statuses = {pid: proc_status(pid) for pid in pids}
        rss = [statuses[pid]["VmRSS"] / MiB for pid in pids]
        links = self.links()
        reg_status = proc_status(self.registry_pid)
        return Idle(
            seconds=round(wall, 3), rss_mib=Spread.of(rss), rss_total_mib=sum(rss),
            pss_total_mib=sum(pss(pid) for pid in pids) / MiB, fds_max=max(fd_count(pid) for pid in pids),
            daemon_cpu_pct_each=Spread.of([cpu[pid] for pid in pids]), daemons_cpu_pct=sum(cpu[pid] for pid in pids),
            registry_cpu_pct=cpu[self.registry_pid], registry_rss_mib=reg_status["VmRSS"] / MiB,
            registry_fds=fd_count(self.registry_pid), machine_busy_pct=busy,
            links_max=max(links.values()), links_total=sum(links.values()))

    def readers(self) -> list[Node]:
        """The daemons the client processes talk to: the first `clients` of the fleet."""
        assert self.fleet is not None
        return self.fleet.nodes[:self.opts.clients]

    def _victim(self) -> Node:
        assert self.fleet is not None
        return self.fleet.nodes[-1]

    def locate(self) -> Throughput:
        """cluster_locate through the readers' daemons, of entries other nodes hold."""
        assert self.fleet is not None
        rng = random.Random(1)
        jobs = []
        for reader in self.readers():
            targets = [(rid, holder) for rid, holder in self.held.items() if holder != reader.node_id]
            rng.shuffle(targets)
            jobs.append((reader.daemon.socket, targets, self.opts.seconds, 0))
        results, wall, cpu, busy = run_workers(_locate_worker, jobs, self.fleet.pids(), self.registry_pid)
        return throughput("cluster_locate via a daemon", results, wall, cpu, busy, self.registry_pid)

    def router_locate(self) -> Throughput:
        """Registry.locate from a router's process: `clients` concurrent lookups on one event loop."""
        assert self.fleet is not None and self.reg is not None
        rids = list(self.held)
        meter = CpuMeter([self.registry_pid, *self.fleet.pids()])
        results = self.runner.run(self._router_locate(rids))
        wall, cpu, busy = meter.stop()
        return throughput("Registry.locate (router)", results, wall, cpu, busy, self.registry_pid)

    async def _router_locate(self, rids: list[str]) -> list[WorkerResult]:
        assert self.reg is not None
        end = time.monotonic() + self.opts.seconds

        async def one(seed: int) -> WorkerResult:
            res, rng = WorkerResult(), random.Random(seed)
            while time.monotonic() < end:
                rid = rng.choice(rids)
                t0 = time.perf_counter()
                try:
                    found = await self.reg.locate(rid)
                except RegistryUnavailable as exc:
                    res.errors += 1
                    res.first_error = res.first_error or str(exc)
                    continue
                res.latencies.append(time.perf_counter() - t0)
                if found and found[0].node.node_id == self.held[rid]:
                    res.ops += 1
                else:
                    res.mismatches += 1
            return res

        return list(await asyncio.gather(*(one(i) for i in range(self.opts.clients))))

    def pulls(self) -> Throughput:
        """Gets with no source at the readers' daemons, of entries held elsewhere (not by a reader,
        nor by the node the dead-node step kills); each entry read once (a get moves it)."""
        assert self.fleet is not None
        readers = self.readers()
        keep = {n.node_id for n in readers} | {self._victim().node_id}
        holders = [n.node_id for n in self.fleet.nodes if n.node_id not in keep]
        random.Random(2).shuffle(holders)
        by_holder: dict[str, list[str]] = {}
        for rid, holder in self.held.items():
            by_holder.setdefault(holder, []).append(rid)
        limit = -(-self.opts.pulls // len(readers)) if self.opts.pulls else 0
        jobs = []
        for i, reader in enumerate(readers):  # each reader its own holders, each holder's entries in a row
            mine = holders[i::len(readers)]
            targets = [(rid, h) for h in mine for rid in by_holder.get(h, [])]
            jobs.append((reader.daemon.socket, targets, self.opts.seconds, limit, self.opts.entry_bytes))
        results, wall, cpu, busy = run_workers(_pull_worker, jobs, self.fleet.pids(), self.registry_pid)
        tp = throughput("get(rid), no source: pull from the holder", results, wall, cpu, busy, self.registry_pid)
        return split_latencies(tp, results)

    def kill_one(self, timeout: float | None = None) -> DeadNode:
        """SIGKILL the last daemon; time until the listing, another daemon's view and the holder
        records no longer have it."""
        assert self.fleet is not None and self.reg is not None
        victim = self.fleet.victim = self.victim = self._victim()
        observer = self.fleet.nodes[len(self.fleet.nodes) // 2]
        rid = rid_of(victim.index, 0)
        assert self.runner.run(self.reg.locate(rid)), "the victim's entry is not located before the kill"
        timeout = timeout if timeout is not None else 4 * self.opts.ttl + 10
        t0 = time.monotonic()
        victim.daemon.proc.kill()
        victim.daemon.proc.wait(10)
        times: dict[str, float] = {}
        while len(times) < 3 and time.monotonic() - t0 < timeout:
            self.runner.run(self._look(victim.node_id, observer, rid, t0, times))
            time.sleep(POLL)
        nan = float("nan")
        return DeadNode(ttl_s=self.opts.ttl, bound_s=2 * self.opts.ttl,
                        registry_listing_s=times.get("listing", nan), daemon_view_s=times.get("daemon", nan),
                        holders_s=times.get("holders", nan))

    async def _look(self, node_id: str, observer: Node, rid: str, t0: float, times: dict[str, float]) -> None:
        assert self.reg is not None
        if "listing" not in times and node_id not in await listed_ids(self.reg):
            times["listing"] = time.monotonic() - t0
        if "daemon" not in times and node_id not in {n["node_id"] for n in ask(p.ClusterNodes(req=1),
                                                                                observer.daemon.socket)}:
            times["daemon"] = time.monotonic() - t0
        if "holders" not in times and not await self.reg.locate(rid):
            times["holders"] = time.monotonic() - t0


def run_backend(kind: str, opts: Options, log=print) -> BackendResult:
    with ScaleRun(kind, opts) as run:
        log(f"[{kind}] starting {opts.nodes} daemons")
        registration = run.start()
        problems = record_problems(run.records(), run.fleet)  # (a flapping registry shows here)
        log(f"[{kind}] all listed after {registration.all_listed_s:.1f}s; putting {opts.entries} entries each")
        run.put_entries()
        log(f"[{kind}] idle for {opts.idle_seconds:g}s")
        idle = run.idle()
        log(f"[{kind}] lookups")
        locate = run.locate()
        router = run.router_locate()
        pulls = run.pulls()
        links_after = run.links()
        health = run.health(problems)
        log(f"[{kind}] killing one node")
        dead = run.kill_one()
        result = BackendResult(kind, opts.nodes, opts.ttl, registration, idle, locate, router, pulls,
                               links_after, health, dead)
        result.unclean_exits = run.close()
        return result


# ---- the report ------------------------------------------------------------------------------------------


def _f(x: float, digits: int = 1) -> str:
    return "n/a" if x != x else f"{x:.{digits}f}"


def _spread(s: Spread, digits: int = 2, unit: str = "") -> str:
    return f"{_f(s.median, digits)} / {_f(s.p90, digits)} / {_f(s.max, digits)}{unit}"


def _tp(t: Throughput) -> str:
    extra = f", {t.errors} errors" if t.errors else ""
    extra += f", {t.mismatches} mismatches" if t.mismatches else ""
    return (f"{t.per_s:,.0f}/s ({t.ops} in {t.seconds:.1f}s, {t.clients} clients; p50 {_f(t.latency_ms.median, 2)} ms, "
            f"p90 {_f(t.latency_ms.p90, 2)} ms){extra}")


def _cpu_pair(t: Throughput) -> str:
    return f"{_f(t.registry_cpu_pct)} / {_f(t.daemons_cpu_pct)}"


def _pull_split(t: Throughput) -> str:
    first, linked = t.first_contact_ms or Spread.of([]), t.linked_ms or Spread.of([])
    return f"{_f(first.median)} / {_f(first.p90)} ; {_f(linked.median)} / {_f(linked.p90)}"


ROWS: list[tuple[str, Any]] = [  # (what, how to show it for one backend's result)
    ("daemons", lambda r: str(r.nodes)),
    ("--registry-ttl", lambda r: f"{r.ttl_s:g}s"),
    ("all N listed, from the first spawn", lambda r: f"{r.registration.all_listed_s:.1f}s"),
    ("per daemon: spawn -> ready (p50 / p90 / max)", lambda r: _spread(r.registration.spawn_to_ready_s, 2, " s")),
    ("per daemon: ready -> listed (p50 / p90 / max)", lambda r: _spread(r.registration.ready_to_listed_s, 2, " s")),
    ("cluster_locate via a daemon", lambda r: _tp(r.locate)),
    ("  registry CPU / all daemons CPU (% of a core)", lambda r: _cpu_pair(r.locate)),
    ("Registry.locate from a router", lambda r: _tp(r.router_locate)),
    ("  registry CPU (% of a core)", lambda r: _f(r.router_locate.registry_cpu_pct)),
    ("get(rid) with no source, pulled across nodes", lambda r: _tp(r.pulls)),
    ("  first get from a holder ; on a link already up (p50 / p90 ms)", lambda r: _pull_split(r.pulls)),
    ("  registry CPU / all daemons CPU (% of a core)", lambda r: _cpu_pair(r.pulls)),
    ("dead node: gone from the registry listing",
     lambda r: f"{_f(r.dead.registry_listing_s, 2)}s (2 x TTL = {r.dead.bound_s:g}s)"),
    ("dead node: gone from another daemon's view", lambda r: f"{_f(r.dead.daemon_view_s, 2)}s"),
    ("dead node: its entries no longer located", lambda r: f"{_f(r.dead.holders_s, 2)}s"),
    ("idle: registry CPU (% of a core)", lambda r: _f(r.idle.registry_cpu_pct)),
    ("idle: all daemons CPU (% of a core)", lambda r: _f(r.idle.daemons_cpu_pct)),
    ("idle: one daemon's CPU (p50 / p90 / max %)", lambda r: _spread(r.idle.daemon_cpu_pct_each, 2)),
    ("idle: machine busy (% of all cores)", lambda r: _f(r.idle.machine_busy_pct)),
    ("daemon RSS (p50 / p90 / max)", lambda r: _spread(r.idle.rss_mib, 1, " MiB")),
    ("daemons' RSS total / PSS total", lambda r: f"{r.idle.rss_total_mib:,.0f} / {r.idle.pss_total_mib:,.0f} MiB"),
    ("open fds: busiest daemon / registry", lambda r: f"{r.idle.fds_max} / {r.idle.registry_fds}"),
    ("registry RSS", lambda r: f"{r.idle.registry_rss_mib:.0f} MiB"),
    ("peer links at idle: busiest daemon / all", lambda r: f"{r.idle.links_max} / {r.idle.links_total}"),
    ("peer links after the pulls: busiest / all",
     lambda r: f"{max(r.links_after.values())} / {sum(r.links_after.values())}"),
    ("registry: wrong or missing records once all were listed", lambda r: str(len(r.health.record_problems))),
    ("registry: failed calls (all daemons) / re-registrations",
     lambda r: f"{sum(r.health.op_errors.values())} / {r.health.reregistrations}"),
    ("each daemon's view of the cluster (p50 / max nodes)",
     lambda r: f"{r.health.view_sizes.median:.0f} / {r.health.view_sizes.max:.0f}"),
    ("unclean daemon exits at the end", lambda r: str(r.unclean_exits)),
]


def table(results: list[BackendResult]) -> str:
    out = ["| | " + " | ".join(r.backend for r in results) + " |", "|---|" + "---|" * len(results)]
    out += [f"| {name} | " + " | ".join(show(r) for r in results) + " |" for name, show in ROWS]
    return "\n".join(out)


def machine() -> str:
    load = os.getloadavg()
    return (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"load average before the run {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM: clean up like Ctrl-C


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Options()
    ap.add_argument("--nodes", type=int, default=d.nodes)
    ap.add_argument("--backends", default="etcd,redis", help="comma-separated: etcd, redis")
    ap.add_argument("--ttl", type=float, default=d.ttl, help="--registry-ttl of the daemons, seconds")
    ap.add_argument("--clients", type=int, default=d.clients)
    ap.add_argument("--seconds", type=float, default=d.seconds, help="length of each lookup phase")
    ap.add_argument("--idle-seconds", type=float, default=d.idle_seconds)
    ap.add_argument("--entries", type=int, default=d.entries, help="entries each daemon holds")
    ap.add_argument("--batch", type=int, default=d.batch)
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    args = ap.parse_args(argv)
    opts = Options(nodes=args.nodes, ttl=args.ttl, clients=args.clients, seconds=args.seconds,
                   idle_seconds=args.idle_seconds, entries=args.entries, batch=args.batch)
    signal.signal(signal.SIGTERM, _interrupt)
    header = machine()
    started = time.time()
    results = [run_backend(kind.strip(), opts) for kind in args.backends.split(",") if kind.strip()]
    print(f"\nmachine: {header}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
          f"run took {time.time() - started:.0f}s\n")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"machine": header, "options": asdict(opts),
                                         "results": [asdict(r) for r in results]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
