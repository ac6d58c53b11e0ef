"""SharedPulls and the reads that use them, in process: daemons A and B on this test's event loop
over real loopback links; a get on B names A as its source."""
from __future__ import annotations

import asyncio

from kvd.errors import NotFound, PeerUnavailable, Timeout
from kvd.wire import protocol as p

from .inprocess import Conn, Node, run_pair, tensor
from .test_local_handlers import PAYLOAD, reserve


async def put(node: Node, conn: Conn, request_id: str) -> None:
    slots = await reserve(node, conn, request_id)
    assert isinstance(await conn.ask(p.PutCommit(req=conn.req(), request_id=request_id, token=slots.token)), p.PutOk)


def test_gets_of_one_entry_from_a_source_share_one_pull_and_read_the_same_bytes(tmp_path):
    async def scenario(a: Node, b: Node) -> None:
        writer = await a.connect()
        await put(a, writer, "r")
        readers = [await b.connect() for _ in range(3)]
        for r in readers:
            await r.send(p.Get(req=r.req(), request_id="r", timeout=5.0, source="A", keep=True))
        for r in readers:
            got = await r.recv()
            assert isinstance(got, p.GetSlots) and b.read(got.segments) == [PAYLOAD]
        assert b.daemon.metrics.tally["pulls"] == 1  # one pull served all three gets
        assert b.store.ready("r") is not None and not b.handlers.pulls._pulls
        assert a.store.ready("r") is not None  # keep: the holder keeps its copy

    run_pair(tmp_path, scenario)


def test_a_pull_that_nobody_waits_for_any_more_is_called_off(tmp_path):
    async def scenario(a: Node, b: Node) -> None:
        reader = await b.connect()
        # (nothing on A yet: the pull waits there for the entry)
        await reader.send(p.Get(req=reader.req(), request_id="later", timeout=10.0, source="A"))
        for _ in range(50):
            if b.handlers.pulls._pulls:
                break
            await asyncio.sleep(0.01)
        pull = next(iter(b.handlers.pulls._pulls.values()))
        await reader.close()
        for _ in range(100):
            if pull.done():
                break
            await asyncio.sleep(0.01)
        assert pull.cancelled() and not b.handlers.pulls._pulls
        writer = await a.connect()
        await put(a, writer, "later")
        await asyncio.sleep(0.1)
        assert a.store.ready("later") is not None and "later" not in b.store.entries  # it stayed at the holder

    run_pair(tmp_path, scenario)


def test_a_pull_of_what_the_source_does_not_hold_fails_in_time_and_leaves_nothing(tmp_path):
    async def scenario(a: Node, b: Node) -> None:
        reader = await b.connect()
        missing = await reader.ask(p.Get(req=reader.req(), request_id="none", timeout=0.0, source="A"))
        assert isinstance(missing, p.Error) and missing.code in (NotFound.code, Timeout.code)
        unknown = await reader.ask(p.Get(req=reader.req(), request_id="none", timeout=0.0, source="Z"))
        assert isinstance(unknown, p.Error) and unknown.code == PeerUnavailable.code
        assert "unknown peer 'Z'" in unknown.message
        assert not b.store.entries and b.blocks_in_use() == 0 and not b.handlers.pulls._pulls

    run_pair(tmp_path, scenario)


def test_a_stream_read_follows_a_pull_as_its_tensors_arrive(tmp_path):
    async def scenario(a: Node, b: Node) -> None:
        writer = await a.connect()
        slots = await writer.ask(p.PutAlloc(req=writer.req(), request_id="s", tensors=[tensor("l0", 4096),
                                                                                    tensor("l1", 4096)], stream=True))
        a.write(slots.segments, [b"\x01" * 4096, b"\x02" * 4096])
        await writer.send(p.PutPart(req=writer.req(), request_id="s", token=slots.token, tensors=[0]))
        reader = await b.connect()
        got = await reader.ask(p.GetStream(req=reader.req(), request_id="s", timeout=5.0, source="A"))
        assert isinstance(got, p.GetSlots)
        seen = []
        first = await reader.recv()
        seen += first.tensors
        assert isinstance(first, p.TensorsReady) and not first.complete
        await writer.send(p.PutPart(req=writer.req(), request_id="s", token=slots.token, tensors=[1]))
        assert isinstance(await writer.ask(p.PutCommit(req=writer.req(), request_id="s", token=slots.token)), p.PutOk)
        while True:
            ready = await reader.recv()
            seen += ready.tensors
            if ready.complete:
                break
        assert sorted(seen) == [0, 1] and b.read(got.segments) == [b"\x01" * 4096, b"\x02" * 4096]

    run_pair(tmp_path, scenario)
