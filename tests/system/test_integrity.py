"""Intact or not at all, against a hostile or merely slow counterpart: one request's bytes never
reach another request or another user, and nothing a client or peer does kills the daemon.

Each test plays the part the attacker (or the slow worker) would: a stream that outlives its
lease, a reader that copies slowly, a puller that stops reading or says `done` early, a
connection that guesses another's token, a client that truncates the pool, another user on
the host. All of them run against real daemons over real sockets.
"""
from __future__ import annotations

import math
import os
import subprocess
import time

import pytest
import torch
import zmq

import kvd
from kvd.testing.daemons import eventually, raw_connection
from kvd.wire import protocol as p
from kvd.wire.checksum import digest

BOTH_PLANES = True  # (tests/system/conftest.py: each test on ZeroMQ frames and on NIXL)


class RawPeer:
    """A bare ZeroMQ DEALER on a daemon's peer port that reads only when told to (a small
    receive queue and socket buffer, so what it does not read stays with the daemon)."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 1)
        self.sock.setsockopt(zmq.RCVBUF, 4096)
        self.sock.connect(endpoint)

    def send(self, msg: p.Message) -> None:
        self.sock.send_multipart(p.encode(msg))

    def recv(self, timeout: float = 5.0) -> p.Message | None:
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return p.decode(self.sock.recv_multipart())

    def hello(self) -> None:
        self.send(p.PeerHello(node_id="raw", incarnation=7))
        assert isinstance(self.recv(), p.PeerHelloOk)

    def drain(self, timeout: float = 3.0) -> list[p.Message]:
        """Everything that arrives until timeout passes in silence."""
        got = []
        while (msg := self.recv(timeout)) is not None:
            got.append(msg)
        return got

    def close(self) -> None:
        self.sock.close()


def filled(nbytes: int, value: int) -> torch.Tensor:
    return torch.full((nbytes,), value, dtype=torch.uint8)


def listed(client) -> set[str]:
    return {e["request_id"] for e in client.list()}


def pool_used(client) -> int:
    return client.stats()["pool"]["used_bytes"]


def assert_only(chunks: list[p.Message], value: int) -> None:
    """Every chunk payload holds `value` only, and matches its checksum."""
    for chunk in chunks:
        if not isinstance(chunk, p.Chunk):
            continue
        data = b"".join(bytes(f) for f in chunk.payload)
        assert data.count(value) == len(data), f"chunk {chunk.seq} carries another request's bytes"
        assert digest("xxh3_64", chunk.payload) == chunk.digest


# --- 1. a stream whose lease runs out ------------------------------------------------------------------

STREAM_LAYOUT = {f"layer.{i}": ((256 << 10,), torch.uint8) for i in range(4)}  # 1 MiB in all


def test_an_expired_stream_never_writes_into_another_requests_blocks(daemons):
    """The stream's lease runs out between two layers; the victim put that follows must never be
    overwritten by the stream's later writes, and the writer learns at its next write why."""
    d = daemons.start("A", pool_size="1MiB", extra=["--lease-timeout", "1s"])
    with d.client() as writer, d.client() as other:
        stream = writer.put_stream("long-prefill", STREAM_LAYOUT)
        stream.write({"layer.0": filled(256 << 10, 1)})
        # a slow layer: the lease runs out (the entry goes at the first sweep past 1 s)
        eventually(lambda: "long-prefill" not in listed(other), timeout=10)
        # its blocks are parked while the writer may still write: a put that needs them waits its turn
        with pytest.raises(kvd.PoolFull):
            other.put("victim", {"x": filled(1 << 20, 7)})
        with pytest.raises(kvd.Timeout, match=r"lease expired after 1 s without a write \(--lease-timeout\)"):
            stream.write({"layer.1": filled(256 << 10, 255)})
        with pytest.raises(kvd.KvdError):
            stream.commit()  # the stream is over
        # the writer has let go: now the blocks are free again, and the victim's bytes stay its own
        eventually(lambda: pool_used(other) == 0)
        other.put("victim", {"x": filled(1 << 20, 7)})
        with pytest.raises(kvd.KvdError):
            stream.write({"layer.2": filled(256 << 10, 255)})
        assert torch.equal(other.get("victim")["x"], filled(1 << 20, 7))
        with pytest.raises(kvd.NotFound):
            other.get("long-prefill", timeout=0)


def test_an_expired_stream_keeps_its_blocks_until_its_connection_closes(daemons):
    """A writer that never writes again (stuck, or gone quiet) holds its parked blocks only as long
    as its connection is open: a raw client without the library's checks writes and commits late."""
    d = daemons.start("A", pool_size="1MiB", extra=["--lease-timeout", "1s"])
    conn = raw_connection(d.socket)
    conn.send(p.encode(p.PutAlloc(req=1, request_id="stuck", tensors=[["x", "uint8", [1 << 20]]], stream=True)))
    slots = p.decode(conn.receive(5))
    notice = p.decode(conn.receive(3))  # the lease ran out: the daemon says so on the put's own req
    assert isinstance(notice, p.Error) and notice.req == 1 and notice.code == kvd.Timeout.code, notice
    assert "lease expired after 1 s without a write" in notice.message
    with d.client() as other:
        assert other.stats()["pool"]["parked_bytes"] == 1 << 20
        with pytest.raises(kvd.PoolFull):
            other.put("victim", {"x": filled(1 << 20, 7)})
        conn.send(p.encode(p.PutCommit(req=2, request_id="stuck", token=slots.token)))
        reply = p.decode(conn.receive(5))
        assert isinstance(reply, p.Error) and "lease expired after 1 s" in reply.message, reply
        # a commit comes after every write: the blocks are free from here on
        eventually(lambda: pool_used(other) == 0 and other.stats()["pool"]["parked_bytes"] == 0)
        other.put("victim", {"x": filled(1 << 20, 7)})
        assert torch.equal(other.get("victim")["x"], filled(1 << 20, 7))
    conn.close()

    conn = raw_connection(d.socket)  # and a writer that just goes away gives them back at once
    conn.send(p.encode(p.PutAlloc(req=1, request_id="gone", tensors=[["x", "uint8", [1 << 20]]], stream=True)))
    p.decode(conn.receive(5))
    assert isinstance(p.decode(conn.receive(3)), p.Error)
    conn.close()
    with d.client() as other:
        eventually(lambda: other.stats()["pool"]["parked_bytes"] == 0)
        assert pool_used(other) == 0


def test_a_stream_that_keeps_writing_outlives_the_lease_timeout(daemons):
    a, b = daemons.pair(extra=["--lease-timeout", "1s"])
    layout = {f"layer.{i}": ((4096,), torch.float32) for i in range(8)}
    with a.client() as ca, b.client() as cb:
        for dest in (None, "B"):
            with ca.put_stream(f"steady-{dest}", layout, dest=dest) as stream:
                for i in range(8):  # 2.4 s in all, a write every 0.3 s
                    time.sleep(0.3)
                    stream.write({f"layer.{i}": torch.full((4096,), float(i))})
            kv = (cb if dest else ca).get(f"steady-{dest}")
            assert all(torch.equal(kv[f"layer.{i}"], torch.full((4096,), float(i))) for i in range(8))


def test_a_plain_put_whose_copy_outlives_its_lease_says_why(daemons):
    d = daemons.start("A", extra=["--lease-timeout", "1s"])
    conn = raw_connection(d.socket)
    conn.send(p.encode(p.PutAlloc(req=1, request_id="slow-copy", tensors=[["x", "uint8", [4096]]])))
    slots = p.decode(conn.receive(5))
    notice = p.decode(conn.receive(10))  # the lease ran out: the daemon says so on the put's own req
    assert isinstance(notice, p.Error) and notice.req == 1, notice
    conn.send(p.encode(p.PutCommit(req=2, request_id="slow-copy", token=slots.token)))
    replies = [notice, p.decode(conn.receive(5))]
    commit = next(r for r in replies if r.req == 2)
    assert isinstance(commit, p.Error) and commit.code == kvd.Timeout.code
    assert "not committed within 1 s of its reservation (--lease-timeout)" in commit.message, commit.message
    conn.close()


def test_an_abort_after_expiry_never_deletes_a_new_entry_of_the_same_id(daemons):
    """The stream expired, another client put the same request id: the old writer's abort names
    its own reservation, so the new entry survives."""
    d = daemons.start("A", extra=["--lease-timeout", "1s"])
    with d.client() as writer, d.client() as other:
        stream = writer.put_stream("reused-id", STREAM_LAYOUT)
        eventually(lambda: "reused-id" not in listed(other), timeout=10)  # expired after 1 s
        other.put("reused-id", {"x": filled(4096, 3)})
        stream.abort()
        assert torch.equal(other.get("reused-id", timeout=1)["x"], filled(4096, 3))


# --- 1b. a read lease that runs out while its reader still copies ---------------------------------------

def test_a_slow_reader_never_reads_another_requests_bytes(daemons):
    d = daemons.start("A", pool_size="8MiB", extra=["--lease-timeout", "1s"])
    with d.client() as c:
        c.put("read-slowly", {"x": filled(4 << 20, 0x11)})
        conn = raw_connection(d.socket)
        conn.send(p.encode(p.Hello(req=1, client="slow")))
        hello = p.decode(conn.receive(5))
        conn.send(p.encode(p.Get(req=2, request_id="read-slowly", timeout=1.0)))
        slots = p.decode(conn.receive(5))
        assert isinstance(slots, p.GetSlots)
        time.sleep(1.6)  # the reader's lease runs out: the entry is given back
        assert torch.equal(c.get("read-slowly", timeout=2)["x"], filled(4 << 20, 0x11))  # consumed
        c.put("victim", {"x": filled(4 << 20, 0x77)})  # would take the same blocks, were they free
        fd = os.open(hello.pool_path, os.O_RDONLY)
        try:
            seen = b"".join(os.pread(fd, n, off) for off, n in slots.segments[0])
        finally:
            os.close(fd)
        assert seen.count(0x11) == len(seen) == 4 << 20, "the slow reader's slots hold another request's bytes"
        conn.send(p.encode(p.GetDone(req=3, request_id="read-slowly", token=slots.token, consume=True)))
        conn.close()
        assert torch.equal(c.get("victim")["x"], filled(4 << 20, 0x77))
        eventually(lambda: pool_used(c) == 0)


# --- 2. pullers that stop reading or say done early --------------------------------------------------

@pytest.mark.frames_only  # (a raw ZeroMQ peer: a NIXL daemon refuses it)
def test_a_stalled_puller_never_receives_another_requests_bytes(daemons):
    a = daemons.start("A", pool_size="64MiB", extra=["--transfer-timeout", "1s"])
    with a.client() as c:
        c.put("pulled", {"x": filled(32 << 20, 0x11)})
        peer = RawPeer(a.listen)
        peer.hello()
        peer.send(p.Pull(xfer=41, request_id="pulled", timeout=5.0))
        assert isinstance(peer.recv(), p.Offer)
        peer.send(p.Accept(xfer=41))  # the whole window comes; then the puller stops reading
        # the pull fails for want of acks; the entry is still A's, intact, and a local reader takes it
        assert torch.equal(c.get("pulled", timeout=10)["x"], filled(32 << 20, 0x11))
        c.put("victim", {"x": filled(32 << 20, 0x77)})
        assert_only(peer.drain(), 0x11)  # the puller reads on: never the victim's bytes
        assert torch.equal(c.get("victim")["x"], filled(32 << 20, 0x77))
        peer.close()
        eventually(lambda: pool_used(c) == 0, timeout=10)


@pytest.mark.frames_only  # (a raw ZeroMQ peer: a NIXL daemon refuses it)
def test_a_puller_that_says_done_early_never_receives_another_requests_bytes(daemons):
    a = daemons.start("A", pool_size="64MiB", extra=["--chunk-size", "16MiB"])
    with a.client() as c:
        c.put("pulled", {"x": filled(32 << 20, 0x11)})  # two chunks: both go without waiting
        peer = RawPeer(a.listen)
        peer.hello()
        peer.send(p.Pull(xfer=42, request_id="pulled", timeout=5.0))
        assert isinstance(peer.recv(), p.Offer)
        peer.send(p.Done(xfer=42))  # before reading a byte
        # taken: the entry is gone, its blocks parked while ZeroMQ still holds the unread chunks
        eventually(lambda: c.stats()["pool"]["parked_bytes"] == 32 << 20)
        c.put("victim", {"x": filled(32 << 20, 0x77)})
        assert_only(peer.drain(), 0x11)
        assert torch.equal(c.get("victim")["x"], filled(32 << 20, 0x77))
        peer.close()
        eventually(lambda: pool_used(c) == 0, timeout=10)



@pytest.mark.frames_only  # (a raw ZeroMQ peer: a NIXL daemon refuses it)
def test_a_get_waiting_behind_a_failed_pull_has_the_entry_at_once(daemons):
    # a pull without keep claims the entry; when it fails, the entry is the holder's again, and a
    # local get parked on it meanwhile must have it then, not at the end of its own timeout
    import threading

    a = daemons.start("A", pool_size="64MiB")
    with a.client() as c, a.client() as waiter:
        c.put("pulled", {"x": filled(4 << 20, 0x11)})
        peer = RawPeer(a.listen)
        peer.hello()
        peer.send(p.Pull(xfer=43, request_id="pulled", timeout=5.0))
        assert isinstance(peer.recv(), p.Offer)  # served: the entry is claimed by the pull
        got: dict = {}

        def get() -> None:
            started = time.monotonic()
            got["x"] = waiter.get("pulled", timeout=30)["x"]
            got["seconds"] = time.monotonic() - started

        thread = threading.Thread(target=get)
        thread.start()
        eventually(lambda: c.stats()["waiting_reads"] == 1)  # the get is parked behind the claim
        assert "x" not in got
        aborted = time.monotonic()
        peer.send(p.Abort(xfer=43, code=1, message="the puller gives up"))
        thread.join(35)
        assert torch.equal(got["x"], filled(4 << 20, 0x11))
        assert time.monotonic() - aborted < 5, f"the get waited {got['seconds']:.1f}s for an entry back at once"
        peer.close()
        eventually(lambda: pool_used(c) == 0, timeout=10)

# --- 2b. another connection, another user -----------------------------------------------------------------

def test_another_connection_cannot_commit_a_put_it_did_not_reserve(daemons):
    d = daemons.start("A")
    owner, thief = raw_connection(d.socket), raw_connection(d.socket)
    owner.send(p.encode(p.PutAlloc(req=1, request_id="half-written", tensors=[["x", "uint8", [8 << 20]]],
                                   stream=True)))
    slots = p.decode(owner.receive(5))
    for msg in (p.PutPart(req=1, request_id="half-written", token=slots.token, tensors=[0]),
                p.PutCommit(req=2, request_id="half-written", token=slots.token)):
        thief.send(p.encode(msg))
    reply = p.decode(thief.receive(5))
    assert isinstance(reply, p.Error) and reply.code == kvd.NotFound.code, reply
    assert "not held by this connection" in reply.message
    with d.client() as c, pytest.raises(kvd.NotFound):
        c.get("half-written", timeout=0)
    owner.send(p.encode(p.PutCommit(req=2, request_id="half-written", token=slots.token)))
    assert isinstance(p.decode(owner.receive(5)), (p.Ok, p.PutOk))
    owner.close()
    thief.close()


def _intrude(endpoint: str, uid: int, report) -> None:
    """In a forked child: become another user, then try to pull a cache through the peer port."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    sock = zmq.Context().socket(zmq.DEALER)  # a fresh context: the parent's does not survive fork
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart(p.encode(p.PeerHello(node_id="intruder", incarnation=1)))
    sock.send_multipart(p.encode(p.Pull(xfer=5, request_id="private", timeout=1.0)))
    lines = []
    while sock.poll(3000):
        msg = p.decode(sock.recv_multipart())
        lines.append(f"{msg.TYPE} {getattr(msg, 'code', '')} {getattr(msg, 'message', '')}")
    report.send(lines)
    sock.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_another_user_on_this_host_cannot_pull_through_loopback(daemons):
    import multiprocessing as mp

    a = daemons.start("A")
    with a.client() as c:
        c.put("private", {"prompt": torch.arange(1000)})
        ctx = mp.get_context("fork")
        ours, theirs = ctx.Pipe()
        intruder = ctx.Process(target=_intrude, args=(a.listen, 65534, theirs))
        intruder.start()
        assert ours.poll(30), "the intruder reported nothing"
        lines = ours.recv()
        intruder.join(10)
        assert lines and all(line.startswith("abort") for line in lines), lines
        assert f"abort {kvd.Unauthorized.code}" in lines[0] and "uid 65534" in lines[0], lines
        assert torch.equal(c.get("private", timeout=0)["prompt"], torch.arange(1000))
    assert "refused a peer connection from another user" in a.log()


# --- 3. what could kill the daemon: SIGBUS ---------------------------------------------------------

def test_a_client_cannot_truncate_the_pool(daemons):
    a, b = daemons.pair()
    with a.client() as ca, b.client() as cb:
        fd = os.open(ca.info.pool_path, os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 2 * ca.info.pool_size)
        finally:
            os.close(fd)
        ca.put("after-truncate", {"x": torch.arange(1 << 20)}, dest="B")
        assert torch.equal(cb.get("after-truncate")["x"], torch.arange(1 << 20))


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_pool_file_on_a_tmpfs_too_small_fails_at_start(daemons, small_tmpfs):
    for prefault in ([], ["--no-prefault"]):
        daemon = daemons.start("A", pool_size="64MiB", wait=False,
                               extra=["--pool-path", str(small_tmpfs / "pool"), *prefault])
        assert daemon.proc.wait(20) != 0
        assert "cannot hold the 64.0MiB pool" in daemon.log(), daemon.log()
        assert not (small_tmpfs / "pool").exists()


# --- 4. transfer ids used twice, impossible timeouts ---------------------------------------------------

@pytest.mark.frames_only  # (a raw ZeroMQ peer: a NIXL daemon refuses it)
def test_two_pulls_under_one_transfer_id_leave_nothing_pinned(daemons):
    a = daemons.start("A")
    with a.client() as c:
        c.put("twice", {"x": filled(4096, 5)})
        peer = RawPeer(a.listen)
        peer.hello()
        peer.send(p.Pull(xfer=77, request_id="twice", timeout=2.0, keep=True))
        peer.send(p.Pull(xfer=77, request_id="twice", timeout=2.0))
        got = peer.drain(1.0)
        # a transfer id used twice on one connection ends that transfer: never two under one id
        assert any(isinstance(m, p.Abort) and "in use" in m.message for m in got), got
        assert sum(isinstance(m, p.Offer) for m in got) <= 1, got
        peer.send(p.Done(xfer=77))  # (for a transfer that went on anyway)
        assert torch.equal(c.get("twice", timeout=5)["x"], filled(4096, 5))  # the keep pull left it
        eventually(lambda: pool_used(c) == 0)
        peer.close()


@pytest.mark.frames_only  # (a raw ZeroMQ peer: a NIXL daemon refuses it)
def test_an_offer_and_a_pull_under_one_transfer_id_leave_no_half_entry(daemons):
    a = daemons.start("A", extra=["--transfer-timeout", "1s"])
    with a.client() as c:
        c.put("other", {"x": filled(4096, 5)})
        peer = RawPeer(a.listen)
        peer.hello()
        peer.send(p.Offer(xfer=78, request_id="half", tensors=[["x", "uint8", [4 << 20]]], total_bytes=4 << 20,
                          chunk_size=1 << 20, checksum="none"))
        peer.send(p.Chunk(xfer=78, seq=0, offset=0, lengths=[1 << 20], digest=0, payload=[bytes(1 << 20)]))
        peer.send(p.Pull(xfer=78, request_id="other", timeout=2.0, keep=True))
        # the half-received entry is dropped (at once for the clash, else at its 1 s transfer deadline)
        eventually(lambda: c.stats()["counters"]["failures"] >= 1, timeout=10)
        assert "half" not in listed(c)
        c.put("half", {"x": filled(4096, 6)})
        assert torch.equal(c.get("half")["x"], filled(4096, 6))
        assert torch.equal(c.get("other")["x"], filled(4096, 5))
        eventually(lambda: pool_used(c) == 0)
        peer.close()


@pytest.mark.frames_only  # (a raw ZeroMQ peer: a NIXL daemon refuses it)
@pytest.mark.parametrize("timeout", [math.nan, math.inf, -1.0])
def test_a_pull_with_an_impossible_timeout_is_refused(daemons, timeout):
    a = daemons.start("A")
    peer = RawPeer(a.listen)
    peer.hello()
    peer.send(p.Pull(xfer=79, request_id="whatever", timeout=timeout))
    reply = peer.recv(2.0)
    assert isinstance(reply, p.Abort) and reply.code == kvd.BadRequest.code, reply
    peer.close()
    assert "exception was never retrieved" not in a.log() and "Traceback" not in a.log()


# --- 4b. everything at once: every read ends, exact or with an error ----------------------------------

SHARED_IDS = [f"shared-{i}" for i in range(6)]


def _consistent(kv: dict) -> bool:
    k, v = kv["k"], kv["v"]
    return bool(torch.equal(v, k * 3) and torch.equal(k - k[0], torch.arange(len(k), dtype=k.dtype)))


def _chaos_worker(sockets: dict, seed: int, seconds: float, results) -> None:
    """Random puts, pushes, streams, gets, pulls, get_streams and deletes on a few shared ids, on
    both daemons; reports what happened, and any read that went silent instead of ending."""
    import collections
    import random

    rng = random.Random(seed)
    clients = {name: kvd.Client(sock, reply_timeout=3.0) for name, sock in sockets.items()}
    for c in clients.values():
        c.transfer_wait = 5.0
    counts: collections.Counter = collections.Counter()
    hangs: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        here = rng.choice(sorted(clients))
        there = next(n for n in sorted(clients) if n != here)
        c, rid = clients[here], rng.choice(SHARED_IDS)
        op = rng.choice(["put", "push", "stream_push", "get", "pull", "get_stream", "get_stream_pull", "delete"])
        n = rng.choice([1024, 64 << 10, 1 << 20])
        k = torch.arange(n, dtype=torch.int64) + rng.randrange(1 << 30)
        kv = {"k": k, "v": k * 3}
        started = time.monotonic()
        try:
            if op == "put":
                c.put(rid, kv, ttl=5)
            elif op == "push":
                c.put(rid, kv, dest=there, ttl=5)
            elif op == "stream_push":
                with c.put_stream(rid, {"k": (k.shape, k.dtype), "v": (k.shape, k.dtype)}, dest=there,
                                  ttl=5) as stream:
                    stream.write({"k": k})
                    stream.write({"v": kv["v"]})
            elif op in ("get", "pull"):
                got = c.get(rid, timeout=rng.choice([0, 0.5, 1.0]), source=there if op == "pull" else None)
                counts["verified" if _consistent(got) else "mismatch"] += 1
            elif op in ("get_stream", "get_stream_pull"):
                got = {}
                for group in c.get_stream(rid, timeout=rng.choice([0, 0.5, 1.0]),
                                          source=there if op == "get_stream_pull" else None):
                    got.update(group)
                counts["verified" if _consistent(got) else "mismatch"] += 1
            else:
                c.delete(rid)
            counts[f"{op}:ok"] += 1
        except kvd.KvdError as exc:
            if "went silent" in str(exc) or "did not answer" in str(exc):
                hangs.append(f"{op} {rid} on {here} after {time.monotonic() - started:.1f}s: {exc}")
            counts[f"{op}:{type(exc).__name__}"] += 1
    for c in clients.values():
        c.close()
    results.put((dict(counts), hangs))


@pytest.mark.parametrize("workers, seconds", [(6, 10.0), pytest.param(8, 60.0, marks=pytest.mark.slow)])
def test_concurrent_chaos_on_shared_ids_never_hangs_a_read(daemons, workers, seconds):
    import multiprocessing as mp

    a, b = daemons.pair(pool_size="128MiB", extra=["--transfer-timeout", "3s"])
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_chaos_worker, args=({"A": a.socket, "B": b.socket}, seed, seconds, results))
             for seed in range(workers)]
    for proc in procs:
        proc.start()
    reports = [results.get(timeout=seconds + 100) for _ in procs]
    for proc in procs:
        proc.join(30)
    counts = {}
    for report, _ in reports:
        for key, value in report.items():
            counts[key] = counts.get(key, 0) + value
    hangs = [h for _, report_hangs in reports for h in report_hangs]
    assert not hangs, f"{len(hangs)} reads went silent: {hangs[:5]}\n{counts}"
    assert counts.get("mismatch", 0) == 0, counts
    # (reads did happen: the bar was 50 and a loaded machine verified 43; it only rules out a run in
    # which every read failed)
    assert counts.get("verified", 0) > 20, counts
    with a.client() as ca, b.client() as cb:
        for rid in SHARED_IDS:
            ca.delete(rid)
            cb.delete(rid)
        eventually(lambda: pool_used(ca) == 0 and pool_used(cb) == 0, timeout=10)


def _connect_as(endpoint: str, uid: int, report) -> None:
    """In a forked child: become another user, then say hello on a daemon's client socket."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    try:
        conn = raw_connection(endpoint)
        conn.send(p.encode(p.Hello(req=1, client="intruder")))
        frames = conn.receive(5)
        report.send(None if frames is None else repr(p.decode(frames)))
    except Exception as exc:
        report.send(f"{type(exc).__name__}: {exc}")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_another_user_on_this_host_cannot_use_a_tcp_client_socket(daemons):
    import multiprocessing as mp

    from kvd.testing.daemons import free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    a = daemons.start("A", extra=["--socket", endpoint], wait=False)  # (the last --socket wins)
    a.socket = endpoint
    eventually(lambda: "ready" in a.log(), timeout=20)
    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    intruder = ctx.Process(target=_connect_as, args=(a.socket, 65534, theirs))
    intruder.start()
    assert ours.poll(30)
    seen = ours.recv()
    intruder.join(10)
    assert seen is not None and f"code={kvd.Unauthorized.code}" in seen and "uid 65534" in seen, seen
    with kvd.Client(a.socket) as c:  # the daemon's own user is served
        c.put("mine", {"x": torch.arange(10)})
        assert torch.equal(c.get("mine")["x"], torch.arange(10))
    assert "refused a client connection from another user" in a.log()
