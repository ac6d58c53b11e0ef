"""The tier's reservations live by the handoffs' machine (local/reservation.py): a lease that runs out ends the
put but parks its blocks until the writer lets go (in-process daemon, raw client messages)."""
from __future__ import annotations

import time

import pytest

from kvd.wire import protocol as p

from .inprocess import BLOCK, Node, run

PAGE = 4 * BLOCK


def page_put(conn, key: str, namespace: str = "ns") -> p.CachePut:
    return p.CachePut(req=conn.req(), namespace=namespace, keys=[key], pages=[["uint8", [PAGE]]])


def lease_runs_out(node: Node) -> None:
    """The housekeeping sweep, run as if the lease timeout had passed."""
    node.daemon.parts.tier_service.sweep(time.monotonic() + 3600)


def checked(node: Node) -> None:
    node.daemon.parts.tier_service.validate()
    node.daemon.parts.cache.check_invariants()


@pytest.mark.parametrize("then", ["commit", "abort", "hang up"])
def test_an_expired_reservation_keeps_its_blocks_until_its_writer_lets_go(tmp_path, then):
    async def scenario(node: Node) -> None:
        writer, other = await node.connect(), await node.connect()
        slots = await writer.ask(page_put(writer, "late"))
        assert isinstance(slots, p.CacheSlots) and isinstance(slots.slots[0], list)
        checked(node)
        lease_runs_out(node)
        checked(node)
        stats = node.daemon.parts.cache.stats()
        assert stats["entries"] == 0 and stats["parked_bytes"] == PAGE  # unlisted, its blocks kept
        assert node.blocks_in_use() == 4
        # the key is free again: a new put reserves afresh, in other blocks
        again = await other.ask(page_put(other, "late"))
        assert isinstance(again.slots[0], list) and again.slots[0] != slots.slots[0]
        assert (await other.ask(p.CacheCommit(req=other.req(), token=again.token))).value == [True]
        checked(node)
        if then == "commit":  # the late writer is told its pages were not stored
            done = await writer.ask(p.CacheCommit(req=writer.req(), token=slots.token))
            assert done.value is None
        elif then == "abort":
            done = await writer.ask(p.CacheCommit(req=writer.req(), token=slots.token, ok=False))
            assert done.value == [False]
        else:
            await writer.close()
        await other.ask(p.Stats(req=other.req()))  # (the hang-up is handled by now)
        checked(node)
        assert node.daemon.parts.cache.stats()["parked_bytes"] == 0 and node.blocks_in_use() == 4

    run(tmp_path, scenario, cache_size=1.0)


def test_a_live_reservation_is_not_touched_by_the_sweep(tmp_path):
    async def scenario(node: Node) -> None:
        writer = await node.connect()
        slots = await writer.ask(page_put(writer, "k"))
        node.daemon.parts.tier_service.sweep(time.monotonic())  # (within its lease)
        checked(node)
        assert (await writer.ask(p.CacheCommit(req=writer.req(), token=slots.token))).value == [True]
        assert node.daemon.parts.cache.stats()["entries"] == 1
        checked(node)

    run(tmp_path, scenario, cache_size=1.0)
