"""A get_stream reader on the daemon that pushes a stream away is told how its read ends: with every
tensor, or that the entry went to the peer; never left waiting for an entry that has left."""
from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

import kvd
from kvd.client.connection import ask
from kvd.testing.daemons import eventually
from kvd.wire import protocol as p

LAYERS = {f"layer.{i}": torch.full((64, 256), float(i)) for i in range(8)}
LAYOUT = {name: t.to("meta") for name, t in LAYERS.items()}


def read_in_thread(daemon, request_id: str, timeout: float = 60.0) -> tuple[threading.Thread, dict]:
    """get_stream in a thread; the dict gets the tensors read and how the read ended."""
    result: dict = {"tensors": {}}

    def run():
        try:
            with daemon.client() as c:
                for group in c.get_stream(request_id, timeout=timeout):
                    result["tensors"].update(group)
            result["outcome"] = "complete"
        except kvd.KvdError as exc:
            result["outcome"] = exc
        result["ended"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def stats(daemon) -> dict:
    return ask(p.Stats(req=1), daemon.socket)


def assert_ended_well(result: dict) -> None:
    if result["outcome"] == "complete":
        assert set(result["tensors"]) == set(LAYERS)
        for name, tensor in LAYERS.items():
            assert torch.equal(result["tensors"][name], tensor)
    else:
        error = result["outcome"]
        assert isinstance(error, kvd.NotFound) and "pushed to B" in str(error), error


def test_a_reader_racing_the_commit_of_a_pushed_stream_ends_with_it(daemons):
    # the reader's get_stream comes while the producer writes every layer and commits at once:
    # whether it got to the stream before its commit or not, it ends as the push does
    a, b = daemons.pair()
    outcomes = []
    with a.client() as producer, b.client() as cb:
        for i in range(4):
            rid = f"raced-{i}"
            stream = producer.put_stream(rid, LAYOUT, dest="B")
            reader, result = read_in_thread(a, rid)
            for name, tensor in LAYERS.items():
                stream.write({name: tensor})
            stream.commit()  # (returns once B has every byte)
            reader.join(10)
            assert not reader.is_alive(), f"round {i}: the reader on A was left waiting after the push ended"
            assert_ended_well(result)
            outcomes.append(result["outcome"])
            assert torch.equal(cb.get(rid, timeout=5)["layer.7"], LAYERS["layer.7"])
        assert producer.stats()["entries"] == 0 and producer.stats()["waiting_reads"] == 0


def test_a_reader_that_comes_while_the_push_is_finishing_is_told_where_the_entry_went(daemons):
    a, b = daemons.pair()
    with a.client() as producer:
        stream = producer.put_stream("leaving", LAYOUT, dest="B")
        for name, tensor in LAYERS.items():
            stream.write({name: tensor})
        b.kill(signal.SIGSTOP)  # B cannot acknowledge: the push stays in flight after the commit
        try:
            committer = threading.Thread(target=stream.commit, daemon=True)
            committer.start()
            eventually(lambda: stats(a)["entries_by_state"]["claimed"] == 1, timeout=10)
            reader, result = read_in_thread(a, "leaving")
            reader.join(10)
            assert not reader.is_alive(), "the reader on A waits for an entry that is leaving for B"
        finally:
            b.kill(signal.SIGCONT)
        committer.join(30)
        assert not committer.is_alive()
    error = result["outcome"]
    assert isinstance(error, kvd.NotFound), error
    assert "pushed to B" in str(error) and "no longer on A" in str(error), error
    with b.client() as cb:
        assert torch.equal(cb.get("leaving", timeout=5)["layer.3"], LAYERS["layer.3"])


def test_a_reader_that_comes_after_the_entry_left_is_told_where_it_went(daemons):
    a, b = daemons.pair()
    with a.client() as ca, b.client() as cb:
        with ca.put_stream("gone", LAYOUT, dest="B") as stream:
            stream.write(LAYERS)
        assert ca.stats()["entries"] == 0  # the push is over: A holds nothing of it
        started = time.monotonic()
        with pytest.raises(kvd.NotFound, match="'gone' was pushed to B and is no longer on A"):
            list(ca.get_stream("gone", timeout=60))
        assert time.monotonic() - started < 5
        # an entry pulled away (not kept) is told the same way; one put here again is read as any
        ca.put("taken", LAYERS)
        assert torch.equal(cb.get("taken", source="A", timeout=10)["layer.2"], LAYERS["layer.2"])
        with pytest.raises(kvd.NotFound, match="'taken' was pulled by B"):
            list(ca.get_stream("taken", timeout=60))
        ca.put("gone", LAYERS)
        assert len(list(ca.get_stream("gone", timeout=5))) >= 1
        assert ca.stats()["entries"] == 0 and ca.stats()["waiting_reads"] == 0


@pytest.mark.parametrize("late", [False, True])
def test_a_reader_following_the_pushed_stream_gets_every_tensor_at_the_commit(daemons, late):
    # a reader following the stream (since its first write, or since after its last) ends as it is
    # committed, with every tensor
    a, _b = daemons.pair()
    names = list(LAYERS)
    with a.client() as producer:
        stream = producer.put_stream("followed", LAYOUT, dest="B")
        stream.write({names[0]: LAYERS[names[0]]})
        if not late:
            reader, result = read_in_thread(a, "followed")
            eventually(lambda: len(result["tensors"]) == 1)  # it follows the stream
        for name in names[1:]:
            stream.write({name: LAYERS[name]})
        if late:
            reader, result = read_in_thread(a, "followed")
            eventually(lambda: len(result["tensors"]) == len(LAYERS))  # (not complete yet: not committed)
            assert "outcome" not in result
        stream.commit()
        committed = time.monotonic()
    reader.join(10)
    assert not reader.is_alive()
    assert result["outcome"] == "complete", result["outcome"]
    assert_ended_well(result)
    assert result["ended"] - committed < 5


@pytest.mark.parametrize("reader_first", [True, False])
def test_a_reader_of_a_stream_whose_push_is_refused_is_told_at_once(daemons, reader_first):
    # B has no room for the stream: it refuses the offer, and the put fails on A at once. A reader
    # on A (waiting for the entry before the put began, or come just after) is told so, not left
    # waiting for its timeout (it waited its whole 60 s)
    from kvd.testing.daemons import free_port, wait_ready

    pa, pb = free_port(), free_port()
    a = daemons.start("A", port=pa, peers={"B": f"tcp://127.0.0.1:{pb}"}, wait=False)
    daemons.start("B", port=pb, peers={"A": f"tcp://127.0.0.1:{pa}"}, pool_size="256KiB")
    wait_ready(a)
    with a.client() as producer:
        if reader_first:
            reader, result = read_in_thread(a, "refused")
            eventually(lambda: stats(a)["waiting_reads"] == 1)
        stream = producer.put_stream("refused", LAYOUT, dest="B")
        eventually(lambda: stats(a)["entries"] == 0, timeout=10)  # refused by B: the put is over on A
        if not reader_first:
            reader, result = read_in_thread(a, "refused")
        with pytest.raises(kvd.PoolFull):
            for name, tensor in LAYERS.items():
                stream.write({name: tensor})
            stream.commit()
        failed = time.monotonic()
        reader.join(10)
        assert not reader.is_alive(), "the reader on A waits for a stream whose push was refused"
        error = result["outcome"]
        assert isinstance(error, kvd.KvdError), error
        assert isinstance(error, kvd.NotFound) and "pushed to B and the push failed" in str(error), error
        assert "pool full" in str(error) and "not on A" in str(error), error
        assert result["ended"] - failed < 5
        assert stats(a)["entries"] == 0 and stats(a)["waiting_reads"] == 0

