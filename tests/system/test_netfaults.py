"""Network faults between two daemons, each in a network namespace this module creates.

Daemon A runs in namespace nsA and daemon B in nsB, joined by a veth pair with link-local
addresses (169.254.10.1 and .2); nothing is added to the root namespace, and every packet stays
on that pair. The test's clients still reach both daemons through their ipc socket files (paths
on the shared filesystem) and map their pools through /proc. Faults: the link goes down mid-push,
a tbf rate limit, a tbf queue so short that it drops packets, and netem's loss / delay / reorder /
duplicate / corrupt where the kernel has netem (each case is skipped, saying why, where it does
not). Needs root; skipped as a whole where namespaces cannot be created.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest
import torch

import kvd
from kvd.testing.daemons import DaemonProc, wait_ready

ADDR_A, ADDR_B, PORT = "169.254.10.1", "169.254.10.2", 7470
FAST_HEARTBEAT = ["--heartbeat-interval", "0.3s", "--heartbeat-timeout", "1.5s"]
HEARTBEAT_TIMEOUT = 1.5
SLACK = 1.0  # housekeeping runs every 0.2 s, pings every 0.3 s


def run(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()}")
    return result


@dataclass
class Net:
    ns_a: str
    ns_b: str
    veth_a: str
    veth_b: str

    def link(self, state: str) -> None:
        """Take B's end of the veth pair down or up (a down end takes the pair's carrier with it)."""
        run("ip", "link", "set", "dev", self.veth_b, state, ns=self.ns_b)


@pytest.fixture(scope="module")
def net(request) -> Net:
    if os.geteuid() != 0:
        pytest.skip(f"network namespaces need root (this runs as uid {os.geteuid()})")
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    tag = f"{os.getpid() % 100000}"
    net = Net(f"kvdnfA{tag}", f"kvdnfB{tag}", f"kvnfa{tag}", f"kvnfb{tag}")

    def cleanup() -> None:
        for ns in (net.ns_a, net.ns_b):  # deleting a namespace destroys its end of the veth pair
            run("ip", "netns", "del", ns, check=False)

    request.addfinalizer(cleanup)
    created = run("ip", "netns", "add", net.ns_a, check=False)
    if created.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {created.stderr.strip()}")
    run("ip", "netns", "add", net.ns_b)
    run("ip", "link", "add", net.veth_a, "type", "veth", "peer", "name", net.veth_b)
    run("ip", "link", "set", net.veth_a, "netns", net.ns_a)
    run("ip", "link", "set", net.veth_b, "netns", net.ns_b)
    for ns, dev, addr in ((net.ns_a, net.veth_a, ADDR_A), (net.ns_b, net.veth_b, ADDR_B)):
        run("ip", "addr", "add", f"{addr}/16", "dev", dev, ns=ns)
        run("ip", "link", "set", "dev", dev, "up", ns=ns)
        run("ip", "link", "set", "dev", "lo", "up", ns=ns)
    return net


def start_in(factory, ns: str, node: str, addr: str, peer: str, peer_addr: str, extra: list[str],
             pool_size: str) -> DaemonProc:
    """`kvd serve` inside a namespace (`ip netns exec` execs it: the pid is the daemon's own)."""
    index = len(factory.daemons)
    sock = f"ipc://{factory.workdir}/{node}-{index}.sock"
    log_path = factory.workdir / f"{node}-{index}.log"
    args = ["ip", "netns", "exec", ns, sys.executable, "-m", "kvd", "serve", "--node-id", node,
            "--listen", f"tcp://{addr}:{PORT}", "--socket", sock, "--pool-size", pool_size,
            "--metrics-port", "0", "--log-level", "debug", "--peer", f"{peer}=tcp://{peer_addr}:{PORT}",
            "--insecure",  # (a link-local veth pair of the test's own: nothing else can reach it)
            *extra]
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT)
    daemon = DaemonProc(node, sock, f"tcp://{addr}:{PORT}", proc, log_path, args)
    factory.daemons.append(daemon)  # the `daemons` fixture stops it and checks its exit code
    return daemon


def start_pair(factory, net: Net, extra: list[str] | None = None, pool_size: str = "320MiB"):
    a = start_in(factory, net.ns_a, "A", ADDR_A, "B", ADDR_B, extra or [], pool_size)
    b = start_in(factory, net.ns_b, "B", ADDR_B, "A", ADDR_A, extra or [], pool_size)
    wait_ready(a)
    wait_ready(b)
    return a, b


@contextlib.contextmanager
def qdisc(net: Net, *spec: str):
    """A root qdisc on A's end (A -> B traffic: pushes, and pulls B makes from A); skip if unknown."""
    added = run("tc", "qdisc", "add", "dev", net.veth_a, "root", *spec, ns=net.ns_a, check=False)
    if added.returncode != 0:
        if "unknown" in added.stderr.lower() or "not found" in added.stderr.lower():
            pytest.skip(f"tc qdisc {spec[0]} is not available in this kernel: {added.stderr.strip()}")
        raise RuntimeError(f"tc qdisc add {' '.join(spec)}: {added.stderr.strip()}")
    try:
        yield
    finally:
        run("tc", "qdisc", "del", "dev", net.veth_a, "root", ns=net.ns_a, check=False)


def qdisc_stats(net: Net) -> dict[str, int]:
    text = run("tc", "-s", "qdisc", "show", "dev", net.veth_a, ns=net.ns_a).stdout
    found = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+)", text)
    return {"sent_bytes": int(found[1]), "packets": int(found[2]), "dropped": int(found[3])} if found else {}


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def wait_pools_empty(*clients, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        used = [c.stats()["pool"]["used_bytes"] for c in clients]
        if not any(used):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pool bytes still used after {timeout}s: {used}")
        time.sleep(0.1)


def push_and_pull(ca, cb, data: torch.Tensor, tag: str) -> tuple[float, float]:
    """A pushes data to B and B pulls a copy from A; both bit-exact. Returns (push s, pull s)."""
    t0 = time.monotonic()
    ca.put(f"{tag}-push", {"x": data}, dest="B")
    push_s = time.monotonic() - t0
    assert torch.equal(cb.get(f"{tag}-push", timeout=30)["x"], data)
    ca.put(f"{tag}-pull", {"x": data})
    t0 = time.monotonic()
    got = cb.get(f"{tag}-pull", source="A", timeout=30)["x"]
    pull_s = time.monotonic() - t0
    assert torch.equal(got, data)
    return push_s, pull_s


def test_transfers_cross_the_veth_pair(daemons, net):
    a, b = start_pair(daemons, net, pool_size="128MiB")
    data = random_bytes(32 << 20, 1)
    with a.client() as ca, b.client() as cb:
        push_and_pull(ca, cb, data, "plain")
        assert ca.stats()["peers"]["B"]["endpoint"] == f"tcp://{ADDR_B}:{PORT}"
        wait_pools_empty(ca, cb, timeout=3)


class Pusher(threading.Thread):
    def __init__(self, daemon: DaemonProc, request_id: str, data: torch.Tensor) -> None:
        super().__init__(daemon=True)
        self.d, self.request_id, self.data = daemon, request_id, data
        self.error: kvd.KvdError | None = None
        self.finished = 0.0

    def run(self) -> None:
        with self.d.client() as c:
            try:
                c.put(self.request_id, {"x": self.data}, dest="B")
            except kvd.KvdError as exc:
                self.error = exc
            self.finished = time.monotonic()


def start_push_and_wait_in_flight(a: DaemonProc, ca, request_id: str, data: torch.Tensor) -> Pusher:
    pusher = Pusher(a, request_id, data)
    pusher.start()
    deadline = time.monotonic() + 10
    while ca.stats()["counters"]["sent_bytes"] < (8 << 20) and pusher.is_alive() and time.monotonic() < deadline:
        time.sleep(0.002)
    assert pusher.is_alive(), "the push finished before the fault could hit it"
    return pusher


def test_link_down_mid_push_fails_fast_and_leaks_nothing(daemons, net):
    a, b = start_pair(daemons, net, [*FAST_HEARTBEAT, "--transfer-timeout", "10s"])
    data = random_bytes(192 << 20, 2)
    # shaped to 1 Gbit/s, the push takes 1.6 s: the link is certain to go down mid-push (at veth
    # speed the rest of it could go in the few ms between "in flight" and the link going down)
    with a.client() as ca, b.client() as cb, qdisc(net, "tbf", "rate", "1gbit", "burst", "256kb", "latency", "100ms"):
        pusher = start_push_and_wait_in_flight(a, ca, "cut", data)
        net.link("down")
        down = time.monotonic()
        try:
            assert pusher.is_alive(), "the push ended before the link went down"
            pusher.join(10)
            assert not pusher.is_alive(), "push still running 10 s after the link went down"
        finally:
            time.sleep(max(0.0, 3.0 - (time.monotonic() - down)))
            net.link("up")
        if pusher.error is not None:
            assert isinstance(pusher.error, kvd.PeerUnavailable), repr(pusher.error)
            assert pusher.finished - down < HEARTBEAT_TIMEOUT + SLACK, pusher.finished - down
            with pytest.raises(kvd.NotFound):
                cb.get("cut", timeout=0)  # nothing partial is visible on B
        else:  # it may also ride out the outage: then it must be exact
            assert torch.equal(cb.get("cut", timeout=5)["x"], data)
        wait_pools_empty(ca, cb)
        assert ca.stats()["entries"] == 0 and cb.stats()["entries"] == 0
        # the link is back: the next transfers work, both ways, bit-exact
        push_and_pull(ca, cb, data[: 8 << 20], "after-cut")
        wait_pools_empty(ca, cb, timeout=3)


def test_partition_frees_a_failed_push_while_the_link_is_still_down(daemons, net):
    a, b = start_pair(daemons, net, [*FAST_HEARTBEAT, "--transfer-timeout", "3s"])
    data = random_bytes(64 << 20, 3)
    # shaped to 400 Mbit/s, the push takes 1.3 s: certain to be under way when the link goes down
    with a.client() as ca, b.client() as cb, qdisc(net, "tbf", "rate", "400mbit", "burst", "256kb", "latency",
                                                   "100ms"):
        pusher = start_push_and_wait_in_flight(a, ca, "partitioned", data)
        net.link("down")
        try:
            assert pusher.is_alive(), "the push ended before the link went down"
            pusher.join(10)
            assert isinstance(pusher.error, kvd.PeerUnavailable), repr(pusher.error)
            # heartbeat loss + transfer timeout + ZMTP's own 5 s heartbeat timeout have all passed by then
            wait_pools_empty(ca, cb, timeout=8)
        finally:
            net.link("up")
            wait_pools_empty(ca, cb, timeout=10)


def test_rate_limited_link_is_slow_but_exact(daemons, net):
    a, b = start_pair(daemons, net, pool_size="128MiB")
    data = random_bytes(16 << 20, 4)
    rate_bits = 100_000_000
    with a.client() as ca, b.client() as cb:
        with qdisc(net, "tbf", "rate", "100mbit", "burst", "64kb", "latency", "200ms"):
            push_s, pull_s = push_and_pull(ca, cb, data, "tbf")
            shaped = qdisc_stats(net)
        floor = data.numel() * 8 / rate_bits * 0.8  # 1.34 s at line rate; at least 80 % of that
        assert push_s >= floor and pull_s >= floor, (push_s, pull_s, floor)
        assert shaped.get("sent_bytes", 0) >= 2 * data.numel(), shaped
        wait_pools_empty(ca, cb, timeout=3)


def test_queue_overflow_drops_are_survived(daemons, net):
    """tbf with a queue of a few packets drops whatever overflows it: TCP retransmits, bytes stay exact."""
    a, b = start_pair(daemons, net, pool_size="128MiB")
    data = random_bytes(24 << 20, 5)
    with a.client() as ca, b.client() as cb:
        with qdisc(net, "tbf", "rate", "400mbit", "burst", "16kb", "limit", "20kb"):
            push_and_pull(ca, cb, data, "drops")
            shaped = qdisc_stats(net)
        assert shaped.get("dropped", 0) > 0, f"no packet was dropped, the case tested nothing: {shaped}"
        wait_pools_empty(ca, cb, timeout=3)


def test_slow_but_healthy_link_is_not_declared_dead(daemons, net):
    """One 4 MiB chunk takes ~2 s at 16 Mbit/s, longer than the 1.5 s heartbeat timeout, and the
    pings wait behind it: the bytes the kernels count moving keep both sides alive."""
    a, b = start_pair(daemons, net, FAST_HEARTBEAT, pool_size="64MiB")
    data = random_bytes(8 << 20, 6)
    with a.client() as ca, b.client() as cb:
        with qdisc(net, "tbf", "rate", "16mbit", "burst", "32kb", "latency", "400ms"):
            ca.put("slow", {"x": data}, dest="B")
        assert torch.equal(cb.get("slow")["x"], data)


NETEM = {
    "loss 5%": ["loss", "5%"],
    "delay 50ms 20ms": ["delay", "50ms", "20ms"],
    "reorder": ["delay", "10ms", "reorder", "25%", "50%"],
    "duplicate 5%": ["duplicate", "5%"],
    "corrupt 1%": ["corrupt", "1%"],
}


@pytest.mark.parametrize("fault", list(NETEM))
def test_netem_faults(daemons, net, fault):
    probe = run("tc", "qdisc", "add", "dev", net.veth_a, "root", "netem", "delay", "1ms", ns=net.ns_a, check=False)
    if probe.returncode != 0:
        pytest.skip(f"netem is not available in this kernel ({probe.stderr.strip()}): cannot emulate {fault}")
    run("tc", "qdisc", "del", "dev", net.veth_a, "root", ns=net.ns_a, check=False)
    a, b = start_pair(daemons, net, pool_size="64MiB")
    data = random_bytes(16 << 20, 7)
    with a.client() as ca, b.client() as cb:
        with qdisc(net, "netem", *NETEM[fault]):
            try:
                push_and_pull(ca, cb, data, "netem")
            except kvd.ChecksumMismatch:
                # a corruption TCP's own checksum missed: kvd must catch it loudly, never deliver it
                assert fault.startswith("corrupt")
        wait_pools_empty(ca, cb, timeout=10)
        push_and_pull(ca, cb, data[: 1 << 20], "after-netem")
        wait_pools_empty(ca, cb, timeout=3)
