"""LocalHandlers and LocalPuts in process: a real daemon on this test's event loop, a raw client
connection, and the store and each write's machine read between two messages."""
from __future__ import annotations

import asyncio

from kvd.daemon.local.reservation import WriteState
from kvd.errors import BadRequest, NotFound, ShuttingDown, Timeout
from kvd.wire import protocol as p
from kvd.wire.framing import encode_message
from kvd.wire.layout import physical_segments

from .inprocess import Conn, Node, run, tensor, until

PAYLOAD = bytes(range(256)) * 40  # 10240 bytes: three blocks of 4 KiB, the last one partly


async def reserve(node: Node, conn: Conn, request_id: str, stream: bool = False) -> p.PutSlots:
    slots = await conn.ask(p.PutAlloc(req=conn.req(), request_id=request_id, tensors=[tensor("x", len(PAYLOAD))],
                                      stream=stream))
    assert isinstance(slots, p.PutSlots), slots
    node.write(slots.segments, [PAYLOAD])
    return slots


def hold_of(node: Node, token: int):
    """The hold of reservation `token`, whichever connection has it (None: none has)."""
    return next((books.held[token] for books in node.handlers.ledger._books.values() if token in books.held), None)


def checked(node: Node) -> None:
    """The daemon's ledger keeps its invariants (every token one connection's, nothing a writer may
    still write into freed, every lent block accounted)."""
    node.handlers.ledger.validate()


def write_of(node: Node, token: int):
    hold = hold_of(node, token)
    return hold.write if hold is not None else None


def test_a_put_then_a_get_gives_the_same_bytes_and_the_pool_back(tmp_path):
    async def scenario(node: Node) -> None:
        writer, reader = await node.connect(), await node.connect()
        slots = await reserve(node, writer, "r1")
        assert write_of(node, slots.token).state is WriteState.WRITING
        assert isinstance(await writer.ask(p.PutCommit(req=writer.req(), request_id="r1", token=slots.token)),
                          p.PutOk)
        assert write_of(node, slots.token) is None  # the write is over: the connection holds nothing of it
        got = await reader.ask(p.Get(req=reader.req(), request_id="r1", timeout=0.0))
        assert isinstance(got, p.GetSlots) and node.read(got.segments) == [PAYLOAD]
        await reader.send(p.GetDone(req=reader.req(), request_id="r1", token=got.token, consume=True, reply=False))
        await until(lambda: "r1" not in node.store.entries and node.blocks_in_use() == 0,
                    "the consuming get_done (it has no reply) taken: the entry and its blocks gone")

    run(tmp_path, scenario)


def test_a_write_removed_under_its_writer_ends_and_its_blocks_wait_for_the_writer(tmp_path):
    async def scenario(node: Node) -> None:
        writer, other = await node.connect(), await node.connect()
        alloc_req = writer.req() + 1  # (reserve asks with the next req)
        slots = await reserve(node, writer, "r2", stream=True)
        deleted = await other.ask(p.Delete(req=other.req(), request_id="r2"))
        assert isinstance(deleted, p.Ok) and deleted.value is True
        told = await writer.recv()  # at once, on its put_alloc's req
        assert isinstance(told, p.Error) and told.req == alloc_req and told.code == NotFound.code
        hold = hold_of(node, slots.token)
        write = hold.write
        assert write.state is WriteState.ENDED and "r2" not in node.store.entries
        write.validate(pinned=hold.entry.writer, removed=hold.entry.removed)
        checked(node)
        assert node.blocks_in_use() == 3  # parked: the writer may still be copying
        await writer.send(p.PutPart(req=writer.req(), request_id="r2", token=slots.token, tensors=[0]))
        await writer.nothing()  # ignored: it was told why
        failed = await writer.ask(p.PutCommit(req=writer.req(), request_id="r2", token=slots.token))
        assert isinstance(failed, p.Error) and failed.code == NotFound.code and "deleted" in failed.message
        assert write.state is WriteState.RELEASED and node.blocks_in_use() == 0
        checked(node)

    run(tmp_path, scenario)


def test_a_writer_that_aborts_or_hangs_up_loses_its_put_and_nothing_else(tmp_path):
    async def scenario(node: Node) -> None:
        keeper, aborter, leaver = await node.connect(), await node.connect(), await node.connect()
        kept = await reserve(node, keeper, "kept")
        aborted = await reserve(node, aborter, "aborted")
        first = await aborter.ask(p.Delete(req=aborter.req(), request_id="aborted", token=aborted.token))
        again = await aborter.ask(p.Delete(req=aborter.req(), request_id="aborted", token=aborted.token))
        assert (first.value, again.value) == (True, False)
        await reserve(node, leaver, "left")
        abandoned = node.daemon.metrics.abandoned._value.get()
        await leaver.close()
        for _ in range(100):
            if "left" not in node.store.entries:
                break
            await asyncio.sleep(0.01)
        assert "left" not in node.store.entries and node.daemon.metrics.abandoned._value.get() == abandoned + 1
        assert set(node.store.entries) == {"kept"} and node.blocks_in_use() == 3
        checked(node)
        assert isinstance(await keeper.ask(p.PutCommit(req=keeper.req(), request_id="kept", token=kept.token)),
                          p.PutOk)
        got = await keeper.ask(p.Get(req=keeper.req(), request_id="kept", timeout=0.0, keep=True))
        assert node.read(got.segments) == [PAYLOAD]

    run(tmp_path, scenario)


def test_a_reservation_whose_lease_runs_out_tells_its_writer_and_fails_its_commit(tmp_path):
    async def scenario(node: Node) -> None:
        writer = await node.connect()
        slots = await reserve(node, writer, "slow")
        told = await writer.recv(timeout=3)  # the sweep runs every 0.2 s
        assert isinstance(told, p.Error) and told.code == Timeout.code and "--lease-timeout" in told.message
        assert write_of(node, slots.token).state is WriteState.ENDED and node.blocks_in_use() == 3
        checked(node)
        failed = await writer.ask(p.PutCommit(req=writer.req(), request_id="slow", token=slots.token))
        assert isinstance(failed, p.Error) and failed.code == Timeout.code
        assert node.blocks_in_use() == 0 and not node.store.entries

    run(tmp_path, scenario, lease_timeout=0.3)


def test_bad_requests_get_a_clear_error_and_lose_nothing(tmp_path):
    async def scenario(node: Node) -> None:
        conn = await node.connect()
        slots = await reserve(node, conn, "good")
        # another connection cannot name this connection's token
        stranger = await node.connect()
        stolen = await stranger.ask(p.PutCommit(req=stranger.req(), request_id="good", token=slots.token))
        assert isinstance(stolen, p.Error) and stolen.code == NotFound.code
        # an undecodable message is answered on the req its header gives
        stranger.writer.write(encode_message([b"\x82\xa4type\xa4nope\xa3req\x07"]))
        bad = await stranger.recv()
        assert isinstance(bad, p.Error) and bad.req == 7 and bad.code != 0
        huge = await conn.ask(p.PutAlloc(req=conn.req(), request_id="big", tensors=[tensor("x", 1 << 30)]))
        assert isinstance(huge, p.Error)
        dup = await conn.ask(p.PutAlloc(req=conn.req(), request_id="good", tensors=[tensor("x", 10)]))
        assert isinstance(dup, p.Error)
        assert isinstance(await conn.ask(p.PutCommit(req=conn.req(), request_id="good", token=slots.token)), p.PutOk)
        got = await conn.ask(p.Get(req=conn.req(), request_id="good", timeout=0.0, keep=True))
        assert node.read(got.segments) == [PAYLOAD] and node.blocks_in_use() == 3
        wrong = await conn.ask(p.Get(req=conn.req(), request_id="good", timeout=-1.0))
        assert isinstance(wrong, p.Error) and wrong.code == BadRequest.code

    run(tmp_path, scenario)


def test_a_small_put_takes_one_round_trip_into_blocks_lent_ahead(tmp_path):
    async def scenario(node: Node) -> None:
        conn = await node.connect()
        slots = await reserve(node, conn, "first")
        ok = await conn.ask(p.PutCommit(req=conn.req(), request_id="first", token=slots.token, lend=True))
        assert isinstance(ok, p.PutOk) and ok.scratch is not None
        lent = physical_segments([tuple(extent) for extent in ok.extents], 4096, 0, len(PAYLOAD))
        node.write([lent], [PAYLOAD[::-1]])
        done = await conn.ask(p.Put(req=conn.req(), request_id="second", tensors=[tensor("x", len(PAYLOAD))],
                                    scratch=ok.scratch))
        assert isinstance(done, p.PutOk)
        checked(node)
        got = await conn.ask(p.Get(req=conn.req(), request_id="second", timeout=0.0, keep=True))
        assert node.read(got.segments) == [PAYLOAD[::-1]]
        reused = await conn.ask(p.Put(req=conn.req(), request_id="third", tensors=[tensor("x", 10)],
                                      scratch=ok.scratch))
        assert isinstance(reused, p.Error) and reused.code == NotFound.code  # a loan is used once

    run(tmp_path, scenario, scratch_max=64 << 10)


def test_a_draining_daemon_refuses_new_puts_and_finishes_started_ones(tmp_path):
    async def scenario(node: Node) -> None:
        conn = await node.connect()
        slots = await reserve(node, conn, "started")
        node.daemon.lifecycle.draining = True
        refused = await conn.ask(p.PutAlloc(req=conn.req(), request_id="new", tensors=[tensor("x", 10)]))
        assert isinstance(refused, p.Error) and refused.code == ShuttingDown.code
        assert isinstance(await conn.ask(p.PutCommit(req=conn.req(), request_id="started", token=slots.token)),
                          p.PutOk)
        node.daemon.lifecycle.draining = False  # (so that the daemon's own stop drains as usual)

    run(tmp_path, scenario)


def test_a_stream_consumed_before_its_commit_ends_the_write_and_frees_its_blocks(tmp_path):
    # (it used to leave the writer's blocks pinned for ever, and its commit said "expired or aborted?")
    async def scenario(node: Node) -> None:
        writer, reader = await node.connect(), await node.connect()
        slots = await reserve(node, writer, "s", stream=True)
        await writer.send(p.PutPart(req=writer.req(), request_id="s", token=slots.token, tensors=[0]))
        got = await reader.ask(p.GetStream(req=reader.req(), request_id="s", timeout=2.0))
        assert isinstance(got, p.GetSlots) and isinstance(await reader.recv(), p.TensorsReady)
        assert node.read(got.segments) == [PAYLOAD]
        done = await reader.ask(p.GetDone(req=reader.req(), request_id="s", token=got.token, consume=True,
                                                    reply=True))
        assert isinstance(done, p.Ok)
        told = await writer.recv()
        assert isinstance(told, p.Error) and "consumed by a stream reader" in told.message
        failed = await writer.ask(p.PutCommit(req=writer.req(), request_id="s", token=slots.token))
        assert isinstance(failed, p.Error) and failed.code == NotFound.code and "consumed" in failed.message
        assert node.blocks_in_use() == 0 and not node.store.entries
        checked(node)

    run(tmp_path, scenario)
