"""Bounded under abuse: what one client, peer or scraper can make a daemon hold is capped, and a
daemon answers whatever it accepted. Real daemons; the abuse is done over real sockets."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import subprocess
import sys
import time

import msgpack
import pytest
import torch
import zmq

import kvd
from kvd.client.connection import ask
from kvd.daemon.peer.links import PEER_QUEUE_BYTES, PEER_SNDHWM
from kvd.testing.daemons import eventually, free_port, raw_connection
from kvd.wire import protocol as p
from kvd.wire.endpoints import unix_path
from kvd.wire.framing import MAX_MESSAGE_BYTES


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def rss_anon_mb(pid: int) -> float:
    """The daemon's anonymous resident memory (its heap; the pool's shared pages are not in it)."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon")) / 1024


def served(daemon) -> bool:
    try:
        with daemon.client() as c:
            c.put("still-served", {"x": torch.arange(100)})
            return torch.equal(c.get("still-served")["x"], torch.arange(100))
    except kvd.KvdError:  # (refused while the cap is reached)
        return False


def test_the_open_file_limit_is_raised_and_clients_past_the_cap_are_told_why(daemons):
    import resource

    soft0, hard0 = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard0 != resource.RLIM_INFINITY and hard0 <= 256:
        pytest.skip(f"the hard open-file limit here is {hard0}: nothing to raise to")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard0))  # the daemon starts with a low soft limit
    try:
        d = daemons.start("A", extra=["--max-clients", "20"])
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft0, hard0))
    with open(f"/proc/{d.pid}/limits") as limits:
        soft, hard = next(line.split()[3:5] for line in limits if line.startswith("Max open files"))
    assert soft == hard and soft != "256"  # raised to the hard limit
    idle = [socket.socket(socket.AF_UNIX) for _ in range(20)]
    for s in idle:
        s.connect(unix_path(d.socket))
    extra = raw_connection(d.socket)  # one too many (accepted after the 20: the listen queue keeps order)
    reply = p.decode(extra.receive(5))
    assert isinstance(reply, p.Error) and "--max-clients" in reply.message
    extra.close()
    for s in idle[:5]:
        s.close()
    eventually(lambda: served(d), timeout=5)  # room again once some leave
    for s in idle[5:]:
        s.close()


def test_a_message_begun_and_never_finished_is_cut_and_pins_nothing(daemons):
    # 200 clients each send all but the last byte of a 4 MiB message (800 MiB begun): past the budget
    # of unfinished bytes over all clients (64 MiB) the ones holding the most are cut as the bytes
    # arrive, so the daemon's heap never holds much more than the budget (it peaked at 135-204 MB
    # when the budget was kept only by the housekeeping, 5 times a second); the rest are cut at the
    # deadline (10 s), and then the heap is given back
    d = daemons.start("A")
    before = rss_anon_mb(d.pid)
    size = MAX_MESSAGE_BYTES - 8
    message = memoryview(struct.pack("<II", 1, size) + b"\0" * (size - 1))  # one byte of it never comes
    hangers = [socket.socket(socket.AF_UNIX) for _ in range(200)]
    left = {}
    for s in hangers:
        s.connect(unix_path(d.socket))
        s.setblocking(False)
        left[s] = message
    peak = before
    while left:  # (each send takes what the kernel has room for; a cut connection takes no more)
        for s in list(left):
            try:
                left[s] = left[s][s.send(left[s]):]
            except BlockingIOError:
                pass
            except OSError:  # (cut)
                left[s] = message[:0]
            if not len(left[s]):
                del left[s]
        peak = max(peak, rss_anon_mb(d.pid))
    peak = max(peak, rss_anon_mb(d.pid))
    print(f"heap {before:.0f} MB before, {peak:.0f} MB at the peak ({peak - before:+.0f} MB)")
    assert peak - before < 64 + 24, f"the daemon's heap grew by {peak - before:.0f} MB"
    early = sum(_closed_now(s) for s in hangers)
    assert early >= 200 - 16, early  # at most 16 messages of 4 MiB fit in 64 MiB
    assert "unfinished messages of all clients passed 64 MiB" in d.log()
    assert served(d)  # (a client with whole messages is served meanwhile)
    eventually(lambda: all(_closed_now(s) for s in hangers), timeout=15)  # the others at the deadline
    for s in hangers:
        s.close()
    eventually(lambda: rss_anon_mb(d.pid) - before < 16, timeout=5)  # and what they held went back
    print(f"heap {rss_anon_mb(d.pid):.0f} MB once every one was cut")
    assert "did not finish it within 10s" in d.log()


def test_gets_of_clients_that_hung_up_are_let_go(daemons):
    d = daemons.start("A")
    for i in range(3):
        conn = raw_connection(d.socket)
        conn.send(p.encode(p.Get(req=1, request_id=f"never-{i}", timeout=3600.0)))
        eventually(lambda: ask(p.Stats(req=1), d.socket)["waiting_reads"] == 1)
        conn.close()
        eventually(lambda: ask(p.Stats(req=1), d.socket)["waiting_reads"] == 0)


def test_entries_and_their_meta_are_capped(daemons):
    d = daemons.start("A", extra=["--max-entries", "50"])
    with d.client() as c:
        for i in range(50):
            c.put(f"empty-{i}", {"x": torch.empty(0)}, ttl=0, meta={"i": i})
        with pytest.raises(kvd.PoolFull, match="--max-entries"):
            c.put("one-too-many", {"x": torch.empty(0)})
        for i in range(50):
            c.delete(f"empty-{i}")
        with pytest.raises(kvd.BadRequest, match="meta"):
            c.put("big-meta", {"x": torch.ones(1)}, meta={"blob": ["x" * 1000] * 70})
        c.put("small-meta", {"x": torch.ones(1)}, meta={"blob": "x" * (60 << 10)})
        assert c.get("small-meta", with_meta=True)[1]["blob"] == "x" * (60 << 10)


def test_what_the_daemon_accepts_it_can_answer(daemons):
    d = daemons.start("A")
    conn = raw_connection(d.socket)
    # a header just under the 1 MiB limit: thousands of tensors with long names
    tensors = [[f"{'n' * 200}-{i}", "uint8", [1]] for i in range(4000)]
    conn.send(p.encode(p.PutAlloc(req=1, request_id="huge-header", tensors=tensors)))
    reply = p.decode(conn.receive(10))
    if isinstance(reply, p.PutSlots):  # accepted: then it must be readable
        conn.send(p.encode(p.PutCommit(req=2, request_id="huge-header", token=reply.token)))
        assert isinstance(p.decode(conn.receive(10)), (p.Ok, p.PutOk))
        with d.client() as c:
            assert len(c.get("huge-header", timeout=5)) == 4000
    else:
        assert isinstance(reply, p.Error) and "more than a reply can carry" in reply.message, reply
    conn.close()
    # an id of 64 KiB is refused at once, and kvd status keeps working for everyone
    conn = raw_connection(d.socket)
    conn.send(p.encode(p.Get(req=3, request_id="x" * (64 << 10), timeout=0.0)))
    assert p.decode(conn.receive(5)).code == kvd.BadRequest.code
    conn.close()
    stats = ask(p.Stats(req=1), d.socket)
    assert len(p.encode(p.Ok(req=1, value=stats))[0]) < 64 << 10
    # many entries: list answers a page at a time
    with d.client() as c:
        for i in range(2500):
            c.put(f"e{i:05d}", {"x": torch.empty(0)})
    page = ask(p.ListEntries(req=1), d.socket)
    assert len(page) == 2000 and page[0]["request_id"] == "e00000"
    rest = ask(p.ListEntries(req=1, after=page[-1]["request_id"]), d.socket)
    assert [e["request_id"] for e in rest] == [f"e{i:05d}" for i in range(2000, 2500)]
    # the client, the async client and kvd ls follow the pages to the end
    everything = [f"e{i:05d}" for i in range(2500)]
    with d.client() as c:
        assert [e["request_id"] for e in c.list()] == everything
    assert [e["request_id"] for e in asyncio.run(_list_async(d.socket))] == everything
    listed = subprocess.run([sys.executable, "-m", "kvd", "ls", "--json", "--socket", d.socket],
                            capture_output=True, text=True, timeout=60, check=True)
    assert [e["request_id"] for e in json.loads(listed.stdout)] == everything


async def _list_async(socket: str) -> list[dict]:
    async with kvd.AsyncClient(socket) as c:
        return await c.list()


def test_scrapers_cannot_exhaust_or_stall_the_daemon(daemons):
    port = free_port()
    d = daemons.start("A", extra=["--metrics-port", str(port)])
    before, fds = rss_mb(d.pid), len(os.listdir(f"/proc/{d.pid}/fd"))
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]  # never send a request
    readers = []
    for _ in range(400):  # send a request and never read the answer
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        readers.append(s)
    worst = 0.0
    with d.client() as c:
        for _ in range(50):  # the clients are served meanwhile
            started = time.monotonic()
            c.put("during", {"x": torch.ones(1000)})
            c.get("during")
            worst = max(worst, time.monotonic() - started)
    assert worst < 1.0, worst
    # at most 64 scrapes are served at once; the others are closed at once, not kept
    assert len(os.listdir(f"/proc/{d.pid}/fd")) - fds < 64 + 16
    # the head and write deadlines (2 s and 5 s from each one's accept): every one of them is gone
    eventually(lambda: len(os.listdir(f"/proc/{d.pid}/fd")) - fds < 16, timeout=20)
    for s in silent + readers:
        s.close()
    assert rss_mb(d.pid) - before < 64
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 200")


def test_peer_connections_are_capped_and_silent_ones_cut(daemons):
    a = daemons.start("A", extra=["--max-peer-connections", "8", "--connect-timeout", "1s"])
    host, port = a.listen.removeprefix("tcp://").rsplit(":", 1)
    idle = [socket.create_connection((host, int(port))) for _ in range(30)]  # TCP only: no hello, ever
    gone: set[socket.socket] = set()

    def all_gone() -> bool:  # past the cap at once, the rest at connect_timeout (1 s)
        gone.update(s for s in idle if s not in gone and _ended(s))
        return len(gone) == len(idle)

    eventually(all_gone, timeout=10)
    for s in idle:
        s.close()
    log = a.log()
    assert "more than 8 peer connections (--max-peer-connections)" in log  # the ones past the cap, at once
    assert "no peer_hello within 1s" in log  # the others, at the hello deadline
    b = daemons.start("B", peers={"A": a.listen})
    with b.client() as cb, a.client() as ca:  # a real peer is served
        cb.put("through", {"x": torch.arange(1000)}, dest="A")
        assert torch.equal(ca.get("through")["x"], torch.arange(1000))


def test_a_peer_that_never_reads_its_replies_is_cut(daemons):
    # Pongs are 20 bytes on the wire, and the kernel takes megabytes of them into the connection's
    # send buffer (autotuned up to tcp_wmem's maximum) before ZeroMQ queues any: only then do they
    # fill ZeroMQ's queue (PEER_SNDHWM messages) and the next send fails, which cuts the peer. So the
    # flood is sized by the most that buffer can hold, and the peer stays alive meanwhile: its
    # ZeroMQ pings the daemon's, which would otherwise drop a connection it hears nothing from for
    # 5 s (ZMTP heartbeat) while it is still working through the flood: "disconnected", no cut.
    a = daemons.start("A")
    sock = raw_peer(a, {zmq.RCVHWM: 1, zmq.RCVBUF: 4096,  # it reads nothing: keep its queue small
                        zmq.HEARTBEAT_IVL: 200, zmq.HEARTBEAT_TIMEOUT: 600_000})
    sock.send_multipart(p.encode(p.PeerHello(node_id="deaf", incarnation=1)))
    pong = len(p.encode(p.Pong(nonce=1 << 40))[0]) + 2  # (ZMTP frames a short frame in 2 bytes)
    pings = most_a_send_buffer_holds() // pong + 2 * PEER_SNDHWM
    before = rss_mb(a.pid)
    for i in range(pings):  # pings whose pongs are never read
        sock.send_multipart(p.encode(p.Ping(nonce=(1 << 40) + i)))
    eventually(lambda: "does not read what we send (its queue is full)" in a.log(), timeout=30 + pings / 5000)
    assert rss_mb(a.pid) - before < 100
    eventually(lambda: "deaf (connected to us) disconnected" in a.log(), timeout=5)
    sock.close()
    assert served(a)


def test_a_peer_that_pulls_and_never_reads_is_cut_at_the_byte_cap(daemons):
    # what a peer makes a daemon queue for it is capped in bytes (PEER_QUEUE_BYTES), not only in
    # messages: 200 pulls of a 768 KiB entry are 150 MiB of copies (frames under 1 MiB are copied
    # into ZeroMQ), far below the 10,000 messages ZeroMQ would queue
    a = daemons.start("A")
    with a.client() as c:
        c.put("wanted", {"x": torch.ones(768 << 10, dtype=torch.uint8)})
    sock = raw_peer(a, {zmq.RCVHWM: 1, zmq.RCVBUF: 4096})
    sock.send_multipart(p.encode(p.PeerHello(node_id="greedy", incarnation=1)))
    before = rss_mb(a.pid)
    for i in range(200):
        sock.send_multipart(p.encode(p.Pull(xfer=i + 1, request_id="wanted", timeout=5.0, keep=True)))
    eventually(lambda: "greedy does not read what we send" in a.log(), timeout=20)
    assert rss_mb(a.pid) - before < PEER_QUEUE_BYTES / (1 << 20) + 32
    line = next(line for line in a.log().splitlines() if "greedy does not read what we send" in line)
    assert f"more than the {PEER_QUEUE_BYTES >> 20} MiB a connection may have" in line, line
    # its transfers fail as for a lost peer, and leave nothing behind
    eventually(lambda: "greedy (connected to us) disconnected" in a.log(), timeout=5)
    eventually(lambda: ask(p.Stats(req=1), a.socket)["transfers_in_flight"] == 0, timeout=10)
    sock.close()
    assert served(a)
    with a.client() as c:
        assert c.get("wanted", timeout=5)["x"].sum() == 768 << 10  # (the pulls kept it)


def test_a_peer_cannot_make_the_daemon_echo_what_it_sent(daemons):
    # an undecodable message is answered with an abort saying why, and the why can quote the message
    # (here a type name of 60 KB): the abort's text is cut, so 3,000 of them queued for a peer that
    # never reads hold kilobytes each at most, not 180 MB
    port = free_port()
    a = daemons.start("A", extra=["--metrics-port", str(port)])
    deaf = raw_peer(a, {zmq.RCVHWM: 1, zmq.RCVBUF: 4096})
    deaf.send_multipart(p.encode(p.PeerHello(node_id="deaf", incarnation=1)))
    bad = [msgpack.packb({"v": p.PROTOCOL_VERSION, "t": "x" * 60_000})]
    eventually(lambda: undecodable(port) == 0 and "deaf (incarnation 1) connected to us" in a.log())
    before = rss_mb(a.pid)
    for sent in range(100, 3001, 100):  # (paced by the daemon: what is measured is what it sends back)
        for _ in range(100):
            deaf.send_multipart(bad)
        eventually(lambda: undecodable(port) >= sent, timeout=20)
    assert rss_mb(a.pid) - before < 64
    reader = raw_peer(a)
    reader.send_multipart(bad)
    assert reader.poll(5000)
    abort = p.decode(reader.recv_multipart())
    assert isinstance(abort, p.Abort) and abort.message.startswith("unknown message type 'xxx")
    assert len(abort.message) <= 512 and "(60023 characters)" in abort.message, abort.message[-60:]
    reader.close()
    deaf.close()
    assert served(a)


def test_a_flood_of_undecodable_peer_messages_is_counted_not_logged_one_by_one(daemons):
    port = free_port()
    a = daemons.start("A", extra=["--metrics-port", str(port)])
    sock = raw_peer(a)
    sock.send_multipart(p.encode(p.PeerHello(node_id="noisy", incarnation=1)))
    for i in range(2000):
        sock.send_multipart([b"\xc1 not msgpack %d" % i])
    answers = 0
    while answers < 2001 and sock.poll(5000):  # hello_ok, then an abort for each
        sock.recv_multipart()
        answers += 1
    sock.close()
    assert answers == 2001
    lines = [line for line in a.log().splitlines() if "undecodable message on the peer socket" in line]
    assert len(lines) == 1, lines[:3]  # at most one per 10 s; the rest are counted
    page = metrics_page(port)
    assert 'kvd_undecodable_messages_total{socket="peer"} 2000.0' in page


def test_a_peer_cannot_grow_metrics_by_claiming_names(daemons):
    port = free_port()
    a = daemons.start("A", extra=["--metrics-port", str(port)])
    sock = raw_peer(a)
    for i in range(600):  # a new name each time, and a zero-byte transfer under it
        sock.send_multipart(p.encode(p.PeerHello(node_id=f"n{i}", incarnation=i)))
        sock.send_multipart(p.encode(p.Offer(xfer=i + 1, request_id=f"z{i}", tensors=[["x", "uint8", [0]]],
                                             total_bytes=0, chunk_size=1 << 20, checksum="none")))
    eventually(lambda: ask(p.Stats(req=1), a.socket)["entries"] == 600, timeout=20)
    sock.close()
    page = metrics_page(port)
    peers = {line.split('peer="')[1].split('"')[0] for line in page.splitlines()
             if line.startswith("kvd_transfers_total{")}
    assert len(peers) <= 257 and "other" in peers


def test_a_second_daemon_on_the_same_ports_says_which_flag_to_change(daemons):
    metrics = free_port()
    a = daemons.start("A", extra=["--metrics-port", str(metrics)])
    second = daemons.start("B", extra=["--metrics-port", str(metrics)], wait=False)
    assert second.proc.wait(20) != 0
    assert "--metrics-port" in second.log()
    clash = daemons.start("C", port=int(a.listen.rsplit(":", 1)[1]), wait=False)
    assert clash.proc.wait(20) != 0
    assert "choose another port for --listen" in clash.log()


def _ended(sock: socket.socket) -> bool:
    """The daemon closed this connection, once what it sent first is read (ZeroMQ's greeting)."""
    try:
        while sock.recv(4096, socket.MSG_DONTWAIT):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except BlockingIOError:
        return False


def _closed_now(sock: socket.socket) -> bool:
    """The daemon closed this connection (checked without blocking or consuming anything)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except BlockingIOError:
        return False


def most_a_send_buffer_holds() -> int:
    """The most bytes the kernel queues for sending on a TCP connection whose buffer it sizes itself
    (tcp_wmem's maximum; 4 MiB by default)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_wmem") as wmem:
            return int(wmem.read().split()[2])
    except (OSError, IndexError, ValueError):
        return 4 << 20


def undecodable(metrics_port: int) -> float:
    """kvd_undecodable_messages_total of the peer socket, from the metrics page (0 before the first)."""
    prefix = 'kvd_undecodable_messages_total{socket="peer"} '
    return next((float(line[len(prefix):]) for line in metrics_page(metrics_port).splitlines()
                 if line.startswith(prefix)), 0.0)


def raw_peer(daemon, options: dict | None = None) -> zmq.Socket:
    """A bare DEALER on the daemon's peer port (it says what the test makes it say); `options` are
    socket options, set before it connects."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for option, value in (options or {}).items():
        sock.setsockopt(option, value)
    sock.connect(daemon.listen)
    return sock


def metrics_page(port: int) -> str:
    import urllib.request

    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
