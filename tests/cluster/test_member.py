"""ClusterMember (the daemon side) against memory, real etcd and real Redis: registration, publishing,
find without a source, re-publication after a wiped server, the breaker, duplicate node ids."""
from __future__ import annotations

import asyncio
import contextlib
import random
import time

from kvd.cluster.backends.backend import RegistryUnavailable
from kvd.cluster.health import Breaker
from kvd.cluster.member import ClusterMember
from kvd.cluster.records import HolderRecord, NodeRecord

from .conftest import run

TTL = 1.0
EXPIRES = time.time() + 3600


def member(reg, nid: str, inc: int, store: dict[str, HolderRecord] | None = None, **kw) -> ClusterMember:
    rec = NodeRecord(nid, inc, f"tcp://127.0.0.1:{7000 + inc}", role="decode" if nid.startswith("d") else "prefill")
    kw.setdefault("breaker", Breaker(threshold=3, retry_after=0.3))
    kw.setdefault("resync_jitter", 0)
    store = store if store is not None else {}
    m = ClusterMember(reg.backend(op_timeout=kw.pop("op_timeout", 0.3)), rec, ttl=TTL,
                      snapshot=lambda: list(store.values()), **kw)
    m.store = store  # the "daemon's store": what a snapshot returns
    return m


def put(m: ClusterMember, rid: str, gen: int = 1) -> None:
    """What the daemon does when an entry becomes complete: store it, then publish it."""
    m.store[rid] = entry(rid, m, gen)
    m.publish(m.store[rid])


def release(m: ClusterMember, rid: str) -> None:
    gen = m.store.pop(rid).gen
    m.unpublish(rid, gen)


def entry(rid: str, m: ClusterMember, gen: int = 1) -> HolderRecord:
    return HolderRecord(rid, m.record.node_id, m.record.incarnation, gen, 1024, expires_at=EXPIRES)


async def until(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not await cond():
        assert time.monotonic() - t0 < timeout, f"{what} not within {timeout} s"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


@run
async def _publish_find(reg):
    a, b = member(reg, "p1", 1), member(reg, "d1", 2)
    try:
        await a.start()
        await b.start()
        assert await a.wait_registered(3) and await b.wait_registered(3)
        put(a, "r1")
        cands = await b.find("r1", 2.0)
        assert [(c.node.node_id, c.endpoint, c.holder.gen) for c in cands] == [("p1", "tcp://127.0.0.1:7001", 1)]
        assert await a.locate("r1") == []  # never ourselves
        # a get that arrives before the put: find waits for the holder to appear
        later = asyncio.get_running_loop().call_later(0.2, put, a, "r2")
        t0 = time.monotonic()
        assert [c.node.node_id for c in await b.find("r2", 3.0)] == ["p1"]
        assert time.monotonic() - t0 < 1.0
        later.cancel()
        t0 = time.monotonic()
        assert await b.find("nobody", 0.3) == []
        assert 0.28 < time.monotonic() - t0 < 0.8
        release(a, "r1")
        await until(lambda: _empty(b.locate("r1")), 2, "unpublish")
        assert b.lookups["hit"] >= 2 and b.lookups["miss"] >= 1
        await until(lambda: _true(len(b.nodes()) == 2), 3, "both nodes in b's view")
        assert [n.node_id for n in b.nodes(role="decode")] == ["d1"]
        st = a.status()
        assert st["registered"] and st["up"] and st["published"] == 1 and st["state"] == "registered"
    finally:
        await a.stop()
        await b.stop()


async def _empty(coro) -> bool:
    return not await coro


async def _true(v: bool) -> bool:
    return v


def test_publish_and_find_without_a_source(reg):
    _publish_find(reg)


@run
async def _resync(reg):
    store: dict[str, HolderRecord] = {}
    a, b = member(reg, "p1", 1, store), member(reg, "d1", 2)
    try:
        await a.start()
        await b.start()
        assert await a.wait_registered(3)
        for i in range(300):  # more than one batch
            put(a, f"r{i}")
        assert len(await b.find("r299", 2.0)) == 1
        reg.restart_wiped()
        took = await until(lambda: _found(b, "r299"), 10, "re-publication after the wipe")
        assert a.status()["resyncs"] >= 2 and a.membership.registrations >= 2
        assert a.record.incarnation == 1  # same incarnation: the lease is the session, not the process
        assert all([len(await b.locate(f"r{i}")) == 1 for i in (0, 150, 298)])
        print(f"{reg.kind}: entries visible again {took:.2f} s after the wipe")
    finally:
        await a.stop()
        await b.stop()


async def _answers(m: ClusterMember) -> bool:
    """The member's registry client gets answers (a client may see a restarted server as one
    dropped connection first)."""
    try:
        await m.locate("any")
        return True
    except RegistryUnavailable:
        return False


async def _found(m: ClusterMember, rid: str) -> bool:
    try:
        return bool(await m.locate(rid))
    except RegistryUnavailable:
        return False


def test_republish_after_the_server_is_restarted_wiped(reg):
    _resync(reg)


@run
async def _new_entries_skip_the_jitter(reg):
    """After a re-registration the bulk re-publication waits a random spread (a fleet reconnecting
    at once), but an entry completed meanwhile is listed at once: a get by id must not wait it out."""
    store: dict[str, HolderRecord] = {}
    a, b = member(reg, "p1", 1, store, resync_jitter=4.0), member(reg, "d1", 2)
    try:
        await a.start()
        await b.start()
        assert await a.wait_registered(3)
        put(a, "old")
        assert len(await b.find("old", 2.0)) == 1
        reg.restart_wiped()
        await until(lambda: _true(a.membership.registrations >= 2 and a.membership.registered), 10,
                    "re-registration after the wipe")
        await until(lambda: _answers(b), 10, "the reader's client on the restarted server")
        put(a, "new")
        took = await until(lambda: _found(b, "new"), 1.0, "the new entry listed while the re-publication waits")
        print(f"{reg.kind}: a new entry listed {took:.2f} s after its put")
        await until(lambda: _found(b, "old"), 4.0 + 2, "the old entry's re-publication")
    finally:
        await a.stop()
        await b.stop()


def test_a_new_entry_is_listed_at_once_while_the_re_publication_waits(reg):
    _new_entries_skip_the_jitter(reg)


@run
async def _breaker(reg):
    a, b = member(reg, "p1", 1), member(reg, "d1", 2)
    try:
        await a.start()
        await b.start()
        assert await a.wait_registered(3) and await b.wait_registered(3)
        put(a, "r1")
        assert await b.find("r1", 2)
        reg.pause()
        slow = 0
        for _ in range(6):
            t0 = time.monotonic()
            try:
                await b.locate("r1")
                raise AssertionError("a lookup succeeded against a stopped registry")
            except RegistryUnavailable:
                pass
            took = time.monotonic() - t0
            assert took < 0.3 + 0.25, "a lookup outlived its deadline"
            slow += took > 0.1
        assert slow <= 3 and b.status()["breaker"] in ("open", "half_open") and not b.status()["up"]
        t0 = time.monotonic()
        with contextlib.suppress(RegistryUnavailable):
            await b.find("r1", 5.0)
        assert time.monotonic() - t0 < 0.05, "an open breaker must fail fast"
        put(a, "r2")  # queued in the outbox meanwhile, never blocks
        reg.resume()
        await until(lambda: _found(b, "r2"), 5, "recovery after SIGCONT")
        assert b.status()["up"] and b.lookups["unavailable"] >= 6
    finally:
        reg.resume()
        await a.stop()
        await b.stop()


def test_breaker_fails_fast_while_the_registry_is_stopped_and_recovers(reg):
    _breaker(reg)


@run
async def _duplicate(reg):
    first, second = member(reg, "p1", 1), member(reg, "p1", 2)
    try:
        await first.start()
        assert await first.wait_registered(3)
        await second.start()
        await until(lambda: _true(second.status()["state"] == "conflict"), 2 * TTL, "the conflict")
        session = second.status()["session"]
        assert not await second.wait_registered(2 * TTL + 0.5)
        st = second.status()
        assert st["state"] == "conflict" and st["conflict"]["incarnation"] == "1" and not st["registered"]
        # waiting out the conflict keeps its lease alive: a lease left to lapse meanwhile could be
        # nearly spent when the name frees up, and the fresh registration would vanish with it
        assert st["session"] == session and second.ops[("keepalive", "ok")] >= 2
        assert [(n.node_id, n.incarnation) for n in await _list(first)] == [("p1", 1)]
        await first.stop()  # the holder of the name leaves: now the name is free
        assert await second.wait_registered(3 * TTL)
        assert [(n.node_id, n.incarnation) for n in await _list(second)] == [("p1", 2)]
    finally:
        await first.stop()
        await second.stop()


async def _list(m: ClusterMember):
    return (await m.backend.list_nodes())[1]


def test_a_second_daemon_never_takes_a_live_node_id(reg):
    _duplicate(reg)


@run
async def _cancelled_anywhere(reg):
    backend = reg.backend(op_timeout=0.3)

    async def busy() -> None:
        while True:
            await backend.list_nodes()
            await asyncio.sleep(0)  # (the in-memory registry answers without ever yielding)

    stuck = 0
    for _ in range(300):
        task = asyncio.create_task(busy())
        await asyncio.sleep(random.uniform(0, 0.01))  # lands mid-command most of the time
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=1.0)
        if not done:
            stuck += 1
            task.cancel()
            await asyncio.wait([task], timeout=1.0)
    assert stuck == 0, f"{stuck} of 300 cancelled registry calls carried on (a member's stop() would hang)"


def test_a_registry_call_cancelled_at_any_moment_is_cancelled(reg):
    """What ClusterMember.stop() relies on: its loops retry what fails, so a client library that
    absorbed a cancellation would keep a task alive for ever."""
    _cancelled_anywhere(reg)
