"""EntryWatch without a daemon: a real Store and local server (never started: no client is
connected, so nothing is sent), parked gets, waits and departures on this test's event loop."""
from __future__ import annotations

import asyncio

import pytest

from kvd.daemon.local.server import LocalServer
from kvd.daemon.local.watch import EntryWatch
from kvd.daemon.store.allocator import BlockAllocator
from kvd.daemon.store.entries import State, Store
from kvd.errors import NotFound, Timeout
from kvd.wire import protocol as p
from kvd.wire.layout import TensorSpec

BLOCK = 4096
SPECS = [TensorSpec("x", "uint8", (100,))]


def make() -> tuple[EntryWatch, Store]:
    store = Store(BlockAllocator(16), BLOCK, None)
    return EntryWatch(store, LocalServer(), "A", lease_timeout=5.0), store


def put(store: Store, request_id: str):
    entry = store.reserve(request_id, SPECS, None, None, State.WRITING, None)
    store.publish(entry)
    return entry


def test_a_parked_get_is_answered_once_its_entry_is_ready():
    async def scenario() -> None:
        watch, store = make()
        answers = []
        watch.park(b"c1", p.Get(req=1, request_id="r", timeout=5.0), lambda parked, found: answers.append(found))
        writing = store.reserve("r", SPECS, None, None, State.WRITING, None)
        watch.wake("r")
        await asyncio.sleep(0.01)
        assert answers == []  # still being written
        store.publish(writing)
        watch.on_published(writing)
        for _ in range(10):
            await asyncio.sleep(0)
        assert answers == [writing]

    asyncio.run(scenario())


def test_a_parked_get_times_out_with_why_and_an_unparked_one_is_never_answered():
    async def scenario() -> None:
        watch, store = make()
        answers = []
        watch.park(b"c1", p.Get(req=1, request_id="late", timeout=0.05), lambda _, found: answers.append(found))
        gone = watch.park(b"c2", p.Get(req=2, request_id="late", timeout=5.0), lambda _, found: answers.append(found))
        watch.unpark(gone)  # its client hung up
        await asyncio.sleep(0.15)
        assert len(answers) == 1 and isinstance(answers[0], Timeout) and "late" in str(answers[0])
        watch.on_published(put(store, "late"))
        await asyncio.sleep(0.01)
        assert len(answers) == 1

    asyncio.run(scenario())


def test_parked_gets_take_a_ready_entry_oldest_first_and_a_consumer_claims_it():
    async def scenario() -> None:
        watch, store = make()
        order = []

        def answer(parked, found):
            order.append(parked.msg.req)
            store.lease(found, consume=not parked.msg.keep, deadline=None)  # what the handlers do

        watch.park(b"c", p.Get(req=1, request_id="r", timeout=5.0, keep=True), answer)
        watch.park(b"c", p.Get(req=2, request_id="r", timeout=5.0), answer)
        watch.park(b"c", p.Get(req=3, request_id="r", timeout=5.0), answer)
        watch.on_published(put(store, "r"))
        for _ in range(10):
            await asyncio.sleep(0)
        assert order == [1, 2]  # the third waits: the second claimed the entry
        watch.close()

    asyncio.run(scenario())


def test_wait_ready_gives_up_at_its_deadline_and_says_so():
    async def scenario() -> None:
        watch, store = make()
        loop = asyncio.get_running_loop()
        with pytest.raises((Timeout, NotFound)):
            await watch.wait_ready("never", loop.time() + 0.05)
        waiting = asyncio.ensure_future(watch.wait_ready("soon", loop.time() + 5))
        await asyncio.sleep(0.01)
        entry = put(store, "soon")
        watch.on_published(entry)
        assert await asyncio.wait_for(waiting, 1) is entry

    asyncio.run(scenario())


def test_an_entry_that_left_is_remembered_until_another_comes():
    async def scenario() -> None:
        watch, store = make()
        entry = put(store, "r")
        store.remove(entry)
        watch.on_departed(entry, "B", pushed=True)
        assert watch.departed("r") == "was pushed to B and is no longer on A: read it on B"
        watch.on_published(put(store, "r"))  # a new one of the same id is here now
        assert watch.departed("r") is None
        assert watch.departed("other") is None

    asyncio.run(scenario())
