"""Fixtures for the registry tests: real etcd and Redis servers (one of each per test session, every
test in its own cluster prefix), an in-process memory server, and `reg`, one harness parametrized
over the three.

A missing server binary or redis-py skips the tests locally but fails them when CI=true, so a green
CI cannot hide a missing install step (./dev test installs both).
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import os
import time
import uuid

import pytest

from kvd.cluster.backends.inmemory import MemoryBackend, MemoryServer

from .servers import EtcdServer, RedisServer, Server, find_etcd, find_redis, start_server, stop_server

TEST_TIMEOUT = 30.0


def _missing(what: str) -> None:
    msg = f"{what} is not installed (./dev test installs it)"
    if os.environ.get("CI") == "true":
        pytest.fail(msg)
    pytest.skip(msg)


def start_or_skip(kind: str) -> Server:
    """A real etcd or Redis server of its own (free ports, a temp dir), for a test module: the test
    is skipped where the binary is missing (failed under CI=true, where ./dev test installs it)."""
    binary = find_etcd() if kind == "etcd" else find_redis()
    if binary is None:
        _missing(kind)
    return start_server(EtcdServer if kind == "etcd" else RedisServer, binary)


def _loop_factory():
    # the daemon runs on uvloop; KVD_TEST_LOOP=asyncio runs the same tests on the stock loop
    if os.environ.get("KVD_TEST_LOOP", "uvloop") == "uvloop":
        import uvloop
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(coro_fn):
    """Run an async test in a fresh event loop, bounded (a hung registry must fail, not hang the suite)."""
    @functools.wraps(coro_fn)
    def wrapper(*args, **kwargs):
        async def bounded():
            async with asyncio.timeout(TEST_TIMEOUT):
                return await coro_fn(*args, **kwargs)
        with asyncio.Runner(loop_factory=_loop_factory) as runner:
            return runner.run(bounded())
    return wrapper


@pytest.fixture(scope="session")
def etcd_server():
    binary = find_etcd()
    if binary is None:
        _missing("etcd (Debian package etcd-server)")
    server = start_server(EtcdServer, binary)
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def redis_server():
    binary = find_redis()
    if binary is None:
        _missing("redis-server (Debian package redis-server)")
    try:
        import redis  # noqa: F401
    except ImportError:
        _missing("redis-py (pip install redis)")
    server = start_server(RedisServer, binary)
    yield server
    stop_server(server)


_clusters = itertools.count()


class Harness:
    """One registry server of one kind, and clients of it ("daemons") in a cluster of their own."""

    def __init__(self, kind: str, server: Server | MemoryServer) -> None:
        self.kind, self.server = kind, server
        self.cluster = f"t{next(_clusters)}-{uuid.uuid4().hex[:6]}"
        self._backends: list = []

    @property
    def url(self) -> str:
        assert not isinstance(self.server, MemoryServer)
        return self.server.url

    def backend(self, op_timeout: float = 0.5):
        if self.kind == "memory":
            b = MemoryBackend(self.server, op_timeout=op_timeout)
        elif self.kind == "etcd":
            from kvd.cluster.backends.etcd import EtcdBackend
            b = EtcdBackend([("127.0.0.1", self.server.client_port)], cluster=self.cluster, op_timeout=op_timeout)
        else:
            from kvd.cluster.backends.redis import RedisBackend
            b = RedisBackend("127.0.0.1", self.server.port, cluster=self.cluster, op_timeout=op_timeout, poll=0.05)
        self._backends.append(b)
        return b

    async def close_all(self) -> None:
        for b in self._backends:
            await b.close()
        self._backends.clear()

    def pause(self) -> None:
        self.server.pause()

    def resume(self) -> None:
        self.server.resume()

    def restart_wiped(self) -> None:
        if isinstance(self.server, MemoryServer):
            self.server.wipe()
        else:
            self.server.restart(wipe=True)

    # ---- what anyone who can write to the registry can do (the attacker of the fleet-trust tests) ----
    async def forge_node(self, node_id: str, record, leased: bool = True) -> None:
        """Write `record` (any content) under node_id's key, bound to a lease (TTL) of its own or to none."""
        from kvd.cluster.records import EtcdKeys, RedisKeys, encode_node

        if self.kind == "memory":
            srv = self.server
            if not leased:
                srv.put_unleased(record)
                return
            lid = next(srv._ids)
            srv.leases[lid] = (60.0, srv.clock() + 60.0)
            srv.nodes[node_id] = (record, lid)
            from kvd.cluster.backends.backend import Added
            srv.node_event(Added(record, srv._bump()))
        elif self.kind == "etcd":
            put = {"key": _b64(EtcdKeys(self.cluster).node(node_id)), "value": _b64(encode_node(record))}
            if leased:
                put["lease"] = _etcd(self.server, "/v3/lease/grant", {"TTL": 60})["ID"]
            _etcd(self.server, "/v3/kv/put", put)
        else:
            import redis
            keys = RedisKeys(self.cluster)
            r = redis.Redis(port=self.server.port)
            r.set(keys.node(node_id), encode_node(record), px=60_000 if leased else None)
            r.zadd(keys.nodes, {keys.node(node_id): int(time.time() * 1000) + 60_000})
            r.incr(keys.nodes_version)
            r.close()

    async def forge_holder(self, record) -> None:
        """Write a holder record for record.rid under record.node_id's name."""
        from kvd.cluster.records import EtcdKeys, RedisKeys, encode_holder, key_part

        if self.kind == "memory":
            self.server.holders[(record.rid, record.node_id)] = (record, 0)
            self.server._bump()
        elif self.kind == "etcd":
            _etcd(self.server, "/v3/kv/put", {"key": _b64(EtcdKeys(self.cluster).holder(record.rid, record.node_id)),
                                              "value": _b64(encode_holder(record))})
        else:
            import redis
            r = redis.Redis(port=self.server.port)
            key = RedisKeys(self.cluster).holders(record.rid)
            r.hset(key, key_part(record.node_id), encode_holder(record))
            r.pexpire(key, 60_000)
            r.close()

    def heal(self) -> None:
        """Leave a shared server running and answering for the next test."""
        self.server.resume()
        if isinstance(self.server, Server) and not self.server.alive():
            self.server.start()


def _b64(value: str | bytes) -> str:
    import base64
    return base64.b64encode(value.encode() if isinstance(value, str) else value).decode()


def _etcd(server, path: str, body: dict) -> dict:
    import json
    import urllib.request
    req = urllib.request.Request(f"http://127.0.0.1:{server.client_port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


@pytest.fixture(params=["memory", "etcd", "redis"])
def reg(request):
    if request.param == "memory":
        h = Harness("memory", MemoryServer())
    else:
        h = Harness(request.param, request.getfixturevalue(f"{request.param}_server"))
    yield h
    h.heal()
