"""What peers that never read can make a daemon hold: the bytes ZeroMQ holds for them are capped per
connection, over all connections, and in time, on our ROUTER and on our own links alike; a peer
past a bound is cut, and the others are served. Real daemons; the deaf peers are raw ZeroMQ
sockets in a process of their own (libzmq may abort a process whose socket is cut under it)."""
from __future__ import annotations

import subprocess
import sys
import time

import torch

from kvd.client.connection import ask
from kvd.daemon.peer.owed import PEER_QUEUE_BYTES, PEER_QUEUE_TOTAL
from kvd.testing.daemons import eventually, free_port
from kvd.wire import protocol as p

ENTRY_BYTES = 768 << 10  # under 1 MiB: each reply is copied into ZeroMQ (the pool lends bigger ones)

# K DEALERs that say hello and ask for `pulls` copies each of the daemon's entries, reading nothing
# (with `ping`, each also pings every 0.2 s: it looks alive to the daemon)
DEAF = """
import sys, time, zmq
from kvd.wire import protocol as p
endpoint, conns, pulls, ping = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "ping"
ctx = zmq.Context()
socks = []
for k in range(conns):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 1)
    s.connect(endpoint)
    s.send_multipart(p.encode(p.PeerHello(node_id=f"deaf{k}", incarnation=1)))
    socks.append(s)
for i in range(pulls):
    for k, s in enumerate(socks):
        s.send_multipart(p.encode(p.Pull(xfer=k * 100_000 + i + 1, request_id=f"wanted{(i + k) % 8}", timeout=60.0,
                                         keep=True)))
print("asked", flush=True)
for n in range(1000):
    if ping:
        for s in socks:
            s.send_multipart(p.encode(p.Ping(nonce=n)))
    time.sleep(0.2)
"""

# a peer the daemon dials: it answers the daemon's hello, then sends pulls on the daemon's own link
FAKE = """
import sys, time, zmq
from kvd.wire import protocol as p
port, pulls = int(sys.argv[1]), int(sys.argv[2])
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
sock.setsockopt(zmq.LINGER, 0)
sock.setsockopt(zmq.RCVHWM, 1)
sock.bind(f"tcp://127.0.0.1:{port}")
rid, *_ = sock.recv_multipart()
sock.send_multipart([rid, *p.encode(p.PeerHelloOk(node_id="deaf", incarnation=1, features=list(p.FEATURES)))])
print("answered", flush=True)
sys.stdin.readline()
for i in range(pulls):
    sock.send_multipart([rid, *p.encode(p.Pull(xfer=i + 1, request_id=f"wanted{i % 8}", timeout=60.0, keep=True))])
print("asked", flush=True)
time.sleep(600)
"""


def rss_anon_mb(pid: int) -> float:
    """The daemon's anonymous resident memory (its heap; the pool's shared pages are not in it)."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon")) / 1024


def holding(daemon, pool: str = "1GiB", peers: dict | None = None):
    """A daemon with 8 entries of ENTRY_BYTES to pull."""
    d = daemon.start("A", pool_size=pool, peers=peers, extra=["--max-peer-connections", "256"])
    with d.client() as c:
        for e in range(8):
            c.put(f"wanted{e}", {"x": torch.full((ENTRY_BYTES,), e, dtype=torch.uint8)})
    return d


def watch_peak(daemon, until, timeout: float) -> float:
    """The daemon's largest heap (RssAnon, MB) seen until until() holds (sampled every 10 ms)."""
    peak, deadline = 0.0, time.monotonic() + timeout
    while not until():
        peak = max(peak, rss_anon_mb(daemon.pid))
        assert time.monotonic() < deadline, f"not cut in time (heap peaked at {peak:.0f} MB)"
        time.sleep(0.01)
    return max(peak, rss_anon_mb(daemon.pid))


def served(a, b) -> None:
    """A well-behaved peer still pulls from a."""
    with b.client() as cb:
        assert cb.get("wanted3", source="A", keep=True, timeout=20)["x"][0] == 3


def deaf(endpoint: str, conns: int, pulls: int, ping: bool = False) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", DEAF, endpoint, str(conns), str(pulls), "ping" if ping else "-"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc


def test_many_deaf_peers_are_bounded_together(daemons):
    # 12 connections each ask for 60 MiB of copies (each under the 64 MiB a connection may have):
    # 720 MiB in all. Before, every byte of it was held for as long as they kept their connections
    # open; now what all of them are owed is capped (PEER_QUEUE_TOTAL), the ones owed the most cut
    port = free_port()
    a = holding(daemons)
    b = daemons.start("B", port=port, peers={"A": a.listen})
    before = rss_anon_mb(a.pid)
    flood = deaf(a.listen, 12, 80)
    try:
        peak = watch_peak(a, lambda: "when what is queued for all peers passed" in a.log(), timeout=25)
        print(f"heap {before:.0f} MB before, +{peak - before:.0f} MB at the peak (bound {PEER_QUEUE_TOTAL >> 20} MiB)")
        assert peak - before < (PEER_QUEUE_TOTAL >> 20) + 64, f"the daemon's heap grew by {peak - before:.0f} MB"
        served(a, b)
    finally:
        flood.kill()
        flood.wait()
    eventually(lambda: rss_anon_mb(a.pid) - before < 32, timeout=15)  # all of it went back


def test_a_deaf_peer_under_the_cap_that_keeps_its_connection_alive_is_cut_in_time(daemons):
    # it pings every 0.2 s (so it is never silent), and its 45 MiB stay under the cap: before, they
    # were held for good; now a connection whose queue the kernel takes nothing of for
    # --heartbeat-timeout (5 s) is cut
    a = holding(daemons)
    before = rss_anon_mb(a.pid)
    flood = deaf(a.listen, 1, 60, ping=True)
    try:
        assert flood.stdout.readline().startswith("asked")
        started = time.monotonic()
        eventually(lambda: "none of it taken for" in a.log(), timeout=20)
        took = time.monotonic() - started
        line = next(line for line in a.log().splitlines() if "none of it taken for" in line)
        assert "peer deaf0 does not read what we send" in line, line
        assert took < 12, took
        eventually(lambda: rss_anon_mb(a.pid) - before < 16, timeout=10)
        assert ask(p.Stats(req=1), a.socket)["transfers_in_flight"] == 0
    finally:
        flood.kill()
        flood.wait()


def test_a_peer_we_dial_that_never_reads_is_cut_at_the_byte_cap(daemons):
    # the peer is one A dialled (a configured peer): it sends pulls on A's own link and reads
    # nothing. Before, A's link queued all 225 MiB of replies for it (ZeroMQ caps messages, not
    # bytes) and held them; now the link is capped as a connection to A's ROUTER is
    port = free_port()
    fake = subprocess.Popen([sys.executable, "-c", FAKE, str(port), "300"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        a = holding(daemons, peers={"deaf": f"tcp://127.0.0.1:{port}"})
        assert fake.stdout.readline().startswith("answered")
        before = rss_anon_mb(a.pid)
        fake.stdin.write("go\n")
        fake.stdin.flush()
        peak = watch_peak(a, lambda: "deaf does not read what we send" in a.log(), timeout=25)
        print(f"heap {before:.0f} MB before, +{peak - before:.0f} MB at the peak")
        line = next(line for line in a.log().splitlines() if "deaf does not read what we send" in line)
        assert f"more than the {PEER_QUEUE_BYTES >> 20} MiB a connection may have" in line, line
        assert peak - before < (PEER_QUEUE_BYTES >> 20) + 48
        eventually(lambda: rss_anon_mb(a.pid) - before < 16, timeout=10)
        eventually(lambda: ask(p.Stats(req=1), a.socket)["transfers_in_flight"] == 0, timeout=10)
    finally:
        fake.kill()
        fake.wait()
