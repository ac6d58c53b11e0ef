"""An in-process registry: a `MemoryServer` shared by any number of `MemoryBackend` clients (the
process of the test or experiment that creates it; no daemon uses it).

For tests (the contract suite runs against it as against etcd and Redis) and for single-process
experiments; never for production. It models the etcd semantics (leases, a revision per write,
holder keys bound to the writer's lease) and the faults the contract is about: `pause()` is a
SIGSTOP (calls hang until their deadline), `stop()` a dead server (calls fail at once), `wipe()` a
server restarted empty.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from ..records import HolderRecord, NodeRecord, encode_node
from .backend import (
    DEFAULT_OP_TIMEOUT,
    Added,
    Conflict,
    NodeEvent,
    Publish,
    PublishOp,
    Registered,
    RegistryUnavailable,
    Removed,
    Resync,
    SessionLost,
)

_LOG_KEEP = 10_000  # node events kept for watchers; one that falls further behind gets a Resync
_POLL = 0.05  # watchers re-check lease expiry this often when nothing else happens


class MemoryServer:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.paused = False
        self.down = False
        self._ids = itertools.count(1)
        self._changed = asyncio.Event()
        self._reset()

    def _reset(self) -> None:
        self.rev = 1
        self.epoch = getattr(self, "epoch", 0) + 1
        self.leases: dict[int, tuple[float, float]] = {}  # id -> (ttl, expires at)
        self.nodes: dict[str, tuple[NodeRecord, int]] = {}  # node id -> (record, lease)
        self.holders: dict[tuple[str, str], tuple[HolderRecord, int]] = {}  # (rid, node) -> (record, lease)
        self.log: list[tuple[int, NodeEvent]] = []

    # ---- faults ----
    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self._notify()

    def stop(self) -> None:
        self.down = True

    def start(self) -> None:
        self.down = False
        self._notify()

    def wipe(self) -> None:
        self._reset()
        self._notify()

    # ---- state ----
    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _bump(self) -> int:
        self.rev += 1
        self._notify()
        return self.rev

    def put_unleased(self, record: NodeRecord) -> None:
        """Write a node record under no lease, as anyone who can write to a registry can (tests)."""
        self.nodes[record.node_id] = (record, 0)
        self.node_event(Added(record, self._bump()))

    def node_event(self, ev: NodeEvent) -> None:
        self.log.append((ev.revision, ev))
        del self.log[:-_LOG_KEEP]

    def expire(self) -> None:
        now = self.clock()
        for lid in [lid for lid, (_, at) in self.leases.items() if at <= now]:
            self.revoke(lid)

    def revoke(self, lid: int) -> None:
        if self.leases.pop(lid, None) is None:
            return
        for node_id in [n for n, (_, lease) in self.nodes.items() if lease == lid]:
            del self.nodes[node_id]
            self.node_event(Removed(node_id, self._bump()))
        for key in [k for k, (_, lease) in self.holders.items() if lease == lid]:
            del self.holders[key]
            self._bump()

    async def enter(self, timeout: float) -> None:
        """What every call meets first: a dead server refuses, a stopped one hangs to the deadline."""
        if self.down:
            raise RegistryUnavailable("memory registry is down")
        if self.paused:
            try:
                async with asyncio.timeout(timeout):
                    while self.paused:
                        await self._changed.wait()
            except TimeoutError:
                raise RegistryUnavailable(f"memory registry did not answer within {timeout:.2f} s") from None
        self.expire()

    async def changed(self, timeout: float) -> None:
        try:
            async with asyncio.timeout(timeout):
                await self._changed.wait()
        except TimeoutError:
            pass


@dataclass
class MemorySession:
    backend: MemoryBackend
    lease: int
    ttl: float
    epoch: int

    @property
    def token(self) -> str:
        return f"{self.lease:x}"

    async def keepalive(self) -> None:
        srv = self.backend.server
        await srv.enter(self.backend.op_timeout)
        if srv.epoch != self.epoch or self.lease not in srv.leases:
            raise SessionLost(f"lease {self.token} is gone")
        srv.leases[self.lease] = (self.ttl, srv.clock() + self.ttl)

    def check(self) -> None:
        srv = self.backend.server
        if srv.epoch != self.epoch or self.lease not in srv.leases:
            raise SessionLost(f"lease {self.token} is gone")

    async def close(self) -> None:
        srv = self.backend.server
        if not srv.down and not srv.paused and srv.epoch == self.epoch:
            srv.revoke(self.lease)


class MemoryBackend:
    def __init__(self, server: MemoryServer, op_timeout: float = DEFAULT_OP_TIMEOUT) -> None:
        self.server = server
        self.op_timeout = op_timeout
        self.dropped: Counter[tuple[str, str]] = Counter()  # (nothing here is ever malformed)

    async def open_session(self, ttl: float) -> MemorySession:
        srv = self.server
        await srv.enter(self.op_timeout)
        lid = next(srv._ids)
        srv.leases[lid] = (ttl, srv.clock() + ttl)
        return MemorySession(self, lid, ttl, srv.epoch)

    async def register_node(self, session: MemorySession, record: NodeRecord) -> Registered | Conflict:
        await self.server.enter(self.op_timeout)
        session.check()
        held = self.server.nodes.get(record.node_id)
        # a record under no lease (lease 0: written by hand, as an attacker would) is never a conflict
        if held is not None and held[1] != 0 and held[0].incarnation != record.incarnation:
            return Conflict(held[0], version=held)
        return Registered(self._put_node(session, record))

    async def replace_node(self, session: MemorySession, record: NodeRecord,
                           conflict: Conflict) -> Registered | Conflict:
        await self.server.enter(self.op_timeout)
        session.check()
        held = self.server.nodes.get(record.node_id)
        if held is not None and held is not conflict.version:
            return Conflict(held[0], version=held)
        return Registered(self._put_node(session, record))

    async def check_node(self, session: MemorySession, record: NodeRecord) -> bool:
        await self.server.enter(self.op_timeout)
        held = self.server.nodes.get(record.node_id)
        return held is not None and held[1] == session.lease and encode_node(held[0]) == encode_node(record)

    async def get_node(self, node_id: str) -> NodeRecord | None:
        await self.server.enter(self.op_timeout)
        held = self.server.nodes.get(node_id)
        return None if held is None else held[0]

    def _put_node(self, session: MemorySession, record: NodeRecord) -> int:
        self.server.nodes[record.node_id] = (record, session.lease)
        rev = self.server._bump()
        self.server.node_event(Added(record, rev))
        return rev

    async def update_node(self, session: MemorySession, record: NodeRecord) -> None:
        await self.server.enter(self.op_timeout)
        session.check()
        held = self.server.nodes.get(record.node_id)
        if held is None or held[0].incarnation != record.incarnation:
            raise SessionLost(f"node {record.node_id} is not registered by this incarnation")
        self._put_node(session, record)

    async def list_nodes(self) -> tuple[int, list[NodeRecord]]:
        await self.server.enter(self.op_timeout)
        return self.server.rev, [r for r, _ in self.server.nodes.values()]

    async def watch_nodes(self) -> AsyncIterator[NodeEvent]:
        srv = self.server
        while True:
            try:
                rev, nodes = await self.list_nodes()
                epoch = srv.epoch
                yield Resync(tuple(nodes), rev)
                while True:
                    await srv.changed(_POLL)
                    await srv.enter(self.op_timeout)
                    if srv.epoch != epoch or (srv.log and srv.log[0][0] > rev + 1 and len(srv.log) >= _LOG_KEEP):
                        break  # wiped, or fell behind the kept log: start over with a Resync
                    for ev_rev, ev in [e for e in srv.log if e[0] > rev]:
                        rev = ev_rev
                        yield ev
            except RegistryUnavailable:
                await asyncio.sleep(_POLL)

    async def holders(self, rid: str) -> tuple[int, list[HolderRecord]]:
        await self.server.enter(self.op_timeout)
        now = time.time()
        found = [r for (hrid, _), (r, _) in self.server.holders.items() if hrid == rid and not r.expired(now)]
        return self.server.rev, found

    async def wait_holders(self, rid: str, from_rev: int, timeout: float) -> tuple[int, list[HolderRecord]]:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            left = deadline - asyncio.get_running_loop().time()
            rev, found = await self.holders(rid)
            if found or left <= 0:
                return rev, found
            await self.server.changed(min(left, _POLL))

    async def publish_batch(self, session: MemorySession, ops: Sequence[PublishOp]) -> None:
        srv = self.server
        await srv.enter(self.op_timeout)
        session.check()
        for op in ops:
            key = (op.record.rid, op.record.node_id)
            if isinstance(op, Publish):
                srv.holders[key] = (op.record, session.lease)
            elif key in srv.holders and srv.holders[key][0] == op.record:
                del srv.holders[key]
        srv._bump()

    async def close(self) -> None:
        pass
