"""Two real daemons over loopback TCP: push, pull, big caches, and peer failures."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import kvd
from kvd.testing.daemons import eventually, free_port
from kvd.wire import protocol as p

BOTH_PLANES = True  # (tests/system/conftest.py: each test on ZeroMQ frames and on NIXL)


def test_push_then_get_on_the_receiver(daemons):
    a, b = daemons.pair()
    kv = {f"layer.{i}.{kind}": torch.randn(8, 16, 64, dtype=torch.bfloat16) for i in range(4) for kind in "kv"}
    with a.client() as ca, b.client() as cb:
        ca.put("req-1", kv, dest="B")
        assert ca.stats()["pool"]["used_bytes"] == 0  # the sender's copy is gone once B confirmed
        got = cb.get("req-1")
        for name, t in kv.items():
            assert torch.equal(got[name].view(torch.int16), t.view(torch.int16))
        assert cb.stats()["pool"]["used_bytes"] == 0


def test_get_waits_until_a_push_has_fully_arrived(daemons):
    a, b = daemons.pair(pool_size="128MiB")
    big = torch.randint(0, 256, (48 << 20,), dtype=torch.uint8)
    result = {}

    def reader():
        with b.client() as cb:
            result["kv"] = cb.get("late", timeout=30)

    thread = threading.Thread(target=reader)
    thread.start()
    with b.client() as cb:
        eventually(lambda: cb.stats()["waiting_reads"] == 1)  # the get waits before the push begins
    with a.client() as ca:
        ca.put("late", {"x": big}, dest="B")
    thread.join(30)
    assert torch.equal(result["kv"]["x"], big)


def test_pull_from_the_holder(daemons):
    a, b = daemons.pair()
    kv = {"k": torch.randn(3, 4, 5), "v": torch.randint(-128, 127, (7,), dtype=torch.int8)}
    with a.client() as ca, b.client() as cb:
        ca.put("req-2", kv)
        got = cb.get("req-2", source="A")
        assert torch.equal(got["k"], kv["k"]) and torch.equal(got["v"], kv["v"])
        eventually(lambda: ca.stats()["entries"] == 0 and ca.stats()["pool"]["used_bytes"] == 0)
        assert cb.stats()["entries"] == 0


def test_pull_waits_on_the_holder_for_a_later_put(daemons):
    a, b = daemons.pair()
    result = {}

    def reader():
        with b.client() as cb:
            result["kv"] = cb.get("pull-late", source="A", timeout=10)

    thread = threading.Thread(target=reader)
    thread.start()
    with b.client() as cb:
        eventually(lambda: cb.stats()["transfers_in_flight"] == 1)  # the pull waits on A before the put
    with a.client() as ca:
        ca.put("pull-late", {"x": torch.arange(100)})
    thread.join(15)
    assert torch.equal(result["kv"]["x"], torch.arange(100))


def test_push_and_pull_by_tcp_endpoint(daemons):
    a = daemons.start("A")
    b = daemons.start("B")  # no peers configured on either side
    with a.client() as ca, b.client() as cb:
        ca.put("by-endpoint", {"x": torch.arange(10)}, dest=b.listen)
        assert torch.equal(cb.get("by-endpoint")["x"], torch.arange(10))
        ca.put("pulled", {"x": torch.arange(7)})
        assert torch.equal(cb.get("pulled", source=a.listen)["x"], torch.arange(7))


def test_256_mib_cache_both_ways(daemons):
    a, b = daemons.pair(pool_size="320MiB")
    g = torch.Generator().manual_seed(7)
    layers = {f"layer.{i}": torch.randint(-2**31, 2**31 - 1, (2 << 20,), dtype=torch.int32, generator=g)
              for i in range(32)}  # 32 x 8 MiB = 256 MiB
    with a.client() as ca, b.client() as cb:
        ca.put("big", layers, dest="B")
        got = cb.get("big", timeout=60)
        assert all(torch.equal(got[n], t) for n, t in layers.items())
        del got
        ca.put("big2", layers)
        got = cb.get("big2", source="A", timeout=60)
        assert all(torch.equal(got[n], t) for n, t in layers.items())
        assert cb.stats()["pool"]["used_bytes"] == 0
        eventually(lambda: ca.stats()["pool"]["used_bytes"] == 0)


def test_unknown_peer_and_unreachable_peer(daemons):
    a = daemons.start("A", extra=["--connect-timeout", "1s"])
    with a.client() as ca:
        with pytest.raises(kvd.PeerUnavailable, match="unknown peer"):
            ca.put("x", {"x": torch.ones(1)}, dest="nobody")
        start = time.monotonic()
        with pytest.raises(kvd.PeerUnavailable, match="did not answer"):
            ca.put("y", {"x": torch.ones(1)}, dest=f"tcp://127.0.0.1:{free_port()}")
        assert time.monotonic() - start < 5
        with pytest.raises(kvd.PeerUnavailable):
            ca.get("z", source=f"tcp://127.0.0.1:{free_port()}", timeout=1)
        assert ca.stats()["pool"]["used_bytes"] == 0 and ca.stats()["entries"] == 0
        ca.put("still-works", {"x": torch.ones(1)})
        assert ca.get("still-works")["x"].item() == 1


def test_an_unreachable_peer_costs_no_busy_loop(daemons):
    # the heartbeat's hello to a peer that is down waits in the socket's send queue; it used to
    # be retried every millisecond (10 % of a core for as long as the peer stayed down)
    from bench.measure import cpu_seconds

    a = daemons.start("A", peers={"B": f"tcp://127.0.0.1:{free_port()}"},
                      extra=["--heartbeat-interval", "0.2s"])
    time.sleep(1.0)  # the first hellos are queued and their retries have backed off
    before = cpu_seconds(a.pid)
    time.sleep(3.0)
    assert cpu_seconds(a.pid) - before < 0.09, "an idle daemon with a peer down used > 3 % of a core"
    with a.client() as ca:
        ca.put("still-serving", {"x": torch.ones(1)})
        assert ca.get("still-serving")["x"].item() == 1


def test_a_peer_restarted_on_the_same_address_takes_the_next_push(daemons):
    # A sees the TCP connection close and says hello again before its next message; it used to
    # go on sending into the new B's connection as if B knew it, until the heartbeat timeout
    a, b = daemons.pair()
    kv = {"x": torch.arange(16)}
    with a.client() as ca:
        ca.put("before", kv, dest="B")
        assert b.stop() == 0
        b = daemons.start("B", port=int(b.listen.rsplit(":", 1)[1]), peers={"A": a.listen})
        started = time.monotonic()
        ca.put("after", kv, dest="B")  # the first try (the heartbeat timeout is 5 s)
        assert time.monotonic() - started < 3
    with b.client() as cb:
        assert torch.equal(cb.get("after")["x"], kv["x"])


def test_remote_pool_full_reaches_the_client_as_pool_full(daemons):
    port_a, port_b = free_port(), free_port()
    a = daemons.start("A", port=port_a, pool_size="64MiB", peers={"B": f"tcp://127.0.0.1:{port_b}"})
    b = daemons.start("B", port=port_b, pool_size="16MiB")
    with a.client() as ca, b.client() as cb:
        with pytest.raises(kvd.PoolFull) as info:
            ca.put("huge", {"x": torch.zeros(32 << 20, dtype=torch.uint8)}, dest="B")
        assert info.value.remote == "B"
        # the blocks return once ZeroMQ has let go of the chunks sent before B refused
        deadline = time.monotonic() + 3
        while ca.stats()["pool"]["used_bytes"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ca.stats()["pool"]["used_bytes"] == 0
        ca.put("fits", {"x": torch.ones(1 << 20, dtype=torch.uint8)}, dest="B")
        assert cb.get("fits")["x"].sum().item() == 1 << 20


def test_pull_of_a_missing_request_fails_with_the_holders_error(daemons):
    _a, b = daemons.pair()
    with b.client() as cb:
        with pytest.raises(kvd.NotFound) as info:
            cb.get("never", source="A", timeout=0)
        assert info.value.remote == "A"
        with pytest.raises(kvd.Timeout):
            cb.get("never", source="A", timeout=0.5)


def test_duplicate_push_is_already_exists(daemons):
    a, _b = daemons.pair()
    with a.client() as ca:
        ca.put("twice", {"x": torch.ones(4)}, dest="B")
        with pytest.raises(kvd.AlreadyExists):
            ca.put("twice", {"x": torch.ones(4)}, dest="B")
        assert ca.stats()["pool"]["used_bytes"] == 0


def test_concurrent_gets_of_one_request_share_one_pull(daemons):
    a, b = daemons.pair(pool_size="128MiB")
    data = torch.randint(0, 256, (24 << 20,), dtype=torch.uint8)
    with a.client() as ca:
        ca.put("shared", {"x": data})
    results, errors = [], []

    def reader():
        with b.client() as cb:
            try:
                results.append(cb.get("shared", source="A", keep=True, timeout=10)["x"])
            except kvd.KvdError as exc:
                errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(results) == 4
    assert all(torch.equal(r, data) for r in results)


def test_get_returns_meta_on_request(daemons):
    a, b = daemons.pair()
    with a.client() as ca, b.client() as cb:
        ca.put("with-meta", {"x": torch.ones(3)}, dest="B", meta={"kv_layout": {"tp_rank": 1}, "note": "hi"})
        tensors, meta = cb.get("with-meta", with_meta=True)
        assert meta == {"kv_layout": {"tp_rank": 1}, "note": "hi"} and tensors["x"].sum().item() == 3


def _thread_minor_faults(pid: int, name: str) -> int:
    import os

    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        if stat[stat.index("(") + 1:stat.rindex(")")] == name:
            total += int(stat.rsplit(")", 1)[1].split()[7])
    return total


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="glibc malloc tuning")
def test_receiver_reuses_its_receive_buffers(daemons):
    """ZeroMQ mallocs a buffer per received chunk; the daemon keeps freed heap so those pages are
    not faulted in and zeroed again for every chunk (it was 10-25 % of all pages received)."""
    a, b = daemons.pair(pool_size="256MiB")
    data = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8)
    with a.client() as ca, b.client() as cb:
        for i in range(2):  # warm up: the heap grows once
            ca.put(f"warm-{i}", {"x": data}, dest="B")
            cb.delete(f"warm-{i}")
        before = _thread_minor_faults(b.pid, "ZMQbg/IO/0")
        for i in range(3):
            ca.put(f"big-{i}", {"x": data}, dest="B")
            assert torch.equal(cb.get(f"big-{i}")["x"], data)
        faults = _thread_minor_faults(b.pid, "ZMQbg/IO/0") - before
    pages = 3 * (64 << 20) // 4096
    assert faults < pages // 20, f"{faults} page faults receiving {pages} pages"


def test_malloc_tuning_steps_aside_for_the_operators(monkeypatch):
    from kvd.daemon.daemon import keep_receive_buffers

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")
    assert keep_receive_buffers() is False


def _push_in_background(client, request_id: str, kv: dict) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def push() -> None:
        try:
            client.put(request_id, kv, dest="B")
            result["ok"] = True
        except kvd.KvdError as exc:
            result["error"] = exc

    thread = threading.Thread(target=push)
    thread.start()
    return thread, result


def _until_receiving(cb, request_id: str) -> None:
    eventually(lambda: any(e["request_id"] == request_id and e["state"] == "receiving" for e in cb.list()), 10)


@pytest.mark.parametrize("deleted_on", ["sender", "receiver"])
def test_delete_during_a_push_aborts_it_on_both_daemons(daemons, deleted_on):
    # README: `delete` of a request being pushed aborts the transfer on both daemons. A
    # committed push went on (deleted on the sender), or failed with a misleading BadRequest
    # at its next chunk (deleted on the receiver). The other side is stopped meanwhile, so the
    # transfer is certainly in the middle.
    import signal

    a, b = daemons.pair(pool_size="256MiB")
    big = torch.randint(0, 256, (96 << 20,), dtype=torch.uint8)
    with a.client() as ca, b.client() as cb:
        thread, result = _push_in_background(ca, "doomed", {"x": big})
        _until_receiving(cb, "doomed")
        other = b if deleted_on == "sender" else a
        other.kill(signal.SIGSTOP)
        try:
            deleter = a.client() if deleted_on == "sender" else b.client()
            with deleter as c:
                assert c.delete("doomed") is True
        finally:
            other.kill(signal.SIGCONT)
        thread.join(30)
        assert isinstance(result.get("error"), kvd.NotFound), result
        assert f"was deleted on {'A' if deleted_on == 'sender' else 'B'}" in str(result["error"])
        for c in (ca, cb):
            eventually(lambda c=c: c.stats()["pool"]["used_bytes"] == 0 and c.stats()["entries"] == 0, 10)
        ca.put("after", {"x": big[:1024]}, dest="B")  # both still serve
        assert torch.equal(cb.get("after")["x"], big[:1024])


def test_a_waiting_pull_whose_reader_left_is_called_off(daemons):
    # README: a get still waiting when its client left leases nothing, and the entry stays
    # readable by others. A pull used to go on without its reader and move the entry here.
    import subprocess
    import sys

    a, b = daemons.pair()
    reader = subprocess.Popen([sys.executable, "-c", (
        "import kvd, sys; kvd.Client(sys.argv[1]).get('later', source='A', timeout=600)"), b.socket])
    with a.client() as ca, b.client() as cb:
        eventually(lambda: cb.stats()["transfers_in_flight"] == 1, 20)  # the pull waits on A
        reader.kill()
        reader.wait(10)
        eventually(lambda: cb.stats()["transfers_in_flight"] == 0, 10)
        kv = {"x": torch.arange(1000)}
        ca.put("later", kv)
        time.sleep(0.5)  # time enough for a pull still running to take it
        assert torch.equal(ca.get("later", keep=True)["x"], kv["x"])  # still A's, readable here
        assert cb.stats()["entries"] == 0 and cb.stats()["pool"]["used_bytes"] == 0
        assert torch.equal(cb.get("later", source="A")["x"], kv["x"])  # and a new pull gets it


def test_a_link_closed_on_purpose_is_no_lost_peer(daemons, tmp_path):
    """When a daemon closes its link (an idle ad-hoc link after 60 s, a peer removed by SIGHUP),
    the other side hears the disconnect and says so at INFO: a healthy node is never reported
    "lost" (alerts key on that word)."""
    import signal

    b = daemons.start("B", extra=["--heartbeat-interval", "0.3s", "--heartbeat-timeout", "1.5s"])
    config = tmp_path / "a.toml"
    config.write_text(f'[peers]\nB = "{b.listen}"\n')
    a = daemons.start("A", extra=["--config", str(config)])
    with a.client() as ca, b.client() as cb:
        ca.put("before", {"x": torch.arange(10)}, dest="B")
        assert torch.equal(cb.get("before")["x"], torch.arange(10))
    config.write_text("")
    a.proc.send_signal(signal.SIGHUP)
    eventually(lambda: "peer A (connected to us) disconnected" in b.log(), timeout=10)
    time.sleep(1.5 + 1.0)  # past B's heartbeat timeout
    assert "lost" not in b.log(), b.log()[-2000:]


@pytest.mark.frames_only  # (a raw ZeroMQ peer reads the frames: a NIXL daemon refuses it)
@pytest.mark.parametrize("features", [[], [p.INLINE_OFFER]], ids=["v1 peer", "inline peer"])
def test_a_small_entry_travels_inside_its_offer_only_to_a_peer_that_says_it_takes_that(daemons, features):
    """The holder answers a pull of a one-chunk entry with one message (offer with the bytes inside)
    to a peer whose hello lists inline_offer, and with offer + chunk to one that does not (a v1 peer)."""
    import zmq

    from kvd.wire.checksum import digest

    holder = daemons.start("H")
    data = torch.randint(0, 256, (3000,), dtype=torch.uint8)
    with holder.client() as c:
        c.put("small", {"x": data})
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(holder.listen)
    try:
        sock.send_multipart(p.encode(p.PeerHello(node_id="raw", incarnation=1, features=features)))
        assert sock.poll(5000)
        hello_ok = p.decode(sock.recv_multipart())
        assert isinstance(hello_ok, p.PeerHelloOk) and p.INLINE_OFFER in hello_ok.features
        sock.send_multipart(p.encode(p.Pull(xfer=5, request_id="small", timeout=5.0, keep=False)))
        got = []
        while sock.poll(1000):
            got.append(p.decode(sock.recv_multipart()))
        offer = got[0]
        assert isinstance(offer, p.Offer) and offer.sealed
        if features:
            assert len(got) == 1 and offer.lengths == [3000]
            payload = offer.payload
        else:
            assert offer.lengths is None and [type(m) for m in got] == [p.Offer, p.Chunk]
            payload = got[1].payload
        assert b"".join(bytes(f) for f in payload) == data.numpy().tobytes()
        assert digest(offer.checksum, payload) == (offer.digest if features else got[1].digest)
        sock.send_multipart(p.encode(p.Done(xfer=5)))
        with holder.client() as c:
            eventually(lambda: c.stats()["entries"] == 0)  # pulled without keep: the holder lets go
    finally:
        sock.close()


@pytest.mark.frames_only  # (a raw ZeroMQ peer reads the frames: a NIXL daemon refuses it)
@pytest.mark.parametrize("size", [1000, 4 << 20, (4 << 20) + 1], ids=["small", "one chunk", "two chunks"])
def test_a_put_with_a_destination_sends_an_entry_of_one_chunk_inside_its_offer(daemons, size):
    """The push side: a put(dest=B) of an entry that fits one chunk (the default 4 MiB) reaches
    a peer that takes inline offers as that one offer; a bigger one as offer + chunks. The peer
    here is a bare ROUTER that answers hello and done; the client's put returns on its done. Two
    puts: the first waits for the link's handshake, the second finds the link up (its offer goes
    the moment the put arrives, so its bytes must be queued by then)."""
    import zmq

    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    a = daemons.start("A", peers={"B": f"tcp://127.0.0.1:{port}"})
    data = torch.randint(0, 256, (size,), dtype=torch.uint8)
    received: list[p.Message] = []

    def peer() -> None:
        done = 0
        while done < 2 and router.poll(10_000):
            ident, *frames = router.recv_multipart()
            msg = p.decode(frames)
            received.append(msg)
            if isinstance(msg, p.PeerHello):
                router.send_multipart([ident, *p.encode(p.PeerHelloOk(node_id="B", incarnation=9,
                                                                      features=[p.INLINE_OFFER]))])
            elif isinstance(msg, p.Offer) and msg.lengths is None and size > 2 * msg.chunk_size:
                router.send_multipart([ident, *p.encode(p.Accept(xfer=msg.xfer))])
            elif (isinstance(msg, p.Offer) and msg.lengths is not None) or (
                    isinstance(msg, p.Chunk) and msg.offset + sum(msg.lengths) == size):
                router.send_multipart([ident, *p.encode(p.Done(xfer=msg.xfer))])
                done += 1

    thread = threading.Thread(target=peer)
    thread.start()
    try:
        with a.client() as ca:
            ca.put("first", {"x": data}, dest="B")
            ca.put("second", {"x": data}, dest="B")
        thread.join(10)
        offers = [m for m in received if isinstance(m, p.Offer)]
        assert [o.request_id for o in offers] == ["first", "second"]
        xfer = offers[1].xfer  # the put on the established link
        transfer = [m for m in received if isinstance(m, (p.Offer, p.Chunk)) and m.xfer == xfer]
        inline = size <= 4 << 20
        assert [type(m) for m in transfer] == ([p.Offer] if inline else [p.Offer, p.Chunk, p.Chunk])
        assert (transfer[0].lengths is not None) == inline
        parts = [transfer[0]] if inline else transfer[1:]
        assert b"".join(bytes(f) for m in parts for f in m.payload) == data.numpy().tobytes()
    finally:
        router.close()
