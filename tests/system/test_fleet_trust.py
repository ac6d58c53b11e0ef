"""A fleet that trusts no one who merely can write to its registry: the attacks of the fleet-trust
issue, tried as an attacker would on real daemons and a real etcd and Redis, against the README's
recipe (a cluster CA, a registry), each under a live workload that checks every byte.

The registry is the recipe's too: etcd with auth on over TLS, Redis with an ACL user over TLS (a
self-signed certificate made with openssl for the run; the daemons get a user, a password file and
--registry-ca). The attacker writes to it as an administrator would (`Forger`: whoever can write to
the registry, credentials included), and runs daemons of its own: one with a cert the CA really
signed, for its own node id ("evil", an insider), and raw ZeroMQ sockets. What it may achieve is
denial of service; never a wrong byte, never a push or a pull through its hands, never a daemon's
exit.
"""
from __future__ import annotations

import base64
import json
import signal
import socket
import time
from pathlib import Path

import pytest
import torch
import zmq

import kvd
from kvd.client.connection import ask
from kvd.cluster.records import EtcdKeys, HolderRecord, RedisKeys, encode_holder, key_part
from kvd.testing.daemons import eventually, free_port
from kvd.trust import load_cert, load_node_keys
from kvd.trust.keygen import keygen_ca, keygen_node
from kvd.wire import protocol as p
from tests.cluster.conftest import _missing
from tests.cluster.servers import EtcdServer, RedisServer, find_etcd, find_redis, make_certs, start_server, stop_server
from tests.system.test_cluster import TTL, Cluster, Workload, exact, kv_for, wait_listed

PASSWORD = "fleet-S3cret"


@pytest.fixture(scope="module", params=["etcd", "redis"])
def registry(request, tmp_path_factory):
    """A registry as the README's recipe runs one: auth on, TLS."""
    binary = find_etcd() if request.param == "etcd" else find_redis()
    if binary is None:
        _missing(request.param)
    root = tmp_path_factory.mktemp(f"{request.param}-secured")
    server = start_server(EtcdServer if request.param == "etcd" else RedisServer, binary,
                          certs=make_certs(root / "certs"), auth=("kvd", PASSWORD))
    (root / "password").write_text(PASSWORD + "\n")
    server.password_file = str(root / "password")
    yield server
    stop_server(server)


class SecuredCluster(Cluster):
    def flags(self, *extra: str) -> list[str]:
        scheme, _, where = self.registry.url.partition("://")
        return ["--registry", f"{scheme}://kvd@{where}", "--registry-password-file", self.registry.password_file,
                "--registry-ca", self.registry.certs.server_cert, "--cluster", self.name, "--registry-ttl",
                f"{TTL}s", *extra]


@pytest.fixture
def cluster(daemons, registry):
    return SecuredCluster(daemons, registry)


class CA:
    """A cluster CA in a temp dir, and a key pair and cert per node (the README's three commands)."""

    def __init__(self, root: Path, cluster: str) -> None:
        self.dir, self.cluster = root / "keys", cluster
        keygen_ca(str(self.dir))

    def node(self, node_id: str) -> list[str]:
        if not (self.dir / f"{node_id}.cert").exists():
            keygen_node(str(self.dir), node_id, ca_secret=str(self.dir / "ca.key_secret"), cluster=self.cluster)
        return ["--curve-secret-key", str(self.dir / f"{node_id}.key_secret"), "--curve-ca", str(self.dir / "ca.key")]


@pytest.fixture
def ca(tmp_path, cluster):
    return CA(tmp_path, cluster.name)


class Forger:
    """Whoever can write to the registry (an administrator's rights): raw writes, as etcdctl or
    redis-cli would make them."""

    def __init__(self, cluster: Cluster) -> None:
        self.server, self.name = cluster.registry, cluster.name
        self.etcd = isinstance(self.server, EtcdServer)

    def node_value(self, node_id: str) -> bytes:
        if self.etcd:
            key = base64.b64encode(EtcdKeys(self.name).node(node_id).encode()).decode()
            kvs = self.server.admin("/v3/kv/range", {"key": key}).get("kvs", [])
            return base64.b64decode(kvs[0]["value"]) if kvs else b""
        return self.server.admin().get(RedisKeys(self.name).node(node_id)) or b""

    def put_node(self, node_id: str, value: bytes, leased: bool = False) -> None:
        """Write any value under node_id's key, with no lease (etcd) or TTL (Redis), or with one
        of a minute (the forger can make leases too)."""
        if self.etcd:
            lease = int(self.server.admin("/v3/lease/grant", {"TTL": 60})["ID"]) if leased else 0
            self.server.put(EtcdKeys(self.name).node(node_id), value, lease=lease)
        else:
            keys, r = RedisKeys(self.name), self.server.admin()
            r.set(keys.node(node_id), value, px=60_000 if leased else None)
            r.zadd(keys.nodes, {keys.node(node_id): int(time.time() * 1000) + 3_600_000})
            r.incr(keys.nodes_version)

    def put_holder(self, record: HolderRecord, under: str | None = None) -> None:
        """A holder record of rid under node `under`'s name (its own node_id by default)."""
        under = under or record.node_id
        if self.etcd:
            self.server.put(EtcdKeys(self.name).holder(record.rid, under), encode_holder(record))
        else:
            r = self.server.admin()
            r.hset(RedisKeys(self.name).holders(record.rid), key_part(under), encode_holder(record))
            r.pexpire(RedisKeys(self.name).holders(record.rid), 3_600_000)


def settle(read, ok, timeout: float, what: str):
    """Wait until ok(read()); the assertion names the last value read."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = read()
        except Exception as exc:  # (not there yet)
            value = exc
        if not isinstance(value, Exception) and ok(value):
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s; last seen: {value!r}"
        time.sleep(0.05)


def node_record(daemon, node_id: str) -> dict:
    """Node node_id's record as daemon sees it."""
    return next(n for n in ask(p.ClusterNodes(req=1), daemon.socket) if n["node_id"] == node_id)


def entries(daemon) -> set[str]:
    return {e["request_id"] for e in ask(p.ListEntries(req=1, after=None, limit=p.LIST_PAGE), daemon.socket)}


def alive(*daemons) -> None:
    for d in daemons:
        assert d.proc.poll() is None, f"{d.node_id} exited:\n{d.log()[-2000:]}"


@pytest.mark.timeout(120)
def test_a_registry_writer_can_neither_take_pushes_nor_forge_caches(cluster, ca):
    a, b = cluster.start("A", *ca.node("A")), cluster.start("B", *ca.node("B"))
    # the insider: a daemon with a real cert, for its own id; it lists nothing itself
    evil = cluster.start("evil", *ca.node("evil"), "--registry-publish", "none")
    wait_listed(cluster, [a, b, evil], 3)
    forger = Forger(cluster)
    load = Workload(a, b, "w")
    load.start()
    try:
        with evil.client() as ce:  # the bytes it would like A to take for r2
            ce.put("r2", {"k": torch.zeros(1024, dtype=torch.int64), "v": torch.zeros(1024, dtype=torch.int64)})
        evil_node = json.loads(forger.node_value("evil"))
        evil_inc = int(evil_node["incarnation"], 16)
        # B's key names the insider's endpoint (its own signed record, relabelled), again and again
        forged = json.dumps({**evil_node, "node_id": "B"}).encode()
        forger.put_holder(HolderRecord("r2", "B", evil_inc, 1, 16384, expires_at=None), under="B")
        dropped = lambda: sum(ask(p.Stats(req=1), a.socket)["registry"]["dropped"].values())  # noqa: E731
        seen, tested = dropped(), 0
        with a.client() as ca_:
            for i in range(10):
                forger.put_node("B", forged, leased=True)
                # A's watch sees it and drops it (on Redis it polls, and sees only a change of value):
                # a push after that is one the forgery had its chance to divert
                deadline = time.monotonic() + 3
                while dropped() == seen and time.monotonic() < deadline:
                    time.sleep(0.05)
                tested += dropped() > seen
                seen = dropped()
                rid = f"r1-{i}"
                try:
                    ca_.put(rid, kv_for(rid), dest="B")
                except kvd.KvdError:
                    continue  # refused while B's record is being restored: denial, not diversion
                with b.client() as cb:
                    assert exact(rid, cb.get(rid, timeout=5))
            with pytest.raises(kvd.KvdError):
                got = ca_.get("r2", timeout=2)
                raise AssertionError(f"A took r2 from somewhere: {got}")
        assert tested >= 1, "A never saw a forged record of B before a push: nothing was tested"
        print(f"{tested} of 10 pushes followed a forged record of B that A saw")
        assert not any(rid.startswith("r1-") for rid in entries(evil))  # no push went through the insider
        assert "r2" in entries(evil)  # (and none of A's gets pulled its bytes)
        # B notices its record changed and writes it again within 2 x TTL
        eventually(lambda: json.loads(forger.node_value("B") or b"{}").get("endpoint") == b.listen,
                   timeout=2 * TTL + 2)
        settle(lambda: node_record(a, "B"), lambda n: n["endpoint"] == b.listen, 2 * TTL + 2, "B back in A's view")
        load.progresses(10)
    finally:
        load.halt.set()
        load.join(10)
    assert load.mismatches == 0
    alive(a, b, evil)
    page = ask(p.Stats(req=1), a.socket)["registry"]["dropped"]
    assert sum(page.values()) >= 1, page


@pytest.mark.timeout(120)
def test_fake_holder_records_never_end_a_get(cluster, ca):
    a, b = cluster.start("A", *ca.node("A")), cluster.start("B", *ca.node("B"))
    evil = cluster.start("evil", *ca.node("evil"), "--registry-publish", "none")
    wait_listed(cluster, [a, b, evil], 3)
    forger = Forger(cluster)
    evil_inc = int(json.loads(forger.node_value("evil"))["incarnation"], 16)
    with b.client() as cb:
        cb.put("r3", kv_for("r3"))
    eventually(lambda: ask(p.ClusterLocate(req=1, request_id="r3"), a.socket) != [])
    # ranked first by the fields a holder reports about itself, if anyone believed them
    for who, inc in (("zzz", 7), ("evil", evil_inc)):
        forger.put_holder(HolderRecord("r3", who, inc, 1, 1 << 60, expires_at=None))
    with a.client() as ca_:
        started = time.monotonic()
        assert exact("r3", ca_.get("r3", timeout=10))
        assert time.monotonic() - started < 3
    alive(a, b, evil)


@pytest.mark.timeout(90)
def test_a_record_left_under_a_nodes_id_does_not_lock_it_out(cluster, ca):
    forger = Forger(cluster)
    stale = {"v": 1, "node_id": "B", "incarnation": "abc", "endpoint": "tcp://127.0.0.1:1", "role": "any"}
    forger.put_node("B", json.dumps(stale).encode())  # no lease, no TTL: it would outlive every B
    b = cluster.start("B", *ca.node("B"))
    eventually(lambda: ask(p.Stats(req=1), b.socket)["registry"]["registered"], timeout=2 * TTL + 3)
    assert json.loads(forger.node_value("B"))["endpoint"] == b.listen


@pytest.mark.timeout(60)
def test_a_peer_cannot_call_itself_another_node(daemons, tmp_path):
    ca = CA(tmp_path, "kvd")
    b = daemons.start("B", extra=ca.node("B"))
    ca.node("evil")
    evil_keys = load_node_keys(str(ca.dir / "evil.key_secret"))
    b_keys = load_node_keys(str(ca.dir / "B.key"))
    evil_cert = load_cert(str(ca.dir / "evil.cert")).raw

    def hello(node_id: str, cert: bytes | None, key=evil_keys) -> p.Message | None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_secretkey, sock.curve_publickey = key.curve_secret, key.curve_public
        sock.curve_serverkey = b_keys.curve_public
        sock.connect(b.listen)
        try:
            sock.send_multipart(p.encode(p.PeerHello(node_id=node_id, incarnation=1, cert=cert)))
            return p.decode(sock.recv_multipart()) if sock.poll(5000) else None
        finally:
            sock.close()

    assert isinstance(hello("evil", evil_cert), p.PeerHelloOk)  # as itself, it is admitted
    for node_id, cert in (("A", evil_cert), ("A", None), ("evil", None)):
        answer = hello(node_id, cert)
        assert isinstance(answer, p.Abort) and answer.code == kvd.Unauthorized.code, (node_id, answer)
    stranger_public, stranger_secret = zmq.curve_keypair()
    stranger = type(evil_keys)(stranger_public, stranger_secret)
    answer = hello("evil", evil_cert, key=stranger)  # a cert is worth nothing without its key
    assert isinstance(answer, p.Abort) and "another CURVE key" in answer.message
    alive(b)


@pytest.mark.timeout(90)
def test_a_denied_key_is_cut_at_once_on_sighup(daemons, tmp_path):
    """Static peers under a CA (B's key from B.cert among --curve-allow); the same cut applies to a
    node found in a registry, and to a key taken out of --curve-allow (test_curve_reload.py)."""
    ca = CA(tmp_path, "kvd")
    deny = tmp_path / "deny"
    deny.write_text("# revoked keys\n")
    ca.node("A"), ca.node("B")
    port_b = free_port()
    b = daemons.start("B", port=port_b, extra=[*ca.node("B"), "--curve-deny", str(deny)])
    a = daemons.start("A", peers={"B": f"tcp://127.0.0.1:{port_b}"},
                      extra=[*ca.node("A"), "--curve-allow", str(ca.dir)])
    with a.client() as ca_, b.client() as cb:
        ca_.put("before", kv_for("before"), dest="B")
        assert exact("before", cb.get("before", timeout=5))
        deny.write_text(load_node_keys(str(ca.dir / "A.key")).curve_public.decode() + "  # A, revoked\n")
        b.proc.send_signal(signal.SIGHUP)
        eventually(lambda: "newly denied" in b.log(), timeout=5)
        started = time.monotonic()
        with pytest.raises(kvd.Unauthorized):
            ca_.put("after", kv_for("after"), dest="B")
        assert time.monotonic() - started < 5
        assert "after" not in entries(b)
    alive(a, b)


def test_a_listener_beyond_loopback_needs_peer_authentication(daemons, tmp_path):
    wide = f"tcp://0.0.0.0:{free_port()}"
    refused = daemons.start("W", extra=["--listen", wide], wait=False)
    assert refused.proc.wait(20) == 1
    log = refused.log()
    assert "without peer authentication" in log and "--insecure" in log
    for command in ("kvd keygen --ca", "kvd keygen NODE", "--curve-ca"):
        assert command in log
    daemons.daemons.remove(refused)
    allowed = daemons.start("W", extra=["--listen", wide, "--insecure"])
    assert "--insecure: peers are not authenticated" in allowed.log()
    keys = CA(tmp_path, "kvd")
    secure = daemons.start("S", extra=["--listen", f"tcp://0.0.0.0:{free_port()}", *keys.node("S")])
    assert "CURVE on (cluster CA" in secure.log()


@pytest.mark.timeout(90)
def test_without_peer_authentication_a_registry_cannot_send_a_push_off_this_host(cluster):
    """The loopback recipe (no CURVE): a record naming an address beyond loopback is not dialled."""
    a, b = cluster.start("A"), cluster.start("B")
    wait_listed(cluster, [a, b], 2)
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    address = _host_address()
    if address is None:
        pytest.skip("this host has no address beyond loopback")
    forger = Forger(cluster)
    record = json.loads(forger.node_value("B"))
    forger.put_node("C", json.dumps({**record, "node_id": "C",
                                     "endpoint": f"tcp://{address}:{listener.getsockname()[1]}"}).encode(), leased=True)
    eventually(lambda: any(n["node_id"] == "C" for n in ask(p.ClusterNodes(req=1), a.socket)), timeout=15)
    with a.client() as ca_, pytest.raises(kvd.KvdError):
        ca_.put("offhost", kv_for("offhost"), dest="C")
    with pytest.raises(OSError):
        listener.accept()  # nobody dialled it
    listener.close()
    assert "dials only loopback endpoints" in a.log()


def _host_address() -> str | None:
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address



@pytest.mark.timeout(60)
def test_wrong_registry_credentials_keep_the_daemon_serving_and_say_so(cluster, tmp_path):
    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-the-password\n")
    b = cluster.factory.start("B")
    flags = cluster.flags()
    flags[flags.index("--registry-password-file") + 1] = str(wrong)
    a = cluster.factory.start("A", extra=[*flags, "--peer", f"B={b.listen}"])
    settle(lambda: ask(p.Stats(req=1), a.socket)["registry"], lambda r: r["refused"] and not r["up"], 10,
           "A's status saying the registry refused it")
    status = ask(p.Stats(req=1), a.socket)["registry"]
    assert "refused" in status["last_error"] and "not-the-password" not in json.dumps(status)
    with a.client() as ca_, b.client() as cb:  # static peers work all the same
        ca_.put("static", kv_for("static"), dest="B")
        assert exact("static", cb.get("static", timeout=5))
    log = a.log()
    assert "refused" in log and "not-the-password" not in log
    alive(a, b)
