"""One-round-trip puts: blocks lent to a connection ahead of its next small put (put_ok / put),
against real daemons."""
from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

import kvd
from kvd.errors import AlreadyExists, NotFound
from kvd.testing.daemons import eventually, raw_connection
from kvd.wire import protocol as p

BLOCK = 64 << 10


def pool(client: kvd.Client) -> dict:
    return client.stats()["pool"]


@contextlib.contextmanager
def sent_types(client: kvd.Client):
    """The types of the messages the client sends inside the block."""
    sent: list[str] = []
    send = client._sock.send
    client._sock.send = lambda frames: (sent.append(p.decode(frames).TYPE), send(frames))[1]
    try:
        yield sent
    finally:
        client._sock.send = send


def test_a_small_put_lends_blocks_and_the_next_put_uses_them(client):
    first = torch.arange(5000, dtype=torch.float32)  # 20000 bytes: one block
    client.put("a", {"x": first})
    [(token, _extents, blocks)] = client._scratch
    assert blocks == 1 and pool(client)["scratch_bytes"] == BLOCK
    assert pool(client)["used_bytes"] == BLOCK  # the entry; the loan is counted apart

    second = torch.randn(4000, dtype=torch.float32)
    with sent_types(client) as sent:
        client.put("b", {"x": second, "y": torch.arange(7, dtype=torch.int8)})
    assert sent == ["put"]  # one request, one reply
    assert [loan[0] != token for loan in client._scratch] == [True]  # used up; a new loan came with the reply
    stats = pool(client)
    assert stats["used_bytes"] == 2 * BLOCK and stats["scratch_bytes"] == BLOCK
    assert client.get("a")["x"].equal(first)
    got = client.get("b")
    assert torch.equal(got["x"], second) and torch.equal(got["y"], torch.arange(7, dtype=torch.int8))
    assert pool(client)["used_bytes"] == 0


def test_the_loan_is_rounded_up_to_a_power_of_two_blocks_and_spare_blocks_return(client):
    client.put("a", {"x": torch.zeros(3 * BLOCK, dtype=torch.uint8)})  # 3 blocks -> a loan of 4
    assert [loan[2] for loan in client._scratch] == [4] and pool(client)["scratch_bytes"] == 4 * BLOCK
    client.put("b", {"x": torch.ones(BLOCK, dtype=torch.uint8)})  # uses 1 of the 4, 3 go back
    stats = pool(client)
    assert stats["used_bytes"] == 4 * BLOCK and stats["scratch_bytes"] == BLOCK  # a + b, the new loan
    assert torch.equal(client.get("b")["x"], torch.ones(BLOCK, dtype=torch.uint8))
    client.delete("a")
    assert pool(client)["used_bytes"] == 0


def test_a_put_too_big_for_the_loan_returns_it_and_gets_a_bigger_one(client):
    client.put("small", {"x": torch.zeros(100, dtype=torch.uint8)})
    [(small_token, _, _)] = client._scratch
    big = torch.randint(0, 256, (5 * BLOCK,), dtype=torch.uint8)
    client.put("big", {"x": big})
    [(token, _, blocks)] = client._scratch
    assert token != small_token and blocks == 8
    assert pool(client)["scratch_bytes"] == 8 * BLOCK  # the 1-block loan came back
    assert torch.equal(client.get("big")["x"], big)
    client.delete("small")
    assert pool(client)["used_bytes"] == 0


def test_every_dtype_round_trips_through_lent_blocks(client):
    client.put("warm-up", {"x": torch.zeros(1)})
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8):
        tensor = torch.randint(0, 256, (2, 3, 64), dtype=torch.uint8).view(dtype)  # every bit pattern
        assert client._scratch  # this put takes one round trip
        client.put(f"t-{dtype}", {"k": tensor, "v": tensor.flip(0)})
        got = client.get(f"t-{dtype}")
        assert got["k"].dtype == dtype
        assert got["k"].view(torch.uint8).equal(tensor.view(torch.uint8))
        assert got["v"].view(torch.uint8).equal(tensor.flip(0).contiguous().view(torch.uint8))


def test_a_failed_put_through_lent_blocks_loses_nothing(client):
    client.put("a", {"x": torch.zeros(10)})
    assert client._scratch
    with pytest.raises(AlreadyExists):
        client.put("a", {"x": torch.ones(10)})  # through the loan: used up, its blocks freed
    assert client._scratch == [] and pool(client)["scratch_bytes"] == 0
    assert torch.equal(client.get("a", keep=True)["x"], torch.zeros(10))  # the first one is intact
    client.put("b", {"x": torch.ones(10)})  # two round trips again, and a new loan
    assert len(client._scratch) == 1
    client.delete("a"), client.delete("b")
    assert pool(client)["used_bytes"] == 0


def test_a_disconnecting_client_gives_its_loan_back(daemon):
    with daemon.client() as watcher:
        with daemon.client() as c:
            c.put("a", {"x": torch.zeros(10)})
            assert pool(watcher)["scratch_bytes"] == BLOCK
        eventually(lambda: pool(watcher)["scratch_bytes"] == 0)
        assert watcher.get("a")["x"].equal(torch.zeros(10))
        assert pool(watcher)["used_bytes"] == 0


def test_nothing_is_lent_once_the_pool_is_half_full(daemon):
    with daemon.client() as c:
        c.put("big", {"x": torch.zeros(40 << 20, dtype=torch.uint8)})  # of 64 MiB
        c.put("small", {"x": torch.zeros(10)})
        assert c._scratch == [] and pool(c)["scratch_bytes"] == 0
        c.delete("big")
        c.put("small-2", {"x": torch.zeros(10)})
        assert len(c._scratch) == 1


def test_scratch_max_zero_turns_lending_off(daemons):
    daemon = daemons.start("A", extra=["--scratch-max", "0"])
    with daemon.client() as c:
        for i in range(3):
            c.put(f"r{i}", {"x": torch.full((10,), i)})
        assert c._scratch == [] and pool(c)["scratch_bytes"] == 0
        assert [c.get(f"r{i}")["x"][0].item() for i in range(3)] == [0, 1, 2]


def test_a_put_naming_blocks_not_lent_to_it_is_refused(daemon):
    with daemon.client() as owner:
        owner.put("a", {"x": torch.zeros(10)})
        [(token, _, _)] = owner._scratch
        conn = raw_connection(daemon.socket)
        try:
            # another connection names the owner's loan, then a made-up one
            for scratch in (token, 987654321):
                conn.send(p.encode(p.Put(req=1, request_id="stolen", tensors=[["x", "float32", [10]]],
                                         scratch=scratch)))
                reply = p.decode(conn.receive(5.0))
                assert isinstance(reply, p.Error) and reply.code == NotFound.code, reply
            # and "gives back" the owner's loan: ignored, it is not this connection's
            conn.send(p.encode(p.PutAlloc(req=2, request_id="other", tensors=[["x", "int8", [3]]], give_back=token)))
            assert isinstance(p.decode(conn.receive(5.0)), p.PutSlots)
        finally:
            conn.close()
        assert [loan[0] for loan in owner._scratch] == [token] and pool(owner)["scratch_bytes"] == BLOCK
        owner.put("b", {"x": torch.ones(10)})  # through the owner's loan, untouched
        assert owner.get("b")["x"].equal(torch.ones(10))
        # (the raw connection's unfinished put goes with it)
        eventually(lambda: [e["request_id"] for e in owner.list()] == ["a"])


def test_a_put_with_a_malformed_tensor_list_frees_the_loan(daemon):
    with daemon.client() as c:
        c.put("a", {"x": torch.zeros(10)})
        [(token, _, _)] = c._scratch
        c._scratch = []  # this test speaks for the client
        with pytest.raises(kvd.KvdError, match="dtype"):
            c._drive(c._simple(p.Put(req=next(c._reqs), request_id="bad", tensors=[["x", "nope", [1]]],
                                     scratch=token)))
        assert pool(c)["scratch_bytes"] == 0
        c.delete("a")
        assert pool(c)["used_bytes"] == 0


def test_concurrent_async_puts_share_one_loan_safely(daemon):
    async def main():
        async with kvd.AsyncClient(daemon.socket) as c:
            await c.put("warm-up", {"x": torch.zeros(1)})
            tensors = {f"r{i}": torch.full((3000,), i, dtype=torch.int32) for i in range(60)}
            for _ in range(3):
                await asyncio.gather(*(c.put(rid, {"x": t}) for rid, t in tensors.items()))
                got = await asyncio.gather(*(c.get(rid) for rid in tensors))
                for (rid, t), kv in zip(tensors.items(), got):
                    assert torch.equal(kv["x"], t), rid
            await c.delete("warm-up")
            return await c.stats()

    stats = asyncio.run(main())
    assert stats["entries"] == 0 and stats["pool"]["used_bytes"] == 0


def test_a_push_through_lent_blocks(daemons):
    a, b = daemons.pair()
    with a.client() as ca, b.client() as cb:
        ca.put("p0", {"x": torch.zeros(100)}, dest="B")
        assert ca._scratch
        data = torch.randn(1000)
        ca.put("p1", {"x": data}, dest="B")  # one round trip to A, then A pushes
        assert torch.equal(cb.get("p1")["x"], data)
        assert cb.get("p0")["x"].equal(torch.zeros(100))
        assert pool(ca)["used_bytes"] == 0 and pool(cb)["used_bytes"] == 0


def test_paged_put_blocks_go_through_lent_blocks_too(client):
    cache = torch.randn(16, 4, 8, dtype=torch.float16)  # 16 pages of 4 x 8
    client.put_blocks("p0", {"k": cache}, [1, 2])
    with sent_types(client) as sent:
        client.put_blocks("p1", {"k": cache}, [5, 3, 9])
    assert sent == ["put"]
    out = torch.zeros_like(cache)
    client.get_blocks("p1", {"k": out}, [0, 1, 2])
    assert torch.equal(out[:3], cache[[5, 3, 9]]) and not out[3:].any()


def test_an_async_put_cancelled_while_waiting_still_picks_up_its_loan(daemon):
    async def main():
        async with kvd.AsyncClient(daemon.socket) as c:
            await c.put("warm-up", {"x": torch.zeros(10)})
            waiting = asyncio.ensure_future(c.put("cancelled", {"x": torch.ones(10)}))
            await asyncio.sleep(0)  # sent; its reply (with a new loan) arrives after the cancel
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await c.stats()  # a round trip: the put's late reply has been read by now
            assert c._scratch
            await c.put("next", {"x": torch.full((10,), 2.0)})  # through that loan
            assert torch.equal((await c.get("cancelled"))["x"], torch.ones(10))
            assert torch.equal((await c.get("next"))["x"], torch.full((10,), 2.0))
            await c.delete("warm-up")
            return await c.stats()

    stats = asyncio.run(main())
    assert stats["pool"]["used_bytes"] == 0 and stats["pool"]["scratch_bytes"] == 65536


def test_puts_in_flight_each_get_a_loan_and_take_one_round_trip(daemon):
    """An AsyncClient with 16 puts in flight holds up to 16 loans: after the first waves, every
    put is one `put` (no put_alloc), and the bytes are right."""
    async def main():
        async with kvd.AsyncClient(daemon.socket) as c:
            sent: list[str] = []
            send = c._sock.send_now
            c._sock.send_now = lambda frames: (sent.append(p.decode(frames).TYPE), send(frames))[1]
            tensors = {f"r{i}": torch.full((3000,), i, dtype=torch.int32) for i in range(16)}
            for wave in range(4):
                sent.clear()
                await asyncio.gather(*(c.put(f"{rid}-{wave}", {"x": t}) for rid, t in tensors.items()))
            last_wave = list(sent)
            loans, lent = len(c._scratch), (await c.stats())["pool"]["scratch_bytes"]
            for wave in range(4):
                got = await asyncio.gather(*(c.get(f"{rid}-{wave}") for rid in tensors))
                for (rid, t), kv in zip(tensors.items(), got):
                    assert torch.equal(kv["x"], t), rid
            return last_wave, loans, lent

    last_wave, loans, lent = asyncio.run(main())
    assert last_wave == ["put"] * 16, last_wave
    assert loans == 16 and lent == 16 * BLOCK


def test_loans_to_one_connection_are_bounded_by_a_64th_of_the_pool(daemon):
    """64 MiB pool: one connection holds at most 16 blocks on loan, here 4 loans of 4 blocks;
    they all come back when it disconnects."""
    async def main():
        async with kvd.AsyncClient(daemon.socket) as c:
            data = torch.randint(0, 256, (3 * BLOCK,), dtype=torch.uint8)  # 3 blocks: loans of 4
            for wave in range(3):
                await asyncio.gather(*(c.put(f"r{i}-{wave}", {"x": data}) for i in range(16)))
            loans = sorted(loan[2] for loan in c._scratch)
            lent = (await c.stats())["pool"]["scratch_bytes"]
            for wave in range(3):
                for i in range(16):
                    assert torch.equal((await c.get(f"r{i}-{wave}"))["x"], data)
            return loans, lent

    loans, lent = asyncio.run(main())
    assert loans == [4, 4, 4, 4] and lent == 16 * BLOCK
    with daemon.client() as watcher:
        eventually(lambda: pool(watcher)["scratch_bytes"] == 0)
        assert pool(watcher)["used_bytes"] == 0
