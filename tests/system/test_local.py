"""Local handoff through one real daemon: put/get, dtypes, out=, keep, errors, ttl, pool full."""
from __future__ import annotations

import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import kvd
from kvd.client.tensors import TORCH_DTYPES
from kvd.testing.daemons import eventually


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def special_values(dtype: torch.dtype, shape=(3, 5, 7)) -> torch.Tensor:
    """Random bytes reinterpreted as dtype: covers NaN payloads, infinities, -0.0, subnormals."""
    g = torch.Generator().manual_seed(1234)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (int(np.prod(shape)) * itemsize,), dtype=torch.uint8, generator=g)
    t = raw.view(dtype).reshape(shape).clone()
    if dtype.is_floating_point and itemsize >= 2:
        flat = t.view(-1)
        flat[0] = -0.0
        flat[1] = float("nan")
    return t


@pytest.mark.parametrize("dtype_name", list(TORCH_DTYPES))
def test_every_dtype_round_trips_bit_exact(client, dtype_name):
    dtype = TORCH_DTYPES[dtype_name]
    kv = {"layer.0.k": special_values(dtype), "layer.0.v": special_values(dtype, (2, 1, 64))}
    client.put(f"dtype-{dtype_name}", kv)
    got = client.get(f"dtype-{dtype_name}")
    assert set(got) == set(kv)
    for name, tensor in kv.items():
        assert got[name].dtype == dtype and got[name].shape == tensor.shape
        assert bits(got[name]) == bits(tensor)


def test_nan_payload_and_negative_zero_survive(client):
    payload_nan = struct.unpack("<f", struct.pack("<I", 0x7FC0BEEF))[0]
    t = torch.tensor([payload_nan, -0.0, float("-inf"), 1e-45], dtype=torch.float32)
    client.put("nan", {"x": t})
    got = client.get("nan")["x"]
    assert bits(got) == bits(t)
    assert got.view(torch.int32)[0].item() == 0x7FC0BEEF


def test_shapes_scalars_and_empty_tensors(client):
    kv = {
        "scalar": torch.tensor(3.5, dtype=torch.float16),
        "empty": torch.empty(0, 8, dtype=torch.bfloat16),
        "vector": torch.arange(10, dtype=torch.int64),
        "deep": torch.randn(2, 1, 3, 1, 2, 1, 2, 3),
    }
    client.put("shapes", kv)
    got = client.get("shapes")
    for name, tensor in kv.items():
        assert got[name].shape == tensor.shape and bits(got[name]) == bits(tensor)


def test_numpy_and_non_contiguous_inputs(client):
    arr = np.arange(24, dtype=np.float32).reshape(4, 6)
    strided = torch.randn(6, 8).t()  # not contiguous
    client.put("np", {"a": arr, "s": strided})
    got = client.get("np")
    assert np.array_equal(got["a"].numpy(), arr)
    assert torch.equal(got["s"], strided)


def test_get_into_preallocated_out(client):
    k = torch.randn(4, 16, 64, dtype=torch.bfloat16)
    v = torch.randn(4, 16, 64, dtype=torch.bfloat16)
    client.put("out", {"k": k, "v": v})
    out_k = torch.zeros_like(k)
    ptr = out_k.data_ptr()
    got = client.get("out", out={"k": out_k})
    assert got["k"] is out_k and out_k.data_ptr() == ptr
    assert torch.equal(out_k.view(torch.int16), k.view(torch.int16))
    assert torch.equal(got["v"].view(torch.int16), v.view(torch.int16))


def test_out_mismatch_is_bad_request_and_keeps_the_entry(client):
    client.put("mm", {"k": torch.ones(4, 4)})
    with pytest.raises(kvd.BadRequest, match="holds"):
        client.get("mm", out={"k": torch.zeros(4, 5)})
    with pytest.raises(kvd.BadRequest, match="does not hold"):
        client.get("mm", out={"nope": torch.zeros(1)})
    assert torch.equal(client.get("mm")["k"], torch.ones(4, 4))


def test_get_consumes_unless_keep(client):
    client.put("keep", {"x": torch.ones(3)})
    client.get("keep", keep=True)
    client.get("keep", keep=True)
    assert client.stats()["entries"] == 1
    client.get("keep")
    assert client.stats()["entries"] == 0
    assert client.stats()["pool"]["used_bytes"] == 0
    with pytest.raises(kvd.NotFound):
        client.get("keep", timeout=0)


def test_not_found_and_timeout(client):
    with pytest.raises(kvd.NotFound, match="not found"):
        client.get("missing", timeout=0)
    start = time.monotonic()
    with pytest.raises(kvd.Timeout) as timed_out:
        client.get("missing", timeout=0.3)
    assert 0.25 < time.monotonic() - start < 5
    # the daemon's own error, naming it; not "the daemon did not answer"
    assert "did not arrive" in str(timed_out.value) and timed_out.value.remote == client.info.node_id


def test_get_waits_for_a_later_put(daemon):
    result = {}

    def reader():
        with daemon.client() as c:
            result["kv"] = c.get("later", timeout=10)

    thread = threading.Thread(target=reader)
    thread.start()
    with daemon.client() as c:
        eventually(lambda: c.stats()["waiting_reads"] == 1)  # the get waits (else it would find the entry)
        c.put("later", {"x": torch.arange(5)})
    thread.join(10)
    assert torch.equal(result["kv"]["x"], torch.arange(5))


def test_delete_and_duplicate(client):
    client.put("dup", {"x": torch.ones(2)})
    with pytest.raises(kvd.AlreadyExists):
        client.put("dup", {"x": torch.ones(2)})
    assert client.delete("dup") is True
    assert client.delete("dup") is False
    client.put("dup", {"x": torch.zeros(2)})
    assert torch.equal(client.get("dup")["x"], torch.zeros(2))


def test_bad_requests_are_rejected_cleanly(client):
    with pytest.raises(kvd.BadRequest, match="dtype"):
        client.put("bad", {"x": torch.ones(2, dtype=torch.complex64)})
    with pytest.raises(kvd.BadRequest):
        client.put("bad", {})
    with pytest.raises(kvd.BadRequest, match="request id"):
        client.put("", {"x": torch.ones(2)})
    with pytest.raises(kvd.BadRequest, match="request id"):
        client.put("x" * 1000, {"x": torch.ones(2)})
    with pytest.raises(kvd.BadRequest):
        client.put("bad", {"x": [1, 2, 3]})
    with pytest.raises(kvd.BadRequest, match="ttl"):
        client.put("bad", {"x": torch.ones(2)}, ttl=-1)
    assert client.stats()["pool"]["used_bytes"] == 0
    client.put("good", {"x": torch.ones(2)})
    assert torch.equal(client.get("good")["x"], torch.ones(2))


def test_pool_full_then_recovery_after_delete(client):
    capacity = client.stats()["pool"]["capacity_bytes"]  # 64 MiB
    chunk = torch.zeros(16 << 20, dtype=torch.uint8)
    for i in range(3):
        client.put(f"fill-{i}", {"x": chunk})
    with pytest.raises(kvd.PoolFull, match="pool full"):
        client.put("too-much", {"x": torch.zeros(capacity // 2, dtype=torch.uint8)})
    assert client.stats()["entries"] == 3
    client.delete("fill-0")
    client.delete("fill-1")
    client.put("too-much", {"x": torch.ones(capacity // 2, dtype=torch.uint8)})
    assert client.get("too-much")["x"].sum().item() == capacity // 2


def test_fragmented_pool_still_serves_what_fits(client):
    block = torch.zeros(64 << 10, dtype=torch.uint8)  # one block each
    for i in range(64):
        client.put(f"frag-{i}", {"x": block})
    for i in range(0, 64, 2):
        client.delete(f"frag-{i}")
    big = torch.randint(0, 256, (20 * (64 << 10),), dtype=torch.uint8)  # needs scattered blocks
    client.put("scattered", {"x": big, "y": big[:1000]})
    got = client.get("scattered")
    assert torch.equal(got["x"], big) and torch.equal(got["y"], big[:1000])


def test_ttl_expiry_reclaims_space(client):
    client.put("short", {"x": torch.ones(1 << 20, dtype=torch.uint8)}, ttl=0.3)
    assert client.stats()["pool"]["used_bytes"] > 0
    # (gone at the first housekeeping sweep after 0.3 s)
    eventually(lambda: client.stats()["entries"] == 0 and client.stats()["pool"]["used_bytes"] == 0)
    stats = client.stats()
    assert stats["entries"] == 0 and stats["pool"]["used_bytes"] == 0
    assert stats["expired_total"] == 1
    with pytest.raises(kvd.NotFound):
        client.get("short", timeout=0)


def test_async_client_concurrent_requests(daemon):
    import asyncio

    async def main():
        async with kvd.AsyncClient(daemon.socket) as c:
            tensors = {f"r{i}": torch.full((1000,), i, dtype=torch.int32) for i in range(50)}
            await asyncio.gather(*(c.put(rid, {"x": t}) for rid, t in tensors.items()))
            got = await asyncio.gather(*(c.get(rid) for rid in tensors))
            for t, kv in zip(tensors.values(), got):
                assert torch.equal(kv["x"], t)
            return await c.stats()

    stats = asyncio.run(main())
    assert stats["entries"] == 0 and stats["pool"]["used_bytes"] == 0


def test_an_async_operation_leaves_the_event_loop_nothing_to_clean_up(daemon):
    """A put, get or delete creates no task: an operation's steps run to their end, not left
    suspended for the loop's async-generator finalizer (a task and a self-pipe wake-up each)."""
    import asyncio

    async def main():
        loop = asyncio.get_running_loop()
        created: list[str] = []

        def counting_factory(loop, coro, **kwargs):
            created.append(getattr(coro, "__qualname__", repr(coro)))
            return asyncio.Task(coro, loop=loop, **kwargs)

        async with kvd.AsyncClient(daemon.socket) as c:
            await c.put("warm-up", {"x": torch.zeros(4)})
            loop.set_task_factory(counting_factory)
            for i in range(20):
                await c.put(f"r{i}", {"x": torch.full((1000,), i)})
                assert torch.equal((await c.get(f"r{i}", keep=True))["x"], torch.full((1000,), i))
                assert await c.delete(f"r{i}")
            for _ in range(3):
                await asyncio.sleep(0)  # a finalizer's task is scheduled from a callback: let it come
            loop.set_task_factory(None)
            await c.delete("warm-up")
        return created

    assert asyncio.run(main()) == []


def test_an_async_call_times_out_and_its_late_reply_gives_back_what_it_holds(daemon):
    """A stopped daemon: the call fails after reply_timeout; the get's lease, granted once the
    daemon runs again, is given back by the late reply (the entry is still there, whole)."""
    import asyncio
    import signal

    async def main():
        async with kvd.AsyncClient(daemon.socket, reply_timeout=0.5) as c:
            await c.put("kept", {"x": torch.arange(10)})
            daemon.kill(signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                with pytest.raises(kvd.Timeout, match="did not answer get"):
                    await c.get("kept", timeout=0)
                took = time.monotonic() - t0
            finally:
                daemon.kill(signal.SIGCONT)
            await c.stats()  # a round trip: the late reply, and the release it sends, are in
            got = await c.get("kept")
            return took, got, await c.stats()

    took, got, stats = asyncio.run(main())
    assert 0.4 < took < 3.0
    assert torch.equal(got["x"], torch.arange(10))
    assert stats["entries"] == 0 and stats["pool"]["used_bytes"] == 0


def test_no_daemon_is_a_clear_error(tmp_path):
    with pytest.raises(kvd.KvdError, match="no kvd daemon"):
        kvd.Client(f"ipc://{tmp_path}/nothing.sock").connect()


async def _lost(c: kvd.AsyncClient, timeout: float = 5.0) -> None:
    """Until the client's loop has seen its connection end (a restarted daemon's old socket)."""
    import asyncio

    deadline = time.monotonic() + timeout
    while c._lost is None:
        assert time.monotonic() < deadline, "the client never saw its connection end"
        await asyncio.sleep(0.01)


def _restart_in_place(daemons, old):
    """SIGTERM a daemon, then start a new one on the same client socket (what systemd does)."""
    assert old.stop() == 0
    new = daemons.start(old.node_id, extra=["--socket", old.socket], wait=False)
    new.socket = old.socket  # the last --socket wins
    from kvd.testing.daemons import wait_ready

    wait_ready(new)
    return new


def test_a_client_carries_on_across_a_daemon_restart(daemons):
    d = daemons.start("A")
    with d.client() as c:
        c.put("before", {"x": torch.arange(10)})
        first = c.info.incarnation
        d = _restart_in_place(daemons, d)
        # no error and no manual reconnect: the next call notices and maps the new daemon's pool
        c.put("after", {"x": torch.arange(20)})
        assert c.info.incarnation != first
        assert torch.equal(c.get("after")["x"], torch.arange(20))
        with pytest.raises(kvd.NotFound):
            c.get("before", timeout=0)  # the old daemon's entries went with it


def test_an_async_client_carries_on_across_a_daemon_restart(daemons):
    import asyncio

    d = daemons.start("A")

    async def main(d):
        async with d.async_client() as c:
            await c.put("before", {"x": torch.arange(10)})
            first = c.info.incarnation
            d = await asyncio.to_thread(_restart_in_place, daemons, d)
            await _lost(c)
            await c.put("after", {"x": torch.arange(20)})
            assert c.info.incarnation != first
            assert torch.equal((await c.get("after"))["x"], torch.arange(20))

    asyncio.run(main(d))


def test_a_daemon_dying_mid_call_fails_the_call_at_once(daemons):
    import asyncio

    d = daemons.start("A")
    with d.client() as c:
        c.stats()
        killer = threading.Timer(0.3, d.proc.kill)
        killer.start()
        started = time.monotonic()
        with pytest.raises(kvd.KvdError, match=r"connection to the kvd daemon .* was lost"):
            c.get("never-put", timeout=20)  # waits on the daemon, which is killed meanwhile
        assert time.monotonic() - started < 5  # not the 20 s timeout, nor the reply grace
        killer.join()
    d.proc.wait(10)  # reaped: the client saw its sockets close while it was still exiting
    d2 = daemons.start("B")
    killer = threading.Timer(0.3, d2.proc.kill)

    async def waiting_async_get():
        async with d2.async_client() as c:
            killer.start()
            await c.get("never-put", timeout=20)

    started = time.monotonic()
    with pytest.raises(kvd.KvdError, match=r"connection to the kvd daemon .* was lost"):
        asyncio.run(waiting_async_get())
    assert time.monotonic() - started < 5
    killer.join()
    d2.proc.wait(10)  # (else the fixture may find it still exiting, SIGTERM it, and call -9 unclean)


def test_local_socket_on_tcp(daemons):
    """--socket tcp://HOST:PORT (a client in another network namespace of the same host)."""
    import asyncio

    from kvd.testing.daemons import free_port, wait_ready

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    d = daemons.start("T", extra=["--socket", endpoint], wait=False)
    d.socket = endpoint  # the last --socket wins
    wait_ready(d)
    with kvd.Client(endpoint) as c:
        c.put("over-tcp", {"x": torch.arange(100)})
        assert c.stats()["local_clients"] >= 1  # (the readiness probe may not be counted out yet)

    async def main():
        async with kvd.AsyncClient(endpoint) as c:
            return await c.get("over-tcp")

    assert torch.equal(asyncio.run(main())["x"], torch.arange(100))


def test_a_stream_opened_before_a_daemon_restart_never_writes_into_the_new_pool(daemons):
    # its offsets were the old daemon's: in the new pool they are somebody else's entry
    d = daemons.start("A")
    layers = {f"l{i}": torch.full((1 << 20,), -7.0) for i in range(4)}
    with d.client() as producer, d.client() as other:
        stream = producer.put_stream("stream", layers)
        stream.write({"l0": layers["l0"]})
        d = _restart_in_place(daemons, d)
        victim = torch.arange(4 << 20, dtype=torch.float32)
        other.put("victim", {"x": victim})
        producer.stats()  # any call reconnects the producer's client to the new daemon
        with pytest.raises(kvd.KvdError, match="connection to the daemon was lost"):
            stream.write({"l1": layers["l1"]})
        with pytest.raises(kvd.KvdError, match="connection to the daemon was lost"):
            stream.commit()
        stream.abort()  # nothing to abort on the new daemon, and nothing sent there by mistake
        assert torch.equal(other.get("victim")["x"], victim)


def test_an_async_stream_across_a_daemon_restart_fails_without_writing(daemons):
    import asyncio

    d = daemons.start("A")
    victim = torch.arange(4 << 20, dtype=torch.float32)

    async def scenario() -> None:
        nonlocal d
        async with kvd.AsyncClient(d.socket) as c:
            stream = await c.put_stream("stream", {f"l{i}": ((1 << 20,), torch.float32) for i in range(4)})
            await stream.write({"l0": torch.full((1 << 20,), -7.0)})
            d = _restart_in_place(daemons, d)
            with d.client() as other:
                other.put("victim", {"x": victim})
            await _lost(c)
            await c.stats()  # another task's call reconnects the shared client meanwhile
            with pytest.raises(kvd.KvdError, match="connection to the daemon was lost"):
                await stream.write({"l1": torch.full((1 << 20,), -7.0)})
            await stream.abort()

    asyncio.run(scenario())
    with d.client() as other:
        assert torch.equal(other.get("victim")["x"], victim)


def test_a_client_inherited_across_fork_connects_anew_in_the_child(daemon):
    # the parent's connection, its scratch loan and its request numbers stay the parent's
    import os

    with daemon.client() as c:
        c.put("warm", {"x": torch.zeros(1024)})  # the reply lends this connection scratch blocks
        pid = os.fork()
        if pid == 0:  # the child: uses the inherited client
            try:
                c.put("child", {"x": torch.full((1024,), 2.0)})
                ok = torch.equal(c.get("child")["x"], torch.full((1024,), 2.0))
                os._exit(0 if ok else 1)
            except BaseException:
                os._exit(2)
        c.put("parent", {"x": torch.ones(1024)})  # into the loan the child must not have used
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert torch.equal(c.get("parent")["x"], torch.ones(1024))
        c.delete("warm")


def test_a_meta_tensor_as_out_is_refused_and_the_entry_kept(client):
    client.put("kept", {"x": torch.arange(16)})
    with pytest.raises(kvd.BadRequest, match="meta tensor"):
        client.get("kept", out={"x": torch.empty(16, dtype=torch.int64, device="meta")})
    assert torch.equal(client.get("kept")["x"], torch.arange(16))


def test_a_cancelled_async_get_gives_back_what_its_late_reply_leased(daemon):
    # asyncio.wait_for around a get that was still waiting: the daemon answers it later with a
    # lease; the client gives that lease back at once instead of holding it for the lease timeout
    import asyncio

    async def scenario() -> float:
        async with kvd.AsyncClient(daemon.socket) as c:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(c.get("late", timeout=30), 0.2)
            await c.put("late", {"x": torch.arange(8)})  # answers the abandoned get: leased to it
            started = time.monotonic()
            got = await c.get("late", timeout=20)
            assert torch.equal(got["x"], torch.arange(8))
            return time.monotonic() - started

    assert asyncio.run(scenario()) < 5  # not the 30 s lease timeout


def test_calls_inside_a_get_stream_loop_leave_the_stream_its_messages(daemon):
    # a stats/put inside `for group in c.get_stream(...)` on the same Client reads the socket;
    # the stream's messages it meets are kept for the stream (they were dropped: the loop hung)
    layers = {f"l{i}": torch.full((1024,), float(i)) for i in range(4)}
    with daemon.client() as producer, kvd.Client(daemon.socket, reply_timeout=2) as c:
        c.transfer_wait = 3  # an old-style hang shows up as a Timeout in seconds
        stream = producer.put_stream("layered", layers)

        def produce() -> None:
            for name, value in layers.items():
                time.sleep(0.05)
                stream.write({name: value})
            stream.commit()

        writer = threading.Thread(target=produce)
        writer.start()
        got = {}
        for group in c.get_stream("layered", timeout=10):
            got.update(group)
            c.stats()
            c.put(f"side-{len(got)}", {"x": torch.ones(4)})
        writer.join(10)
        assert set(got) == set(layers) and all(torch.equal(got[n], layers[n]) for n in layers)
        for key in [e["request_id"] for e in c.list() if e["request_id"].startswith("side-")]:
            c.delete(key)


def test_a_stream_used_in_a_forked_child_fails_there_and_stays_the_parents(daemon):
    import os

    layers = {f"l{i}": torch.full((1024,), float(i)) for i in range(2)}
    with daemon.client() as c:
        stream = c.put_stream("forked-stream", layers)
        pid = os.fork()
        if pid == 0:
            try:
                stream.write({"l0": torch.full((1024,), -1.0)})
                os._exit(1)  # it wrote into the parent's reservation
            except kvd.KvdError:
                os._exit(0)
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        stream.write(layers)
        stream.commit()
        got = c.get("forked-stream")
        assert all(torch.equal(got[n], layers[n]) for n in layers)


def test_a_request_over_the_header_limits_gets_its_error_at_once(client):
    # the daemon cannot decode it, but still finds which request it was (not a 30 s silence)
    started = time.monotonic()
    with pytest.raises(kvd.ProtocolError, match=r"max_str_len|exceeds"):
        client.put("too-long", {"n" * 70000: torch.ones(1)})
    assert time.monotonic() - started < 5
    client.put("fine", {"x": torch.ones(1)})
    assert client.get("fine")["x"].item() == 1


# requests the daemon could not decode, and meta msgpack cannot carry: refused in the client, as
# BadRequest, before anything is sent (they used to come back as a ProtocolError, with a warning
# in the daemon's log, or escape as a bare TypeError)
BAD_REQUEST_IDS = [7, None, b"req", ("req",), ""]
BAD_METAS = [
    {"dtype": torch.float16},        # msgpack cannot encode it: TypeError
    {"scale": np.float32(0.5)},      # nor this
    {"n": 1 << 64},                  # OverflowError
    {1: "an int key"},               # encodes, but the daemon decodes with str keys only
    {"blob": b"x" * (65 << 10)},     # encodes, over the daemon's bytes limit (64 KiB)
    ["not", "a", "dict"],            # encodes, but meta is a dict
]


def _calls_with_a_request_id(rid, meta=None):
    """Every call that names a request id (the puts with meta), as f(client) -> result."""
    cache = torch.zeros(4, 2)
    return {
        "put": lambda c: c.put(rid, {"x": torch.ones(2)}, meta=meta),
        "put_blocks": lambda c: c.put_blocks(rid, {"x": cache}, [0, 1], meta=meta),
        "put_stream": lambda c: c.put_stream(rid, {"x": ((2,), torch.float32)}, meta=meta),
        "get": lambda c: c.get(rid, timeout=0),
        "get_blocks": lambda c: c.get_blocks(rid, {"x": cache}, [0, 1], timeout=0),
        "get_stream": lambda c: c.get_stream(rid, timeout=0),
        "delete": lambda c: c.delete(rid),
    }


def _bad_calls():
    for rid in BAD_REQUEST_IDS:
        for name, call in _calls_with_a_request_id(rid).items():
            yield f"{name}({rid!r})", "request id", call
    for meta in BAD_METAS:
        for name in ("put", "put_blocks", "put_stream"):
            yield f"{name}(meta={meta!r:.40})", "meta", _calls_with_a_request_id("req", meta)[name]


def _nothing_reached_the_daemon(c_stats, daemon, log_before):
    assert c_stats["counters"]["errors"] == 0 and c_stats["pool"]["used_bytes"] == 0
    assert "WARNING" not in daemon.log()[len(log_before):]


def test_a_bad_request_id_or_meta_is_refused_before_it_is_sent(daemon):
    log_before = daemon.log()
    with daemon.client() as c:
        for label, what, call in _bad_calls():
            with pytest.raises(kvd.BadRequest, match=what):
                result = call(c)
                if label.startswith("get_stream"):
                    list(result)
        _nothing_reached_the_daemon(c.stats(), daemon, log_before)
        c.put("req", {"x": torch.ones(2)}, meta={"layout": [1, 2]})  # the connection is as good as before
        assert c.get("req", with_meta=True)[1] == {"layout": [1, 2]}


def test_the_async_client_refuses_them_too(daemon):
    import asyncio

    async def main():
        async with daemon.async_client() as c:
            for label, what, call in _bad_calls():
                with pytest.raises(kvd.BadRequest, match=what):
                    result = call(c)
                    if label.startswith("get_stream"):
                        async for _ in result:
                            pass
                    else:
                        await result
            stats = await c.stats()
            await c.put("req", {"x": torch.ones(2)})
            assert torch.equal((await c.get("req"))["x"], torch.ones(2))
            return stats

    log_before = daemon.log()
    _nothing_reached_the_daemon(asyncio.run(main()), daemon, log_before)


def test_a_claim_given_back_wakes_the_next_reader_at_once(daemons):
    """A consuming read that gives the entry back (nothing delivered) hands it to a reader that
    was waiting for it then, not when that reader's own timeout is up."""
    from kvd.testing.daemons import raw_connection
    from kvd.wire import protocol as p

    d = daemons.start("A")
    with d.client() as c:
        c.put("given-back", {"x": torch.arange(1024, dtype=torch.int32)})
        conn = raw_connection(d.socket)
        conn.send(p.encode(p.Hello(req=1, client="first")))
        p.decode(conn.receive(5))
        conn.send(p.encode(p.Get(req=2, request_id="given-back", timeout=5.0)))
        slots = p.decode(conn.receive(5))
        assert isinstance(slots, p.GetSlots)  # claimed: the next consuming read waits for it
        result = {}

        def second_reader():
            started = time.monotonic()
            with d.client() as other:
                result["x"] = other.get("given-back", timeout=20)["x"]
            result["waited"] = time.monotonic() - started

        thread = threading.Thread(target=second_reader)
        thread.start()
        eventually(lambda: c.stats()["waiting_reads"] == 1)  # the second reader waits...
        assert "x" not in result  # ...as the entry is still claimed
        conn.send(p.encode(p.GetDone(req=3, request_id="given-back", token=slots.token, consume=False,
                                     reply=True)))
        assert isinstance(p.decode(conn.receive(5)), p.Ok)
        thread.join(25)
        assert torch.equal(result["x"], torch.arange(1024, dtype=torch.int32))
        assert result["waited"] < 5, f"the waiting reader had the entry only after {result['waited']:.1f} s"


def test_a_client_left_open_at_exit_ends_quietly(daemon):
    """A worker that never closes its client: the finalizer runs while the interpreter is tearing
    its modules down, and must not print a traceback then."""
    code = ("import sys, kvd, torch\n"
            f"c = kvd.Client({daemon.socket!r})\n"
            "c.put('left-open', {'x': torch.ones(4)})\n"
            "sys.modules['__main__'].keep = c\n")  # (alive until the interpreter's own teardown)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "Exception ignored" not in out.stderr and "Traceback" not in out.stderr, out.stderr
