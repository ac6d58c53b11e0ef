"""What watching the node listing and locating a holder cost the registry, counted by the real etcd and
Redis servers themselves, and that the cheap paths still see every change.

At 100 daemons, re-reading the whole listing on every Redis watch poll (4 a second per daemon) kept a
core busy with nothing happening (bench/cluster_scale.py); a router's locate listed every node each time.
"""
from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest

from kvd.cluster import Added, Registry, Removed, Resync
from kvd.cluster.backends.backend import Publish

from .conftest import Harness, run
from .test_contract import holder, node

TTL = 1.0


@pytest.fixture(params=["etcd", "redis"])
def real_reg(request):
    h = Harness(request.param, request.getfixturevalue(f"{request.param}_server"))
    yield h
    h.heal()


def script_calls(h: Harness) -> int:
    """Redis: the scripts run (a watch's poll is one)."""
    import redis

    with redis.Redis(port=h.server.port) as r:
        stats = r.info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval", "fcall"))


def listing_reads(h: Harness) -> int:
    """Redis: MGET calls (the listing's read; scripts' calls count). etcd: range requests."""
    if h.kind == "redis":
        import redis

        with redis.Redis(port=h.server.port) as r:
            return r.info("commandstats").get("cmdstat_mget", {}).get("calls", 0)
    with urllib.request.urlopen(f"http://127.0.0.1:{h.server.client_port}/metrics", timeout=2) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("etcd_mvcc_range_total "):
                return int(float(line.split()[1]))
    raise AssertionError("etcd reports no etcd_mvcc_range_total")


class View:
    """A watcher's view of the cluster, kept by a task that applies every event."""

    def __init__(self, backend) -> None:
        self.nodes: dict = {}
        self.events: list = []
        self._it = backend.watch_nodes()
        self._task = asyncio.ensure_future(self._follow())

    async def _follow(self) -> None:
        async for ev in self._it:
            self.events.append(ev)
            if isinstance(ev, Resync):
                self.nodes = {n.node_id: n for n in ev.nodes}
            elif isinstance(ev, Added):
                self.nodes[ev.node.node_id] = ev.node
            elif isinstance(ev, Removed):
                self.nodes.pop(ev.node_id, None)

    async def until(self, cond, what: str, timeout: float = 3.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond(self.nodes):
            assert time.monotonic() < deadline, f"the watch did not see {what} within {timeout} s: {self.nodes}"
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._it.aclose()


@run
async def _idle_redis_watch(h: Harness):
    writer = h.backend()
    view = None
    try:
        for i in range(20):
            await writer.register_node(await writer.open_session(30), node(f"n{i}", inc=i + 1))
        view = View(h.backend())  # polls every 50 ms
        await view.until(lambda nodes: len(nodes) == 20, "the 20 nodes")
        before, polls = listing_reads(h), script_calls(h)
        deadline = time.monotonic() + 10
        while script_calls(h) - polls < 20:  # 20 polls (~1 s at 50 ms, counted: not a guess), nothing changes
            assert time.monotonic() < deadline, "the watch did not poll 20 times in 10 s"
            await asyncio.sleep(0.05)
        assert listing_reads(h) - before <= 1, "an idle watch read the whole listing at every poll"
        assert len(view.events) == 1  # the Resync, nothing since
    finally:
        if view is not None:
            await view.close()
        await h.close_all()


def test_an_idle_redis_watch_reads_only_the_listings_version(redis_server):
    _idle_redis_watch(Harness("redis", redis_server))


@run
async def _between_polls(reg):
    a = reg.backend()
    view = View(reg.backend())
    try:
        s1 = await a.open_session(30)
        await a.register_node(s1, node("a", inc=1))
        short = await a.open_session(TTL)  # never kept alive
        await a.register_node(short, node("b", inc=2))
        await view.until(lambda n: n.keys() == {"a", "b"}, "two registrations")
        await a.update_node(s1, node("a", inc=1, labels={"zone": "y"}))
        await view.until(lambda n: n["a"].labels == {"zone": "y"}, "a record rewritten in place")
        await s1.close()  # a restarts: gone and back, under a new incarnation, within one poll
        await a.register_node(await a.open_session(30), node("a", inc=3))
        await view.until(lambda n: "a" in n and n["a"].incarnation == 3, "a new incarnation under the same id")
        await view.until(lambda n: "b" not in n, "a node whose session expired", timeout=2 * TTL + 2)
    finally:
        await view.close()
        await reg.close_all()


def test_a_watch_sees_every_kind_of_change(reg):
    _between_polls(reg)


@run
async def _router_locate(h: Harness):
    a = h.backend()
    router = Registry(h.url, cluster=h.cluster, op_timeout=0.5)
    try:
        for i in range(20):  # a listing worth avoiding
            await a.register_node(await a.open_session(30), node(f"n{i}", inc=100 + i))
        s1 = await a.open_session(30)
        await a.register_node(s1, node("a", inc=1))
        await a.publish_batch(s1, [Publish(holder("r1", "a", inc=1))])
        assert [c.endpoint for c in await router.locate("r1")] == ["tcp://127.0.0.1:7001"]
        before = listing_reads(h)
        for _ in range(30):
            assert [c.node.node_id for c in await router.locate("r1")] == ["a"]
        # etcd: one range per locate (the holders); Redis: no listing read at all
        assert listing_reads(h) - before == (30 if h.kind == "etcd" else 0)
        await s1.close()  # a comes back under a new incarnation, elsewhere: the router reads the listing again
        s2 = await a.open_session(30)
        await a.register_node(s2, node("a", inc=2))
        await a.publish_batch(s2, [Publish(holder("r1", "a", inc=2))])
        found = await router.locate("r1")
        assert [(c.endpoint, c.node.incarnation) for c in found] == [("tcp://127.0.0.1:7002", 2)]
    finally:
        await router.close()
        await h.close_all()


def test_a_router_locate_reads_the_listing_only_for_a_node_it_does_not_know(real_reg):
    _router_locate(real_reg)
