"""kvd.daemon.peer.loopsocket.Backlog and the ROUTER's byte cap: the bytes ZeroMQ holds for one peer
connection, counted from what was handed to it and what the kernel says was written (real sockets
where the kernel's word is what is tested)."""
from __future__ import annotations

import asyncio
import logging
import re
import time

import pytest
import zmq

from kvd.daemon.config import Config
from kvd.daemon.metrics import Metrics
from kvd.daemon.peer.links import COPY_BELOW, tune_peer_socket
from kvd.daemon.peer.loopsocket import NOT_SENT, Sent
from kvd.daemon.peer.owed import Backlog, kernel_written
from kvd.daemon.peer.peers import PeerSet, PeerSettings
from kvd.daemon.peer.router import MAX_ABORT_TEXT, Router, RouterChannel, RouterSettings, clip
from kvd.testing.daemons import free_port
from kvd.wire import protocol as p

LEND = 1 << 20


def test_what_is_counted_queued_is_what_the_kernel_has_not_taken():
    b = Backlog(cap=10_000, lend_from=LEND)
    b.add([b"x" * 100])  # 102 bytes on the wire
    b.add([b"x" * 1000, b"y" * 10])  # 1009 + 12
    assert b.handed == b.copied == 102 + 1009 + 12
    assert b.settle(written=0) == 1123  # nothing written yet
    assert b.settle(written=102) == 1021
    assert b.settle(written=1123) == 0


def test_zeromqs_own_bytes_never_make_the_count_exceed_the_truth():
    b = Backlog(cap=10_000, lend_from=LEND)
    assert b.settle(written=64) == 0  # its greeting, before any message of ours
    b.add([b"x" * 100])
    assert b.settle(written=64) == 102
    assert b.settle(written=64 + 102 + 9) == 0  # (and a heartbeat)
    b.add([b"x" * 100])
    assert b.settle(written=64 + 102 + 9) == 102
    assert b.own == 73


def test_frames_lent_to_zeromq_do_not_count_but_are_told_apart():
    b = Backlog(cap=10_000, lend_from=LEND)
    b.add([b"h" * 40, memoryview(bytearray(LEND))])  # a chunk: its header copied, its payload lent
    b.add([b"a" * 20])
    assert b.copied == 42 + 22 and len(b.lent) == 1
    assert b.settle(written=0) == 64
    assert b.settle(written=42 + 1000) == 22  # the header went, and part of the payload
    assert b.settle(written=42 + LEND + 9) == 22 and not b.lent
    assert b.settle(written=42 + LEND + 9 + 22) == 0


def test_it_says_when_to_look():
    b = Backlog(cap=1000, lend_from=LEND)
    assert not b.add([b"x" * 900])
    assert b.add([b"x" * 200])  # more than the cap copied since the last look
    assert b.settle(written=1000) == 909 + 202 - 1000
    assert not b.add([b"x" * 800])  # (111 + 809 <= 1000)
    assert b.add([b"x" * 100])
    b = Backlog(cap=1000, lend_from=LEND)
    frame = memoryview(bytearray(LEND))
    for _ in range(Backlog.PRUNE):  # lent frames are pruned once there are many
        assert not b.add([frame])
    assert b.add([frame])
    b.settle(written=0)
    assert not b.add([frame]) and b.prune_at == 2 * (Backlog.PRUNE + 1)  # (none went: look again at twice as many)


def test_another_connection_starts_the_count_again():
    b = Backlog(cap=10_000, lend_from=LEND)
    b.add([b"x" * 1000])
    assert b.settle(written=10, conn="first") == 1009 - 10
    assert b.settle(written=10, conn="second") == 0  # what was counted went on the first one
    b.add([b"x" * 100])
    assert b.settle(written=10, conn="second") == 102
    assert b.settle(written=5, conn="second") == 0  # a count that went back: not that connection
    b.add([b"x" * 100])
    b.unknown()
    assert b.handed == 0


def test_the_long_text_of_an_abort_is_cut():
    assert clip("short") == "short"
    text = clip("unknown message type '" + "x" * 60_000 + "'")
    assert len(text) == MAX_ABORT_TEXT and text.endswith("... (60023 characters)")
    sent = []
    channel = RouterChannel(("router", b"r"), "peer", lambda frames, track: sent.append(frames), lambda: False)
    channel.send(p.Abort(xfer=7, code=2, message="y" * 10_000))
    channel.send(p.Pong(nonce=1))
    abort = p.decode(sent[0])
    assert abort.xfer == 7 and len(abort.message) == MAX_ABORT_TEXT
    assert isinstance(p.decode(sent[1]), p.Pong)


def _pair(curve: bool):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    tune_peer_socket(router)
    router.setsockopt(zmq.HEARTBEAT_IVL, 0)  # (only our messages on the wire)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.HEARTBEAT_IVL, 0)
    if curve:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        router.curve_server = True
        router.curve_secretkey, router.curve_publickey = server_secret, server_public
        dealer.curve_serverkey = server_public
        dealer.curve_publickey, dealer.curve_secretkey = client_public, client_secret
    router.bind("tcp://127.0.0.1:0")
    return ctx, router, dealer


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_framing_is_counted_exactly_as_zeromq_writes_it(curve):
    # counted too high, a long-lived connection's count would creep up to the cap; too low, the
    # excess would pile up as "ZeroMQ's own" bytes: after each round of every size, all read, the
    # count is 0 and ZeroMQ's own bytes have not moved
    ctx, router, dealer = _pair(curve)
    dealer.connect(router.getsockopt(zmq.LAST_ENDPOINT).decode())
    try:
        dealer.send(b"hello")
        first = router.recv_multipart(copy=False)
        rid, fd = first[0].bytes, first[1].get(zmq.SRCFD)
        backlog = Backlog(cap=1 << 30, lend_from=router.copy_threshold, curve=curve)
        sizes = [[18], [200], [222], [223], [255], [256], [4000, 100], [70_000], [COPY_BELOW - 1],
                 [COPY_BELOW], [10, 2_000_000]]
        owns = []
        for _ in range(2):
            for frames in sizes:
                payload = [memoryview(bytearray(n)) for n in frames]
                for _ in range(20):
                    router.send_multipart([rid, *payload], copy=False)
                    backlog.add(payload)
                for _ in range(20):
                    dealer.recv_multipart()
            deadline = time.monotonic() + 5
            while backlog.settle(kernel_written(fd), "c") and time.monotonic() < deadline:
                time.sleep(0.01)
            assert backlog.settle(kernel_written(fd), "c") == 0
            owns.append(backlog.own)
        assert owns[1] == owns[0] < 2048  # (greeting and handshake)
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()


def test_what_a_peer_that_reads_nothing_leaves_queued_is_counted():
    ctx, router, dealer = _pair(curve=False)
    dealer.setsockopt(zmq.RCVHWM, 1)
    dealer.setsockopt(zmq.RCVBUF, 4096)
    dealer.connect(router.getsockopt(zmq.LAST_ENDPOINT).decode())
    try:
        dealer.send(b"hello")
        first = router.recv_multipart(copy=False)
        rid, fd = first[0].bytes, first[1].get(zmq.SRCFD)
        backlog = Backlog(cap=1 << 30, lend_from=router.copy_threshold)
        message = [b"m" * (10 << 10)]
        for _ in range(2000):  # 20 MiB, far more than the kernel takes when nothing is read
            router.send_multipart([rid, *message], copy=False)
            backlog.add(message)
        time.sleep(0.5)
        written = kernel_written(fd)
        queued = backlog.settle(written, "c")
        assert queued == backlog.handed - written + backlog.own
        assert backlog.handed - written - 4096 <= queued <= backlog.handed - written
        assert queued > 10 << 20  # (whatever the kernel took, it is not half of it)
        for _ in range(2000):  # now it reads, every one (not "until 0.5 s of silence")
            assert dealer.poll(10_000), "a message never came"
            dealer.recv_multipart()
        deadline = time.monotonic() + 5
        while backlog.settle(kernel_written(fd), "c") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert backlog.settle(kernel_written(fd), "c") == 0
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()


def test_the_router_cuts_a_peer_past_the_byte_cap(caplog):
    async def scenario() -> None:
        ctx = zmq.Context()
        config = Config(listen=f"tcp://127.0.0.1:{free_port()}")
        peers = PeerSet(PeerSettings.of(config), ctx, 1, curve=None)
        gone = []
        router = Router(RouterSettings.of(config), ctx, None, peers, Metrics(), 1,
                        on_gone=lambda key, why: gone.append(why))
        peers.owed.per_connection = 1 << 20
        router.start(lambda channel, msg: None)
        deaf = ctx.socket(zmq.DEALER)
        deaf.setsockopt(zmq.LINGER, 0)
        deaf.setsockopt(zmq.RCVHWM, 1)
        deaf.setsockopt(zmq.RCVBUF, 4096)
        deaf.connect(router.bound_endpoint)
        try:
            deaf.send_multipart(p.encode(p.PeerHello(node_id="deaf", incarnation=1)))
            for _ in range(200):
                if peers._router_peers:
                    break
                await asyncio.sleep(0.01)
            (rid,) = peers._router_peers
            channel = peers.router_channel(rid)
            chunk = p.Chunk(xfer=1, seq=0, offset=0, lengths=[64 << 10], digest=0,
                            payload=[memoryview(bytearray(64 << 10))])
            sent = [channel.send(chunk) for _ in range(200)]  # 12.5 MiB: the kernel takes a few
            assert type(sent[0]) is Sent and sent[-1] is NOT_SENT
            first_dropped = sent.index(NOT_SENT)
            assert all(s is NOT_SENT for s in sent[first_dropped:])
            for _ in range(200):
                if gone:
                    break
                await asyncio.sleep(0.01)
            assert gone == ["peer deaf disconnected"]
        finally:
            deaf.close(0)
            router.close()
            ctx.term()

    with caplog.at_level(logging.WARNING, logger="kvd.daemon.peer.router"):
        asyncio.run(scenario())
    assert re.search(r"peer deaf does not read what we send \(1\.\d MiB queued for it, more than the 1 MiB a "
                     r"connection may have\): connection closed", caplog.text), caplog.text
