"""kvd.cluster.Registry, the router face, against real etcd and Redis servers with live members."""
from __future__ import annotations

import asyncio
import time

import pytest

from kvd.cluster import Registry, Removed, Resync
from kvd.cluster.backends.backend import RegistryUnavailable
from kvd.cluster.health import Breaker

from .conftest import Harness, run
from .test_member import member, put


@pytest.fixture(params=["etcd", "redis"])
def real_reg(request):
    h = Harness(request.param, request.getfixturevalue(f"{request.param}_server"))
    yield h
    h.heal()


async def next_event(it, timeout=3.0):
    async with asyncio.timeout(timeout):
        return await anext(it)


@run
async def _face(h: Harness):
    p, d = member(h, "p1", 1), member(h, "d1", 2)
    router = Registry(h.url, cluster=h.cluster, op_timeout=0.3)
    watch = router.watch_nodes()
    try:
        first = await next_event(watch)
        assert isinstance(first, Resync) and first.nodes == ()
        await p.start()
        await d.start()
        assert await p.wait_registered(3) and await d.wait_registered(3)
        seen = {(await next_event(watch)).node.node_id for _ in range(2)}
        assert seen == {"p1", "d1"}
        assert [n.node_id for n in await router.nodes()] == ["d1", "p1"]
        assert [n.node_id for n in await router.nodes(role="decode")] == ["d1"]
        with pytest.raises(ValueError, match="role"):
            await router.nodes(role="boss")
        assert await router.locate("r1") == []
        put(p, "r1")
        deadline = time.monotonic() + 3
        while not (found := await router.locate("r1")):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert [(c.node.node_id, c.endpoint, c.holder.gen) for c in found] == [("p1", "tcp://127.0.0.1:7001", 1)]
        # another cluster on the same server sees none of it
        other = Registry(h.url, cluster=h.cluster + "-other")
        assert await other.nodes() == [] and await other.locate("r1") == []
        await other.close()
        await p.stop()  # leaves: the lease is revoked / the node key deleted
        ev = await next_event(watch)
        assert isinstance(ev, Removed) and ev.node_id == "p1"
        assert await router.locate("r1") == []  # its holder records went with it
    finally:
        await watch.aclose()
        await router.close()
        await p.stop()
        await d.stop()


def test_registry_nodes_watch_and_locate(real_reg):
    _face(real_reg)


@run
async def _down(h: Harness):
    router = Registry(h.url, cluster=h.cluster, op_timeout=0.2, breaker=Breaker(3, retry_after=0.3))
    try:
        h.pause()
        for _ in range(3):
            with pytest.raises(RegistryUnavailable):
                await router.nodes()
        t0 = time.monotonic()
        with pytest.raises(RegistryUnavailable, match="failing fast"):
            await router.locate("r")
        assert time.monotonic() - t0 < 0.05
        h.resume()
        await asyncio.sleep(0.35)  # the breaker's probe window
        assert await router.nodes() == []
    finally:
        h.resume()
        await router.close()


def test_registry_fails_fast_when_the_server_is_stopped(real_reg):
    _down(real_reg)


def test_registry_rejects_bad_urls():
    for url in ("etcd//h:1", "redis://h:1/db", "zk://h:1"):
        with pytest.raises(ValueError, match="registry URL"):
            Registry(url)
    with pytest.raises(ValueError, match="cluster name"):
        Registry("etcd://127.0.0.1:2379", cluster="a:b")
