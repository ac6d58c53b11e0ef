"""A kvd cluster on a real registry (etcd and Redis): daemons find each other by node id, a get
with no source finds the request's holder, and losing the registry never loses data or a daemon.

Real daemons, real registry servers (tests/cluster/servers.py) on free loopback ports, a cluster
name of their own per test. The workload checker holds every get to one rule: it returns exactly
the bytes that were put under its request id, or a KvdError; never anything else.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import pytest
import torch

import kvd
from kvd.client.connection import ask
from kvd.testing.daemons import DaemonFactory, eventually, free_port, wait_ready
from kvd.wire import protocol as p
from tests.cluster.conftest import start_or_skip
from tests.cluster.servers import stop_server

TTL = 2.0  # seconds: a dead node leaves the listing within about twice this


@pytest.fixture(scope="module", params=["etcd", "redis"])
def registry(request):
    server = start_or_skip(request.param)
    yield server
    stop_server(server)


class Cluster:
    """Daemons of one cluster (a name of their own) on one registry."""

    def __init__(self, factory: DaemonFactory, registry) -> None:
        self.factory, self.registry = factory, registry
        self.name = f"c{uuid.uuid4().hex[:8]}"

    def flags(self, *extra: str) -> list[str]:
        return ["--registry", self.registry.url, "--cluster", self.name, "--registry-ttl", f"{TTL}s", *extra]

    def start(self, node_id: str, *extra: str, port: int | None = None, wait: bool = True):
        return self.factory.start(node_id, extra=self.flags(*extra), port=port, wait=wait)

    def node_ids(self, daemon) -> set[str]:
        return {n["node_id"] for n in ask(p.ClusterNodes(req=1), daemon.socket)}


@pytest.fixture
def cluster(daemons, registry):
    return Cluster(daemons, registry)


def kv_for(request_id: str, n: int = 4096) -> dict:
    """Bytes that say which request they belong to: a get can check them without coordination."""
    seed = int.from_bytes(request_id.encode()[-8:].rjust(8, b"\0"), "little") % (1 << 31)
    k = torch.arange(n, dtype=torch.int64) + seed
    return {"k": k, "v": k * 7}


def exact(request_id: str, kv: dict) -> bool:
    want = kv_for(request_id, len(kv["k"]))
    return torch.equal(kv["k"], want["k"]) and torch.equal(kv["v"], want["v"])


def wait_listed(cluster: Cluster, daemons, count: int, timeout: float = 10.0) -> None:
    eventually(lambda: all(len(cluster.node_ids(d)) == count for d in daemons), timeout=timeout)


def registry_idle(clients) -> bool:
    """Every change each daemon queued for the registry is written, and none is listed any more."""
    return all(r["outbox"] == 0 and r["published"] == 0 for r in (c.stats()["registry"] for c in clients))


def test_eight_daemons_find_each_other_and_serve_gets_by_request_id(cluster):
    nodes = [cluster.start(f"d{i}") for i in range(8)]
    wait_listed(cluster, nodes, 8)
    clients = [n.client() for n in nodes]
    try:
        for i in range(8):  # pull mode: put with no destination, get elsewhere with no source
            rid = f"pulled-{i}"
            clients[i].put(rid, kv_for(rid))
            reader = clients[(i + 3) % 8]
            got = reader.get(rid, timeout=5)
            assert exact(rid, got)
            with pytest.raises(kvd.NotFound):
                clients[i].get(rid, timeout=0)  # the holder's copy moved to its reader
        eventually(lambda: registry_idle(clients))  # the unpublish of the last pulled entry is written first
        writes = [c.stats()["registry"]["ops"].get("publish:ok", 0) for c in clients]
        clients[2].put("pushed", kv_for("pushed"), dest="d6")  # a peer by node id, no --peer given
        assert exact("pushed", clients[6].get("pushed", timeout=2))
        eventually(lambda: registry_idle(clients))  # (whatever the push queued is written by now)
        # the push mode (prefill pushes, decode reads locally) costs no registry write at all
        assert [c.stats()["registry"]["ops"].get("publish:ok", 0) for c in clients] == writes
        status = clients[0].stats()["registry"]
        assert status["registered"] and status["nodes"] == 8 and status["lookups"].get("hit", 0) >= 1
        for c in clients:  # the pull mode left nothing behind, and nothing is listed any more
            eventually(lambda: c.stats()["pool"]["used_bytes"] == 0 and c.stats()["registry"]["listed"] == 0)
    finally:
        for c in clients:
            c.close()


def test_a_get_with_no_source_waits_for_a_holder_to_appear(cluster):
    a, b = cluster.start("A"), cluster.start("B")
    wait_listed(cluster, [a, b], 2)
    with a.client() as ca, b.client() as cb:
        got = {}
        reader = threading.Thread(target=lambda: got.update(kv=cb.get("later", timeout=10)))
        reader.start()
        # the get waits for a holder (else it finds one); asked on a connection of its own (cb is the reader's)
        eventually(lambda: ask(p.Stats(req=1), b.socket)["waiting_reads"] == 1)
        ca.put("later", kv_for("later"))
        reader.join(10)
        assert exact("later", got["kv"])


def test_a_dead_node_leaves_the_listing_and_its_hints_cost_one_attempt(cluster):
    a, b, c = cluster.start("A"), cluster.start("B"), cluster.start("C")
    wait_listed(cluster, [a, b, c], 3)
    with a.client() as ca:
        ca.put("orphan", kv_for("orphan"))
    with b.client() as cb:
        eventually(lambda: ask(p.ClusterLocate(req=1, request_id="orphan"), b.socket) != [])
    a.kill()
    died = time.monotonic()
    with b.client() as cb:  # the hint still names A for a moment: the get fails cleanly, no hang
        started = time.monotonic()
        with pytest.raises(kvd.KvdError):
            cb.get("orphan", timeout=1.5)
        assert time.monotonic() - started < 1.5 + 3
    eventually(lambda: cluster.node_ids(b) == {"B", "C"}, timeout=2 * TTL + 3)
    assert time.monotonic() - died < 2 * TTL + 3
    assert ask(p.ClusterLocate(req=1, request_id="orphan"), c.socket) == []


def test_a_restarted_holder_is_not_trusted_on_its_old_hints(cluster):
    port = free_port()
    a, b = cluster.start("A", port=port), cluster.start("B")
    wait_listed(cluster, [a, b], 2)
    with a.client() as ca:
        ca.put("x", kv_for("x"))
    eventually(lambda: ask(p.ClusterLocate(req=1, request_id="x"), b.socket) != [])
    a.kill()  # kill -9: its records stay until its lease runs out
    a2 = cluster.start("A", port=port)  # same id, same address, a new incarnation: not yet registered
    with a2.client() as ca2:
        ca2.put("x", {"k": torch.zeros(4096, dtype=torch.int64), "v": torch.zeros(4096, dtype=torch.int64)},
                ttl=60)  # another entry under the same id, not what the old hint meant
    with b.client() as cb:
        try:
            got = cb.get("x", timeout=2 * TTL + 4)
        except kvd.KvdError:
            got = None
        # either the get failed, or it found the new A's own (newly published) entry: never the old
        # hint served by the new incarnation, which the identity check refuses
        assert got is None or torch.equal(got["k"], torch.zeros(4096, dtype=torch.int64))
        assert cb.stats()["registry"]["lookups"].get("stale", 0) >= 1 or got is not None


def test_a_duplicate_node_id_stays_out_and_the_first_is_unaffected(cluster):
    first = cluster.start("same")
    eventually(lambda: cluster.node_ids(first) == {"same"})
    second = cluster.start("same")
    time.sleep(2 * TTL)  # the first renews its lease past two TTLs: the second stays out all along
    eventually(lambda: ask(p.Stats(req=1), second.socket)["registry"]["conflict"] is not None, timeout=10)
    with second.client() as c2, first.client() as c1:
        status = c2.stats()["registry"]
        assert not status["registered"] and status["conflict"] is not None
        assert c1.stats()["registry"]["registered"]
        listing = ask(p.ClusterNodes(req=1), first.socket)
        assert [n["incarnation"] for n in listing] == [f"{c1.stats()['incarnation']:x}"]
    assert "is held by another live daemon" in second.log()


def race_for_one_id(cluster, node_id: str) -> list:
    """Two daemons started at once under one node id: after 2 TTLs exactly one is registered."""
    racers = [cluster.start(node_id, wait=False) for _ in range(2)]
    for racer in racers:
        wait_ready(racer)
    time.sleep(2 * TTL)  # past any lease the loser may have seen
    registered: list = []

    def settled() -> bool:
        registered[:] = [ask(p.Stats(req=1), r.socket)["registry"]["registered"] for r in racers]
        return sorted(registered) == [False, True]

    eventually(settled, timeout=10)
    return racers


def test_two_daemons_racing_for_one_id_leave_one_registered(cluster):
    racers = race_for_one_id(cluster, "racer")
    assert len(ask(p.ClusterNodes(req=1), racers[0].socket)) == 1


def test_wildcard_listen_without_advertise_is_refused_with_a_registry(cluster, tmp_path):
    d = cluster.factory.start("W", extra=cluster.flags("--listen", f"tcp://0.0.0.0:{free_port()}"), wait=False)
    assert d.proc.wait(20) == 2
    assert "set advertise (--advertise tcp://HOST:PORT)" in d.log()


def test_routers_read_the_cluster_over_http(cluster):
    port = free_port()
    a = cluster.factory.start("A", extra=cluster.flags("--metrics-port", str(port)))
    b = cluster.start("B")
    wait_listed(cluster, [a, b], 2)
    with b.client() as cb:
        cb.put("where", kv_for("where"))
    base = f"http://127.0.0.1:{port}"
    nodes = json.load(urllib.request.urlopen(f"{base}/cluster/nodes", timeout=5))
    assert sorted(n["node_id"] for n in nodes) == ["A", "B"]
    eventually(lambda: json.load(urllib.request.urlopen(f"{base}/cluster/locate?rid=where", timeout=5)) != [])
    holders = json.load(urllib.request.urlopen(f"{base}/cluster/locate?rid=where", timeout=5))
    assert [h["node_id"] for h in holders] == ["B"]
    metrics = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
    assert "kvd_registry_up 1.0" in metrics and "kvd_cluster_nodes 2.0" in metrics


class Workload(threading.Thread):
    """Puts on a writer and gets (no source) on a reader, over and over, checking every byte: a get
    returns exactly what was put under its id, or raises. `writer` is a daemon, or a callable naming
    the daemon to put on at the moment (a node restarted under its id: its clients connect anew)."""

    def __init__(self, writer, reader, tag: str) -> None:
        super().__init__(daemon=True)
        self.writer = writer if callable(writer) else (lambda: writer)
        self.reader, self.tag = reader, tag
        self.ok = self.errors = self.mismatches = 0
        self.slowest = 0.0
        self.last_error: str | None = None
        self.halt = threading.Event()

    def run(self) -> None:
        current, cw = None, None
        with self.reader.client() as cr:
            i = 0
            while not self.halt.is_set():
                if self.writer() is not current:
                    if cw is not None:
                        cw.close()
                    current = self.writer()
                    cw = current.client()
                rid = f"{self.tag}-{i}"
                i += 1
                started, failed = time.monotonic(), False
                try:
                    cw.put(rid, kv_for(rid, 1024), ttl=30)
                    got = cr.get(rid, timeout=1.0)
                    if exact(rid, got):
                        self.ok += 1
                    else:
                        self.mismatches += 1
                except kvd.KvdError as exc:
                    self.errors, failed = self.errors + 1, True
                    self.last_error = f"{type(exc).__name__}: {exc}"
                self.slowest = max(self.slowest, time.monotonic() - started)
                if failed:
                    time.sleep(0.05)  # (a dead writer fails at once: no busy loop)
        if cw is not None:
            cw.close()

    def progresses(self, timeout: float) -> None:
        """ok grows again within timeout (the fleet healed)."""
        before = self.ok
        eventually(lambda: self.ok > before + 2, timeout=timeout)


@pytest.mark.timeout(180)
def test_losing_the_registry_loses_no_data_and_no_daemon(cluster):
    a, b = cluster.start("A", "--peer", "placeholder=tcp://127.0.0.1:1"), cluster.start("B")
    wait_listed(cluster, [a, b], 2)
    load = Workload(a, b, "w")
    load.start()
    try:
        eventually(lambda: load.ok > 0, timeout=10)
        cluster.registry.pause()  # a hung registry: every call must hit its deadline, never hang a get
        time.sleep(2 * TTL)
        before = load.ok + load.errors
        # gets still end (in errors, while nobody can say who holds what): each within its 1 s timeout
        eventually(lambda: load.ok + load.errors > before, timeout=10)
        with a.client() as ca, b.client() as cb:
            ca.put("static", kv_for("static"), dest="B")  # static and ad-hoc peers keep working
            assert exact("static", cb.get("static", timeout=2))
            started = time.monotonic()
            with pytest.raises(kvd.KvdError):
                ask(p.ClusterLocate(req=1, request_id="anything"), b.socket, timeout=5)
            assert time.monotonic() - started < 1.5  # lookups fail fast once it is known down
        cluster.registry.resume()
        eventually(lambda: b.client().stats()["registry"]["up"], timeout=10)
        with a.client() as ca:
            ca.put("survivor", kv_for("survivor"), ttl=60)  # listed before the wipe
        cluster.registry.restart(wipe=True)  # the registry comes back empty: re-registration, re-publication
        wait_listed(cluster, [a, b], 2, timeout=20)
        with b.client() as cb:
            assert exact("survivor", cb.get("survivor", timeout=10))
        load.progresses(timeout=10)  # the workload runs on after all of it
    finally:
        load.halt.set()
        load.join(10)
    assert load.mismatches == 0, "a get returned bytes that were not put under its id"
    assert load.slowest < 1.0 + 3.0, f"a get took {load.slowest:.1f}s with a timeout of 1 s"
    for d in (a, b):
        assert d.proc.poll() is None  # nobody exited for the registry's sake


def test_a_get_stream_with_no_source_finds_the_holder_too(cluster):
    """The paged connector reads with get_stream (kvd.client.reshard.scatter_shards): by request id
    alone it must find the holder as a get does, and move the entry (keep=False) off the holder."""
    a, b = cluster.start("A"), cluster.start("B")
    wait_listed(cluster, [a, b], 2)
    with a.client() as ca, b.client() as cb:
        ca.put("streamed", kv_for("streamed"))
        got = {}
        for group in cb.get_stream("streamed", timeout=5):
            got.update(group)
        assert exact("streamed", got)
        assert cb.stats()["registry"]["lookups"].get("hit", 0) == 1
        eventually(lambda: ca.stats()["entries"] == 0 and ca.stats()["registry"]["listed"] == 0)
        late = {}  # and one put after the reader began waiting: the lookup waits for its holder
        reader = threading.Thread(target=lambda: [late.update(g) for g in cb.get_stream("later-s", timeout=10)])
        reader.start()
        # the reader waits (else it finds the holder); asked on a connection of its own (cb is the reader's)
        eventually(lambda: ask(p.Stats(req=1), b.socket)["waiting_reads"] == 1)
        ca.put("later-s", kv_for("later-s"))
        reader.join(10)
        assert exact("later-s", late)


def test_a_get_stream_with_no_source_ends_at_its_timeout_while_the_registry_hangs(cluster):
    a, b = cluster.start("A"), cluster.start("B")
    wait_listed(cluster, [a, b], 2)
    cluster.registry.pause()
    try:
        with b.client() as cb:
            started = time.monotonic()
            with pytest.raises(kvd.KvdError):
                for _ in cb.get_stream("nowhere", timeout=1.0):
                    pass
            assert time.monotonic() - started < 1.0 + 3
            assert cb.stats()["waiting_reads"] == 0  # its search went with it
    finally:
        cluster.registry.resume()


@pytest.mark.timeout(240)
def test_faults_under_a_live_workload_never_serve_wrong_bytes(cluster):
    """One workload (puts on C, gets by id on A) through: the holder killed mid-run (some gets are
    between their lookup and their pull), the holder back under the same id with a new incarnation
    (kept out until the old lease ends), two daemons racing for one id, and the registry killed and
    down for a while. Every get returns exactly the bytes put under its id, or a KvdError."""
    port = free_port()
    a, c = cluster.start("A"), cluster.start("C", port=port)
    wait_listed(cluster, [a, c], 2)
    current = [c]
    load = Workload(lambda: current[0], a, "f")
    load.start()
    try:
        load.progresses(timeout=10)
        c.kill()  # the holder dies: gets already looked up fail, none returns other bytes
        time.sleep(0.5)
        current[0] = cluster.start("C", port=port)  # same id and address, a new incarnation
        load.progresses(timeout=2 * TTL + 10)  # listed once the dead incarnation's lease ran out
        racers = race_for_one_id(cluster, "R")
        load.progresses(timeout=10)
        cluster.registry.kill()  # the registry gone for a while: gets end in errors, nobody exits
        time.sleep(2 * TTL)
        cluster.registry.start(new_data=False)
        load.progresses(timeout=2 * TTL + 15)
    finally:
        load.halt.set()
        load.join(10)
    assert load.mismatches == 0
    assert load.errors > 0  # (the faults did reach the workload)
    for d in (a, current[0], *racers):
        assert d.proc.poll() is None  # nobody exited for any of it


def kvd_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvd", *args], capture_output=True, text=True, timeout=30)


def test_operators_see_the_cluster_with_the_cli(cluster):
    a, b = cluster.start("A", "--role", "prefill", "--label", "zone=a"), cluster.start("B", "--role", "decode")
    wait_listed(cluster, [a, b], 2)
    with a.client() as ca:
        ca.put("seen", kv_for("seen"))
    nodes = json.loads(kvd_cli("cluster", "ls", "--json", "--socket", b.socket).stdout)
    assert {(n["node_id"], n["role"], n["endpoint"]) for n in nodes} == {("A", "prefill", a.listen),
                                                                        ("B", "decode", b.listen)}
    table = kvd_cli("cluster", "ls", "--socket", b.socket).stdout
    assert "NODE" in table and "zone=a" in table and a.listen in table
    eventually(lambda: kvd_cli("cluster", "locate", "seen", "--socket", b.socket).returncode == 0)
    located = kvd_cli("cluster", "locate", "seen", "--json", "--socket", b.socket)
    assert [h["node_id"] for h in json.loads(located.stdout)] == ["A"]
    missing = kvd_cli("cluster", "locate", "nowhere", "--socket", b.socket)
    assert missing.returncode == 1 and missing.stdout == ""
    status = kvd_cli("status", "--socket", b.socket).stdout
    assert f"registry   {cluster.registry.url} registered (up, 2 nodes seen" in status
    plain = cluster.factory.start("N")  # a daemon without --registry says so, and fails cleanly
    refused = kvd_cli("cluster", "ls", "--socket", plain.socket)
    assert refused.returncode != 0 and "has no cluster registry (start it with --registry)" in refused.stderr


def test_a_static_peer_wins_over_the_registry_for_its_name(cluster):
    a, b = cluster.start("A"), cluster.start("B")
    wait_listed(cluster, [a, b], 2)
    # C calls A's endpoint "B": its static entry is what "B" means to C, whatever the registry lists
    c = cluster.start("C", "--peer", f"B={a.listen}")
    wait_listed(cluster, [a, b, c], 3)
    with c.client() as cc, a.client() as ca, b.client() as cb:
        cc.put("static-wins", kv_for("static-wins"), dest="B")
        assert exact("static-wins", ca.get("static-wins", timeout=2))
        assert cb.stats()["entries"] == 0


def test_a_node_with_curve_on_publishes_its_public_key(cluster, tmp_path):
    import asyncio

    from kvd.cluster import Registry
    from tests.system.test_security import keygen

    allow = tmp_path / "allow"
    allow.mkdir()
    public_file, secret_file = keygen(tmp_path / "keys", "K")
    (allow / "K.key").write_bytes(public_file.read_bytes())
    k = cluster.start("K", "--curve-secret-key", str(secret_file), "--curve-allow", str(allow))
    wait_listed(cluster, [k], 1)

    async def records():
        async with Registry(cluster.registry.url, cluster=cluster.name) as registry:
            return await registry.nodes()

    (record,) = asyncio.run(records())
    import zmq.auth

    public, _ = zmq.auth.load_certificate(str(public_file))
    assert record.node_id == "K" and record.curve_public == public.decode()
