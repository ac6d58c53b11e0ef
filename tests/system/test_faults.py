"""Bad input and failures never take a daemon down or leak pool memory; everyone else is served."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import socket
import struct
import threading
import time

import msgpack
import pytest
import torch
import zmq

import kvd
from kvd.testing.daemons import free_port, raw_connection, wait_ready
from kvd.wire import protocol as p
from kvd.wire.endpoints import unix_path
from kvd.wire.framing import MAX_FRAMES, MAX_MESSAGE_BYTES, MessageReader, encode_message

from .relay import PausingRelay


def raw_dealer(endpoint: str) -> zmq.Socket:
    """A bare ZeroMQ socket on a daemon's peer port."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint)
    return sock


def assert_still_serving(daemon) -> None:
    with daemon.client() as c:
        c.put("alive-check", {"x": torch.arange(1000)})
        assert torch.equal(c.get("alive-check")["x"], torch.arange(1000))
        assert c.stats()["pool"]["used_bytes"] == 0


BAD_CLIENT_MESSAGES = [
    [b""],
    [b"\xc1"],  # msgpack's never-used byte
    [b"\x93\x01\x02\x03"],  # an array, not a map
    [msgpack.packb({"v": 99, "t": "stats", "req": 1})],
    [msgpack.packb({"v": 1, "t": "no_such_type", "req": 1})],
    [msgpack.packb({"v": 1, "t": "put_alloc", "req": 1})],  # fields missing
    [msgpack.packb({"v": 1, "t": "put_alloc", "req": 1, "request_id": 5, "tensors": []})],
    [msgpack.packb({"v": 1, "t": "put_alloc", "req": 1, "request_id": "r", "tensors": [["x", "float99", [1]]]})],
    [msgpack.packb({"v": 1, "t": "put_alloc", "req": 1, "request_id": "r", "tensors": [["x", "uint8", [-1]]]})],
    [msgpack.packb({"v": 1, "t": "put_alloc", "req": 1, "request_id": "r",
                    "tensors": [["x", "uint8", [1 << 39]]]})],  # 512 GiB: pool full, not a crash
    [msgpack.packb({"v": 1, "t": "put_commit", "req": 1, "request_id": "r", "token": 12345})],
    [msgpack.packb({"v": 1, "t": "get_done", "req": 1, "request_id": "r", "token": 999, "reply": True})],
    [msgpack.packb({"v": 1, "t": "stats", "req": 1}), b"extra frame"],
    [msgpack.packb({"v": 1, "t": "ok", "req": 1})],  # a reply type sent as a request
    [b"\x81" + b"\xa1v" + b"\x01" * 10],  # truncated / trailing garbage
    [msgpack.packb({"v": 1, "t": "stats", "req": 1, "pad": "x" * (2 << 20)})],  # header over the cap
]


@pytest.mark.parametrize("frames", BAD_CLIENT_MESSAGES, ids=range(len(BAD_CLIENT_MESSAGES)))
def test_malformed_client_messages_get_an_error_reply(daemon, frames):
    conn = raw_connection(daemon.socket)
    conn.send(frames)
    reply = p.decode(conn.receive(5))
    assert isinstance(reply, p.Error), reply
    assert reply.code in (kvd.ProtocolError.code, kvd.BadRequest.code, kvd.VersionMismatch.code,
                          kvd.NotFound.code, kvd.PoolFull.code), reply
    # the connection survives a bad message: the next request on it is answered
    conn.send(p.encode(p.Stats(req=2)))
    assert isinstance(p.decode(conn.receive(5)), p.Ok)
    conn.close()
    assert_still_serving(daemon)


U32 = struct.Struct("<I")
BAD_CLIENT_STREAMS = {
    "no frames": U32.pack(0),
    "too many frames": U32.pack(MAX_FRAMES + 1),
    "a message over the limit": U32.pack(1) + U32.pack(MAX_MESSAGE_BYTES + 1),
    "a length of 4 GiB": U32.pack(1) + U32.pack(0xFFFFFFFF) + b"x" * 100,
    "random bytes": bytes(range(7, 256)) * 3,
}


@pytest.mark.parametrize("stream", BAD_CLIENT_STREAMS.values(), ids=BAD_CLIENT_STREAMS.keys())
def test_broken_framing_is_answered_and_only_that_connection_closed(daemon, stream):
    with daemon.client() as bystander:
        bystander.put("held", {"x": torch.arange(10)})
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(5)
        sock.connect(unix_path(daemon.socket))
        sock.sendall(stream)
        received = b""
        while chunk := sock.recv(65536):  # until the daemon hangs up
            received += chunk
        sock.close()
        reply = p.decode(MessageReader().feed(received)[0])
        assert isinstance(reply, p.Error) and reply.code == kvd.ProtocolError.code, reply
        assert torch.equal(bystander.get("held")["x"], torch.arange(10))  # the other connection lives on
    assert_still_serving(daemon)


def test_a_client_pipelining_thousands_of_requests_does_not_stall_the_others(daemon):
    # one read of a connection can hold thousands of requests; they are handled in batches, and
    # other clients are served between them
    flood = b"".join(encode_message(p.encode(p.ListEntries(req=i))) for i in range(50000))
    latencies = []
    with daemon.client() as bystander:
        for i in range(100):  # something for each of the flood's requests to list
            bystander.put(f"listed-{i}", {"x": torch.ones(1)})
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(unix_path(daemon.socket))

        def send_flood() -> None:
            with contextlib.suppress(OSError):  # the daemon hung up on a client that does not read (64 MiB unread)
                sock.sendall(flood)  # its replies are never read

        sender = threading.Thread(target=send_flood)
        sender.start()
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            started = time.monotonic()
            bystander.stats()
            latencies.append(time.monotonic() - started)
            time.sleep(0.005)
        sock.close()
        sender.join(10)
        for i in range(100):
            bystander.delete(f"listed-{i}")
    assert max(latencies) < 0.5, f"a bystander's stats took up to {max(latencies):.2f} s (before: 2.9 s)"
    assert_still_serving(daemon)


def test_a_message_cut_short_by_a_disconnect_is_dropped(daemon):
    whole = encode_message(p.encode(p.PutAlloc(req=1, request_id="cut", tensors=[["x", "uint8", [1 << 20]]])))
    for cut in (1, 4, 8, len(whole) - 1):
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(unix_path(daemon.socket))
        sock.sendall(whole[:cut])
        sock.close()
    with daemon.client() as c, pytest.raises(kvd.NotFound):
        c.get("cut", timeout=0)
    assert_still_serving(daemon)


def test_garbage_on_the_peer_port_is_refused(daemons):
    a, b = daemons.pair()
    sock = raw_dealer(a.listen)
    # before a handshake, even a well-formed transfer message is refused
    sock.send_multipart(p.encode(p.Offer(xfer=1, request_id="r", tensors=[["x", "uint8", [10]]],
                                         total_bytes=10, chunk_size=1 << 20, checksum="none")))
    assert isinstance(p.decode(sock.recv_multipart()), p.Abort)
    for frames in ([b"junk"], [msgpack.packb({"v": 2, "t": "ping", "nonce": 1})], [b"\x80", b"x" * 100]):
        sock.send_multipart(frames)
        reply = p.decode(sock.recv_multipart())
        assert isinstance(reply, p.Abort)
    # after a handshake: chunks that break the rules abort that transfer only
    sock.send_multipart(p.encode(p.PeerHello(node_id="evil", incarnation=1)))
    assert isinstance(p.decode(sock.recv_multipart()), p.PeerHelloOk)
    sock.send_multipart(p.encode(p.Offer(xfer=7, request_id="evil-1", tensors=[["x", "uint8", [100]]],
                                         total_bytes=100, chunk_size=10, checksum="xxh3_64")))
    assert isinstance(p.decode(sock.recv_multipart()), p.Accept)  # 10 chunks: more than the eager 2
    bad = p.Chunk(xfer=7, seq=0, offset=0, lengths=[10], digest=12345, payload=[b"\x00" * 10])
    sock.send_multipart(p.encode(bad))
    abort = p.decode(sock.recv_multipart())
    assert isinstance(abort, p.Abort) and abort.code == kvd.ChecksumMismatch.code
    sock.send_multipart(p.encode(p.Offer(xfer=8, request_id="evil-2", tensors=[["x", "uint8", [100]]],
                                         total_bytes=99, chunk_size=1 << 20, checksum="none")))
    assert isinstance(p.decode(sock.recv_multipart()), p.Abort)
    sock.send_multipart(p.encode(p.Offer(xfer=9, request_id="evil-3", tensors=[["x", "uint8", [1 << 36]]],
                                         total_bytes=1 << 36, chunk_size=1 << 20, checksum="none")))
    assert p.decode(sock.recv_multipart()).code == kvd.PoolFull.code
    sock.close()
    with a.client() as ca:
        stats = ca.stats()
        assert stats["entries"] == 0 and stats["pool"]["used_bytes"] == 0
    assert_still_serving(a)
    with a.client() as ca, b.client() as cb:
        ca.put("after-garbage", {"x": torch.ones(10)}, dest="B")
        assert torch.equal(cb.get("after-garbage")["x"], torch.ones(10))


def test_small_transfer_is_answered_by_done_alone(daemon):
    """An offer whose chunks all come eagerly needs no accept, and `done` acknowledges the last
    chunk: three messages per small transfer (offer, chunk, done) instead of five."""
    from kvd.wire.checksum import digest

    sock = raw_dealer(daemon.listen)
    sock.send_multipart(p.encode(p.PeerHello(node_id="small", incarnation=1)))
    assert isinstance(p.decode(sock.recv_multipart()), p.PeerHelloOk)
    payload = [bytes(range(256)) * 4, bytes(range(255, -1, -1)) * 4]
    sock.send_multipart(p.encode(p.Offer(xfer=5, request_id="two-chunks", tensors=[["x", "uint8", [2048]]],
                                         total_bytes=2048, chunk_size=1024, checksum="xxh3_64")))
    for seq, piece in enumerate(payload):
        sock.send_multipart(p.encode(p.Chunk(xfer=5, seq=seq, offset=seq * 1024, lengths=[1024],
                                             digest=digest("xxh3_64", [piece]), payload=[piece])))
    replies = []
    sock.setsockopt(zmq.RCVTIMEO, 500)
    with pytest.raises(zmq.Again):
        while True:
            replies.append(p.decode(sock.recv_multipart()))
    assert [type(r) for r in replies] == [p.Done], replies
    sock.close()
    with daemon.client() as c:
        assert c.get("two-chunks")["x"].numpy().tobytes() == b"".join(payload)


def wait_until(condition, timeout: float) -> float:
    """Seconds until condition() held; fails the test after timeout."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "condition not reached in time"
        time.sleep(0.02)
    return time.monotonic() - start


def test_client_that_disconnects_mid_put_leaks_nothing(daemons):
    d = daemons.start("A")  # the default 30 s lease: what frees the blocks here is the disconnect
    conn = raw_connection(d.socket)
    conn.send(p.encode(p.PutAlloc(req=1, request_id="orphan", tensors=[["x", "uint8", [4 << 20]]])))
    assert isinstance(p.decode(conn.receive(5)), p.PutSlots)
    with d.client() as c:
        assert c.stats()["pool"]["used_bytes"] == 4 << 20
        conn.close()  # gone without committing
        assert wait_until(lambda: c.stats()["pool"]["used_bytes"] == 0, 2.0) < 2.0
        with pytest.raises(kvd.NotFound):
            c.get("orphan", timeout=0)
    assert "disconnected with 1 unfinished put(s)" in d.log()
    assert_still_serving(d)


def test_connected_client_that_never_commits_loses_its_reservation_at_lease_expiry(daemons):
    """The entry goes at lease expiry; its blocks stay parked while the writer might still copy
    into them, and come back once its late commit shows it has stopped (see test_integrity.py)."""
    d = daemons.start("A", extra=["--lease-timeout", "1s"])
    conn = raw_connection(d.socket)
    conn.send(p.encode(p.PutAlloc(req=1, request_id="slow", tensors=[["x", "uint8", [4 << 20]]])))
    slots = p.decode(conn.receive(5))
    with d.client() as c:
        assert c.stats()["pool"]["used_bytes"] == 4 << 20
        wait_until(lambda: not c.list(), 10)  # the lease (1 s) ran out: the entry went at the next sweep
        with pytest.raises(kvd.NotFound):
            c.get("slow", timeout=0)
        assert c.stats()["pool"]["parked_bytes"] == 4 << 20
        conn.send(p.encode(p.PutCommit(req=2, request_id="slow", token=slots.token)))  # too late
        replies = {}
        while 2 not in replies:
            reply = p.decode(conn.receive(5))
            replies[reply.req] = reply
        assert isinstance(replies[2], p.Error) and replies[2].code == kvd.Timeout.code, replies
        assert c.stats()["pool"]["used_bytes"] == 0
    conn.close()
    assert_still_serving(d)


def _die_after_get_slots(endpoint: str) -> None:
    conn = raw_connection(endpoint)
    conn.send(p.encode(p.Get(req=1, request_id="half-read", timeout=5.0)))
    conn.receive(5)
    os._exit(0)  # crash between lease and release


def test_client_that_dies_mid_get_gives_the_entry_back(daemons):
    d = daemons.start("A")  # the default 30 s lease: the disconnect gives the entry back
    with d.client() as c:
        c.put("half-read", {"x": torch.arange(100)})
        proc = mp.get_context("spawn").Process(target=_die_after_get_slots, args=(d.socket,))
        proc.start()
        proc.join(20)
        assert proc.exitcode == 0
        assert torch.equal(c.get("half-read", timeout=2)["x"], torch.arange(100))  # not lost, not waiting 30 s


def test_receiver_killed_mid_transfer(daemons):
    # A's link to B runs through a relay that holds everything past 16 MiB: the push is certain to be
    # under way when B dies (a fixed sleep raced it: 256 MiB on loopback can finish in 0.1 s)
    relay = PausingRelay(free_port(), 16 << 20)
    relay.start()
    port_a = free_port()
    a = daemons.start("A", port=port_a, pool_size="320MiB", extra=["--transfer-timeout", "2s"],
                      peers={"B": relay.endpoint}, wait=False)
    b = daemons.start("B", port=relay.target_port, pool_size="320MiB", extra=["--transfer-timeout", "2s"],
                      peers={"A": f"tcp://127.0.0.1:{port_a}"}, wait=False)
    wait_ready(a)
    wait_ready(b)
    big = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8)
    errors = []

    def pusher():
        with a.client() as ca:
            try:
                ca.put("doomed", {"x": big}, dest="B")
            except kvd.KvdError as exc:
                errors.append(exc)

    thread = threading.Thread(target=pusher)
    start = time.monotonic()
    thread.start()
    try:
        assert relay.paused.wait(20), f"the relay forwarded only {relay.forwarded} bytes"
        assert thread.is_alive(), f"the push ended before the fault: {errors!r}"
        b.kill(signal.SIGKILL)
    finally:
        relay.stop()
    thread.join(30)
    assert errors and isinstance(errors[0], kvd.PeerUnavailable), errors
    assert time.monotonic() - start < 15
    with a.client() as ca:
        # the blocks come back once ZeroMQ lets go of the frames queued for the dead peer (its
        # connection is cut after --transfer-timeout at the latest): seconds on a loaded machine
        deadline = time.monotonic() + 15
        while ca.stats()["pool"]["used_bytes"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ca.stats()["pool"]["used_bytes"] == 0 and ca.stats()["entries"] == 0
    assert_still_serving(a)


def test_holder_killed_mid_pull(daemons):
    # B's link to A runs through a relay that holds what A sends past 16 MiB: the pull is certain to
    # be under way when A dies (watching for "receiving", 256 MiB could all arrive before the kill)
    port_a, port_b = free_port(), free_port()
    relay = PausingRelay(port_a, 16 << 20, towards_target=False)
    relay.start()
    a = daemons.start("A", port=port_a, pool_size="320MiB", extra=["--transfer-timeout", "2s"],
                      peers={"B": f"tcp://127.0.0.1:{port_b}"}, wait=False)
    b = daemons.start("B", port=port_b, pool_size="320MiB", extra=["--transfer-timeout", "2s"],
                      peers={"A": relay.endpoint}, wait=False)
    wait_ready(a)
    wait_ready(b)
    with a.client() as ca:
        ca.put("doomed-pull", {"x": torch.randint(0, 256, (256 << 20,), dtype=torch.uint8)})
    errors = []

    def puller():
        with b.client() as cb:
            try:
                cb.get("doomed-pull", source="A", timeout=5)
            except kvd.KvdError as exc:
                errors.append(exc)

    thread = threading.Thread(target=puller)
    thread.start()
    try:
        assert relay.paused.wait(20), f"the relay forwarded only {relay.forwarded} bytes"
        assert thread.is_alive(), f"the pull ended before the fault: {errors!r}"
        with b.client() as watcher:
            assert any(e["state"] == "receiving" for e in watcher.list()), watcher.list()
        a.kill(signal.SIGKILL)
    finally:
        relay.stop()
    thread.join(30)
    assert not thread.is_alive(), "the get did not return"
    assert errors and isinstance(errors[0], (kvd.PeerUnavailable, kvd.Timeout)), errors
    with b.client() as cb:
        deadline = time.monotonic() + 5
        while cb.stats()["pool"]["used_bytes"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cb.stats()["pool"]["used_bytes"] == 0 and cb.stats()["entries"] == 0
    assert_still_serving(b)


def _worker(socket: str, dest: str | None, worker: int, count: int, results) -> None:
    import torch

    import kvd

    ok = 0
    with kvd.Client(socket) as c:
        for i in range(count):
            t = torch.full((4096 + i,), worker * 1000 + i, dtype=torch.int32)
            c.put(f"w{worker}-{i}", {"k": t, "v": t + 1}, dest=dest)
            ok += 1
    results.put((worker, ok))


def test_100_concurrent_requests_from_several_processes(daemons):
    a, b = daemons.pair(pool_size="128MiB")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(a.socket, "B" if w % 2 else None, w, 25, results))
             for w in range(4)]
    for proc in procs:
        proc.start()
    done = dict(results.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(30)
    assert done == {w: 25 for w in range(4)}
    with a.client() as ca, b.client() as cb:
        for w in range(4):
            for i in range(25):
                c = cb if w % 2 else ca
                kv = c.get(f"w{w}-{i}", timeout=5)
                expected = torch.full((4096 + i,), w * 1000 + i, dtype=torch.int32)
                assert torch.equal(kv["k"], expected) and torch.equal(kv["v"], expected + 1)
        assert ca.stats()["pool"]["used_bytes"] == 0 and cb.stats()["pool"]["used_bytes"] == 0


def test_sigterm_exits_cleanly_and_removes_the_socket(daemons):
    d = daemons.start("A")
    with d.client() as c:
        c.put("left-behind", {"x": torch.ones(3)})
    assert d.stop() == 0
    assert not os.path.exists(unix_path(d.socket))
    assert "stopped" in d.log()


def test_second_daemon_cannot_take_over_the_socket(daemons):
    first = daemons.start("A")
    second = daemons.start("A2", wait=False)
    second.socket = first.socket
    second.proc.kill()
    second.proc.wait()
    import subprocess

    args = list(first.args)
    args[args.index("--listen") + 1] = f"tcp://127.0.0.1:{free_port()}"
    result = subprocess.run(args, capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
    assert "in use" in result.stderr
    assert_still_serving(first)


def test_bit_flips_are_caught_by_the_checksum(daemons):
    # one bit of every 3rd chunk B receives is flipped on the way (kvd.memory.faults), after A
    # computed its checksum
    port_a, port_b = free_port(), free_port()
    a = daemons.start("A", port=port_a, peers={"B": f"tcp://127.0.0.1:{port_b}"}, pool_size="128MiB",
                      extra=["--chunk-size", "1MiB"])
    b = daemons.start("B", port=port_b, pool_size="128MiB", env={"KVD_TEST_CORRUPT_EVERY_NTH_CHUNK": "3"})
    data = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8)
    with a.client() as ca, b.client() as cb:
        with pytest.raises(kvd.ChecksumMismatch) as info:
            ca.put("flipped", {"x": data}, dest="B")
        assert info.value.remote == "B"
        with pytest.raises(kvd.NotFound):
            cb.get("flipped", timeout=0)  # a partial or corrupt cache is never visible
        assert cb.stats()["pool"]["used_bytes"] == 0
        # one-chunk puts: every third is corrupted on the way; each either fails loudly or is exact
        outcomes = []
        for i in range(6):
            try:
                ca.put(f"small-{i}", {"x": data[:1000]}, dest="B")
            except kvd.ChecksumMismatch:
                outcomes.append("caught")
                continue
            assert torch.equal(cb.get(f"small-{i}")["x"], data[:1000])
            outcomes.append("exact")
        assert outcomes.count("caught") == 2 and outcomes.count("exact") == 4, outcomes
        assert cb.stats()["pool"]["used_bytes"] == 0


def test_a_thousand_put_abort_cycles_leave_nothing_behind(daemon):
    with daemon.client() as c:
        baseline = c.stats()["pool"]
        sizes = [1 << 10, 64 << 10, 300 << 10, 1 << 20, 5 << 20]
        for i in range(1000):
            size = sizes[i % len(sizes)]
            c.put(f"cycle-{i}", {"x": torch.zeros(size, dtype=torch.uint8), "y": torch.zeros(7)})
            if i % 3 == 0:
                c.get(f"cycle-{i}")  # consumed
            else:
                assert c.delete(f"cycle-{i}")  # aborted
        stats = c.stats()["pool"]
        assert stats["used_bytes"] == baseline["used_bytes"] == 0
        assert stats["largest_free_extent_blocks"] == baseline["largest_free_extent_blocks"]
        # fully fragmented and freed again: a pool-sized put still fits
        c.put("whole", {"x": torch.zeros(stats["capacity_bytes"], dtype=torch.uint8)})
        assert c.delete("whole")


def test_stream_writer_that_disconnects_ends_its_push_and_its_readers_at_once(daemons):
    a, b = daemons.pair()  # the default 30 s lease: what ends it all here is the disconnect
    conn = raw_connection(a.socket)
    tensors = [["k", "uint8", [1 << 20]], ["v", "uint8", [1 << 20]]]
    conn.send(p.encode(p.PutAlloc(req=1, request_id="half-streamed", tensors=tensors, stream=True, dest="B")))
    slots = p.decode(conn.receive(5))
    assert isinstance(slots, p.PutSlots)
    conn.send(p.encode(p.PutPart(req=2, request_id="half-streamed", token=slots.token, tensors=[0])))
    with b.client() as cb:
        reader = cb.get_stream("half-streamed", timeout=10)
        first = next(reader)  # k arrived on B; v never will
        assert set(first) == {"k"}
        started = time.monotonic()
        conn.close()  # the writer goes away mid-stream
        with pytest.raises(kvd.KvdError, match="disconnected before committing"):
            next(reader)
        assert time.monotonic() - started < 3
        reader.close()
    with a.client() as ca, b.client() as cb:
        wait_until(lambda: ca.stats()["pool"]["used_bytes"] == 0 and cb.stats()["pool"]["used_bytes"] == 0, 5)
        assert ca.stats()["entries"] == 0 and cb.stats()["entries"] == 0


def test_a_get_that_outlives_its_caller_does_not_hide_the_entry(daemons):
    """A client waits in get for an entry, then goes away; when the entry arrives it must stay
    readable by others (before, the dead caller's lease hid it until the lease timeout)."""
    d = daemons.start("A")  # the default 30 s lease
    for stream in (False, True):
        rid = f"late-{stream}"
        conn = raw_connection(d.socket)
        request = p.GetStream if stream else p.Get
        conn.send(p.encode(request(req=1, request_id=rid, timeout=20.0)))
        with d.client() as c:
            wait_until(lambda: c.stats()["waiting_reads"] == 1, 5)  # waiting for rid on that connection's behalf
            conn.close()
            wait_until(lambda: c.stats()["waiting_reads"] == 0, 5)  # the daemon saw it go
            c.put(rid, {"x": torch.arange(50)})
            assert torch.equal(c.get(rid, timeout=2)["x"], torch.arange(50))
            assert c.stats()["pool"]["used_bytes"] == 0
    assert_still_serving(d)
