"""Layer-wise streaming: layers are readable (locally and on the peer) while later ones are written."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import kvd
from kvd.testing.daemons import eventually

BOTH_PLANES = True  # (tests/system/conftest.py: each test on ZeroMQ frames and on NIXL)

LAYERS = 8


def make_layers(n: int = LAYERS, size: tuple = (64, 256)) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {f"layer.{i}": torch.randn(*size, generator=g).to(torch.bfloat16) for i in range(n)}


def layout_of(layers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.to("meta") for name, t in layers.items()}


def read_in_thread(daemon, request_id: str, arrivals: dict, **kwargs) -> threading.Thread:
    def run():
        with daemon.client() as c:
            for group in c.get_stream(request_id, **kwargs):
                for name, tensor in group.items():
                    arrivals[name] = (tensor, time.monotonic())

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def produce(client, request_id, layers, dest=None, pace=0.1) -> dict[str, float]:
    written = {}
    with client.put_stream(request_id, layout_of(layers), dest=dest) as stream:
        for name, tensor in layers.items():
            time.sleep(pace)  # "computing" the next layer
            stream.write({name: tensor})
            written[name] = time.monotonic()
    return written


def assert_streamed(layers, arrivals, written, pace):
    assert set(arrivals) == set(layers)
    for name, tensor in layers.items():
        assert torch.equal(arrivals[name][0].view(torch.int16), tensor.view(torch.int16))
    # every layer but the last was readable before the producer had written the last one
    last_write = max(written.values())
    early = [name for name in layers if arrivals[name][1] < last_write]
    assert len(early) >= LAYERS - 2, (early, arrivals, written)


def test_local_stream_is_readable_while_written(daemon):
    layers = make_layers()
    arrivals: dict = {}
    reader = read_in_thread(daemon, "local-stream", arrivals, timeout=10)
    with daemon.client() as producer:
        eventually(lambda: producer.stats()["waiting_reads"] == 1)  # the reader waits before the first write
        written = produce(producer, "local-stream", layers)
    reader.join(20)
    assert_streamed(layers, arrivals, written, 0.1)
    with daemon.client() as c:
        assert c.stats()["entries"] == 0 and c.stats()["pool"]["used_bytes"] == 0


def test_streamed_push_arrives_layer_by_layer_on_the_peer(daemons):
    a, b = daemons.pair()
    layers = make_layers()
    arrivals: dict = {}
    reader = read_in_thread(b, "pushed-stream", arrivals, timeout=10)
    with a.client() as producer:
        written = produce(producer, "pushed-stream", layers, dest="B")
        assert producer.stats()["pool"]["used_bytes"] == 0
    reader.join(20)
    assert_streamed(layers, arrivals, written, 0.1)
    # the last layer arrived within a fraction of a layer's compute time after it was written
    last = f"layer.{LAYERS - 1}"
    assert arrivals[last][1] - written[last] < 1.0
    with b.client() as cb:
        assert cb.stats()["entries"] == 0 and cb.stats()["pool"]["used_bytes"] == 0


def test_plain_get_of_a_streamed_push_waits_for_all_of_it(daemons):
    a, b = daemons.pair()
    layers = make_layers()
    with a.client() as producer, b.client() as consumer:
        produce(producer, "whole", layers, dest="B", pace=0.01)
        got = consumer.get("whole", timeout=10)
    assert all(torch.equal(got[n].view(torch.int16), t.view(torch.int16)) for n, t in layers.items())


def test_get_stream_of_a_complete_entry_and_early_exit(client):
    layers = make_layers(4)
    client.put("done-already", layers)
    groups = list(client.get_stream("done-already", keep=True))
    assert sum(len(g) for g in groups) == 4
    for _ in client.get_stream("done-already"):
        break  # stop early: the entry must not be consumed
    assert client.stats()["entries"] == 1
    got = client.get("done-already")
    assert set(got) == set(layers)


def test_stream_errors(client):
    layers = make_layers(2)
    with pytest.raises(kvd.BadRequest, match="declared"), client.put_stream("bad-shape", layout_of(layers)) as stream:
        stream.write({"layer.0": torch.zeros(3, 3)})
    with (
        pytest.raises(kvd.BadRequest, match="already written"),
        client.put_stream("twice", layout_of(layers)) as stream,
    ):
        stream.write({"layer.0": layers["layer.0"]})
        stream.write({"layer.0": layers["layer.0"]})
    with pytest.raises(kvd.BadRequest, match="not a tensor"), client.put_stream("unknown", layout_of(layers)) as stream:
        stream.write({"layer.9": layers["layer.0"]})
    stats = client.stats()
    assert stats["entries"] == 0 and stats["pool"]["used_bytes"] == 0
    with pytest.raises(kvd.NotFound):
        list(client.get_stream("nothing", timeout=0))


def test_aborted_stream_reaches_the_reader(daemon):
    layers = make_layers(4)
    errors, groups = [], []

    def reader():
        with daemon.client() as c:
            try:
                for group in c.get_stream("aborted", timeout=10):
                    groups.append(group)
            except kvd.KvdError as exc:
                errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    with (
        daemon.client() as producer, pytest.raises(RuntimeError),
        producer.put_stream("aborted", layout_of(layers)) as stream,
    ):
        stream.write({"layer.0": layers["layer.0"]})
        eventually(lambda: groups or errors)  # the reader follows the stream: it has layer.0
        assert groups and not errors, errors
        raise RuntimeError("prefill crashed")
    thread.join(10)
    assert errors and isinstance(errors[0], kvd.NotFound)
    with daemon.client() as c:
        assert c.stats()["pool"]["used_bytes"] == 0


def test_streamed_push_to_a_dead_peer_fails_at_commit(daemons):
    a = daemons.start("A", extra=["--connect-timeout", "1s"])
    layers = make_layers(2)
    with a.client() as producer:
        with (
            pytest.raises(kvd.PeerUnavailable),
            producer.put_stream("nowhere", layout_of(layers), dest="tcp://127.0.0.1:1") as stream,
        ):
            stream.write(layers)
        assert producer.stats()["pool"]["used_bytes"] == 0


def test_async_streaming(daemons):
    a, b = daemons.pair()
    layers = make_layers(4)

    async def main():
        async with a.async_client() as ca, b.async_client() as cb:
            async def consume():
                got = {}
                async for group in cb.get_stream("async-stream", timeout=10):
                    got.update(group)
                return got

            reader = asyncio.create_task(consume())
            async with await ca.put_stream("async-stream", layout_of(layers), dest="B") as stream:
                for name, tensor in layers.items():
                    await stream.write({name: tensor})
                    await asyncio.sleep(0.02)
            return await reader

    got = asyncio.run(main())
    assert all(torch.equal(got[n].view(torch.int16), t.view(torch.int16)) for n, t in layers.items())


def test_streamed_pull_hands_over_layers_as_they_land(daemons):
    a, b = daemons.pair(pool_size="256MiB")
    layers = {f"layer.{i}": torch.randint(0, 256, (8 << 20,), dtype=torch.uint8) for i in range(8)}
    with a.client() as ca, b.client() as cb:
        ca.put("pull-stream", layers)
        got, groups = {}, 0
        for group in cb.get_stream("pull-stream", source="A", timeout=10):
            got.update(group)
            groups += 1
        assert groups > 1  # handed over in pieces, not all at the end
        assert all(torch.equal(got[n], t) for n, t in layers.items())
        assert ca.stats()["entries"] == 0 and cb.stats()["entries"] == 0
        with pytest.raises(kvd.NotFound):
            list(cb.get_stream("pull-missing", source="A", timeout=0))


def test_pulling_a_stream_still_being_written_streams_too(daemons):
    """The holder offers what is written and follows with the rest as it is written: the puller's
    get_stream sees the first layers long before the writer commits."""
    a, b = daemons.pair()
    layout = {f"layer.{i}": ((1 << 16,), torch.float32) for i in range(6)}
    with a.client() as ca, b.client() as cb:
        stream = ca.put_stream("pulled-stream", layout)
        stream.write({"layer.0": torch.full((1 << 16,), 0.0)})
        arrivals = []
        started = time.monotonic()

        def read():
            for group in cb.get_stream("pulled-stream", source="A", timeout=10):
                arrivals.append((time.monotonic() - started, group))

        reader = threading.Thread(target=read)
        reader.start()
        eventually(lambda: arrivals, timeout=10)  # the pull follows the stream: layer.0 came before the others
        for i in range(1, 6):
            time.sleep(0.3)
            stream.write({f"layer.{i}": torch.full((1 << 16,), float(i))})
        committed = time.monotonic() - started
        stream.commit()
        reader.join(10)
        got = {name: t for _, group in arrivals for name, t in group.items()}
        assert all(torch.equal(got[f"layer.{i}"], torch.full((1 << 16,), float(i))) for i in range(6))
        assert arrivals[0][0] < committed - 1.0, arrivals  # the first layers came long before the commit
        assert len(arrivals) >= 3
        with pytest.raises(kvd.NotFound):
            ca.get("pulled-stream", timeout=0)  # the holder's copy moved to the puller
