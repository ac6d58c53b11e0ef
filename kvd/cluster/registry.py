"""`Registry`: the read-only face of a cluster registry for routers and proxies (their processes, Python).

Runs in the router's or proxy's own asyncio loop; it never registers anything. Routers in other
languages read the same records from the daemons' HTTP port (/cluster/nodes, /cluster/locate) or
straight from etcd / Redis (schema: proto/REGISTRY.md).

    async with Registry("etcd://10.0.0.5:2379", cluster="prod") as reg:
        decoders = await reg.nodes(role="decode")
        where = await reg.locate("req-42")        # best holder first
        async for ev in reg.watch_nodes():        # Resync, then Added / Removed
            ...
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from .backend import DEFAULT_OP_TIMEOUT, NodeEvent, RegistryUnavailable
from .directory import Candidate, order_candidates
from .health import Breaker
from .records import ROLES, HolderRecord, NodeRecord
from .url import open_backend, parse_url


class Registry:
    def __init__(self, url: str, cluster: str = "kvd", *, op_timeout: float = DEFAULT_OP_TIMEOUT,
                 labels: dict[str, str] | None = None, breaker: Breaker | None = None) -> None:
        """Raises ValueError for a bad URL or cluster name; connects on first use. `labels` (zone,
        host) are the caller's own, so that locate() prefers holders near it."""
        self.url = parse_url(url)
        self.cluster = cluster
        self.backend = open_backend(self.url, cluster, op_timeout)
        self.labels = dict(labels or {})
        self.breaker = breaker or Breaker()  # fail fast after 3 failures, probe every 2 s
        # node records of holders, read again only when a holder's node (or incarnation) is not among
        # them: liveness is the holders' own (they die with their node), so a locate is one registry call,
        # not one plus a listing of the whole cluster
        self._nodes: dict[str, NodeRecord] = {}

    async def __aenter__(self) -> Registry:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        await self.backend.close()

    async def _call(self, coro) -> Any:
        if not self.breaker.allow():
            coro.close()
            raise RegistryUnavailable(f"registry {self.url} unavailable (failing fast)")
        try:
            result = await coro
        except RegistryUnavailable:
            self.breaker.failure()
            raise
        self.breaker.success()
        return result

    async def nodes(self, role: str | None = None) -> list[NodeRecord]:
        """Live nodes sorted by id; with `role`, those of that role or of role "any"."""
        if role is not None and role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        _, nodes = await self._call(self.backend.list_nodes())
        self._nodes = {n.node_id: n for n in nodes}
        return sorted((n for n in nodes if role is None or n.role in (role, "any")), key=lambda n: n.node_id)

    def watch_nodes(self) -> AsyncIterator[NodeEvent]:
        """Resync (the full listing) first, then Added / Removed; another Resync after any gap.
        Survives registry outages (it re-lists when the registry is back); stop it with aclose()."""
        return self.backend.watch_nodes()

    async def locate(self, rid: str, *, allow_streaming: bool = False) -> list[Candidate]:
        """Who holds `rid`, best first (complete, nearest, most room): each has .node (its endpoint,
        node id, incarnation) and .holder (gen, nbytes). A hint: the holder verifies when asked."""
        _, found = await self._call(self.backend.holders(rid))
        if not found:
            return []
        if any(self._unknown(h) for h in found):
            _, nodes = await self._call(self.backend.list_nodes())
            self._nodes = {n.node_id: n for n in nodes}
        return order_candidates(found, self._nodes, self_id=None, now=time.time(),
                                labels=self.labels, allow_streaming=allow_streaming)

    def _unknown(self, holder: HolderRecord) -> bool:
        node = self._nodes.get(holder.node_id)
        return node is None or node.incarnation != holder.incarnation
