"""Reads and the ledger's count of waits in process: gets and get_streams that wait, on a real daemon on this
test's event loop (and a pair, for an entry pushed away), through a raw client connection."""
from __future__ import annotations

import asyncio

from kvd.daemon.local.books import MAX_WAITS_PER_CONNECTION
from kvd.errors import BadRequest, NotFound, Timeout
from kvd.wire import protocol as p

from .inprocess import Node, run, run_pair, tensor, until
from .test_local_handlers import PAYLOAD, reserve


def test_a_get_waits_for_a_put_and_one_that_times_out_says_so(tmp_path):
    async def scenario(node: Node) -> None:
        reader, writer, late = await node.connect(), await node.connect(), await node.connect()
        await reader.send(p.Get(req=reader.req(), request_id="r", timeout=5.0))
        await late.send(p.Get(req=late.req(), request_id="never", timeout=0.1))
        await until(lambda: node.daemon.metrics.waiting_reads == 2, "both gets waiting")
        slots = await reserve(node, writer, "r")
        assert isinstance(await writer.ask(p.PutCommit(req=writer.req(), request_id="r", token=slots.token)), p.PutOk)
        got = await reader.recv()
        assert isinstance(got, p.GetSlots) and node.read(got.segments) == [PAYLOAD]
        timed_out = await late.recv()
        assert isinstance(timed_out, p.Error) and timed_out.code == Timeout.code
        assert node.daemon.metrics.waiting_reads == 0
        missing = await late.ask(p.Get(req=late.req(), request_id="never", timeout=0.0))
        assert isinstance(missing, p.Error) and missing.code == NotFound.code

    run(tmp_path, scenario)


def test_a_client_that_hangs_up_takes_its_waits_along_and_their_number_is_bounded(tmp_path):
    async def scenario(node: Node) -> None:
        greedy = await node.connect()
        for i in range(MAX_WAITS_PER_CONNECTION):
            await greedy.send(p.Get(req=greedy.req(), request_id=f"w{i % 7}", timeout=60.0))
        refused = await greedy.ask(p.Get(req=greedy.req(), request_id="one-more", timeout=60.0))
        assert isinstance(refused, p.Error) and refused.code == BadRequest.code and "too many" in refused.message
        assert node.daemon.metrics.waiting_reads == MAX_WAITS_PER_CONNECTION
        other = await node.connect()  # another connection is not held back by it
        assert isinstance(await other.ask(p.Get(req=other.req(), request_id="x", timeout=0.0)), p.Error)
        await greedy.close()
        for _ in range(100):
            if node.daemon.metrics.waiting_reads == 0:
                break
            await asyncio.sleep(0.01)
        assert node.daemon.metrics.waiting_reads == 0 and not node.handlers.ledger.waits_any(b"")

    run(tmp_path, scenario)


def test_a_stream_read_follows_a_local_write_tensor_by_tensor(tmp_path):
    async def scenario(node: Node) -> None:
        reader, writer = await node.connect(), await node.connect()
        await reader.send(p.GetStream(req=reader.req(), request_id="s", timeout=5.0))  # before the put
        slots = await writer.ask(p.PutAlloc(req=writer.req(), request_id="s", stream=True,
                                            tensors=[tensor("l0", 100), tensor("l1", 100)]))
        got = await reader.recv()
        assert isinstance(got, p.GetSlots)
        node.write(slots.segments[1:], [b"\x07" * 100])
        await writer.send(p.PutPart(req=writer.req(), request_id="s", token=slots.token, tensors=[1]))
        ready = await reader.recv()
        while not ready.tensors:  # (an empty notice may come first)
            ready = await reader.recv()
        assert ready.tensors == [1] and not ready.complete and node.read(got.segments[1:]) == [b"\x07" * 100]
        node.write(slots.segments[:1], [b"\x08" * 100])
        assert isinstance(await writer.ask(p.PutCommit(req=writer.req(), request_id="s", token=slots.token)), p.PutOk)
        rest = [await reader.recv()]
        while not rest[-1].complete:
            rest.append(await reader.recv())
        assert [i for ready in rest for i in ready.tensors] == [0]
        assert node.read(got.segments) == [b"\x08" * 100, b"\x07" * 100]

    run(tmp_path, scenario)


def test_a_stream_read_of_an_entry_pushed_away_says_where_it_went(tmp_path):
    async def scenario(a: Node, b: Node) -> None:
        writer = await a.connect()
        slots = await reserve(a, writer, "gone")
        ok = await writer.ask(p.PutCommit(req=writer.req(), request_id="gone", token=slots.token, dest="B"))
        assert isinstance(ok, p.PutOk) and b.store.ready("gone") is not None
        reader = await a.connect()
        told = await reader.ask(p.GetStream(req=reader.req(), request_id="gone", timeout=5.0))
        assert isinstance(told, p.Error) and told.code == NotFound.code and "pushed to B" in told.message

    run_pair(tmp_path, scenario)
