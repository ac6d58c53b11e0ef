"""`Registry`: the read-only face of a cluster registry for routers and proxies (their processes, Python).

Runs in the router's or proxy's own asyncio loop; it never registers anything. Routers in other
languages read the same records from the daemons' HTTP port (/cluster/nodes, /cluster/locate) or
straight from etcd / Redis (schema: proto/REGISTRY.md).

    async with Registry("etcd://10.0.0.5:2379", cluster="prod", ca="/etc/kvd/ca.key") as reg:
        decoders = await reg.nodes(role="decode")
        where = await reg.locate("req-42")        # best holder first
        async for ev in reg.watch_nodes():        # Resync, then Added / Removed
            ...

With `ca` (the cluster CA's public key file, or its 32 raw bytes), only records that verify are
returned: node records signed under a cert of that CA for their node id, holder records signed by
their node. Without it, every record is a hint from whoever could write to the registry.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from .backends.backend import DEFAULT_OP_TIMEOUT, Added, NodeEvent, RegistryUnavailable, Removed, Resync
from .candidates import Candidate, order_candidates
from .health import Breaker
from .records import ROLES, HolderRecord, NodeRecord
from .signing import RecordVerifier
from .url import open_backend, parse_url

T = TypeVar("T")  # what a guarded registry call returns

class Registry:
    def __init__(self, url: str, cluster: str = "kvd", *, op_timeout: float = DEFAULT_OP_TIMEOUT,
                 labels: dict[str, str] | None = None, breaker: Breaker | None = None, ca: str | bytes | None = None,
                 password_file: str = "", ca_file: str = "", cert_file: str = "", key_file: str = "") -> None:
        """Raises ValueError for a bad URL or cluster name; connects on first use. `labels` (zone,
        host) are the caller's own, so that locate() prefers holders near it. `ca`: see above;
        password_file, ca_file (the registry's TLS CA), cert_file, key_file: as kvd serve's
        --registry-password-file, --registry-ca, --registry-cert, --registry-key."""
        self.url = parse_url(url)
        self.cluster = cluster
        self.backend = open_backend(self.url, cluster, op_timeout, password_file=password_file, ca_file=ca_file,
                                    cert_file=cert_file, key_file=key_file)
        self.verifier = _verifier(ca, cluster) if ca is not None else None
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

    async def _call(self, coro: Coroutine[Any, Any, T]) -> T:
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
        nodes = self._believed(nodes)
        self._nodes = {n.node_id: n for n in nodes}
        return sorted((n for n in nodes if role is None or n.role in (role, "any")), key=lambda n: n.node_id)

    def _believed(self, nodes: list[NodeRecord]) -> list[NodeRecord]:
        return nodes if self.verifier is None else [n for n in nodes if self.verifier.node(n) is not None]

    async def watch_nodes(self) -> AsyncIterator[NodeEvent]:
        """Resync (the full listing) first, then Added / Removed; another Resync after any gap.
        Survives registry outages (it re-lists when the registry is back); stop it with aclose().
        With `ca`, a record that does not verify is left out (an Added of one is a Removed)."""
        async for ev in self.backend.watch_nodes():
            if self.verifier is not None and isinstance(ev, Resync):
                ev = Resync(tuple(self._believed(list(ev.nodes))), ev.revision)
            elif self.verifier is not None and isinstance(ev, Added) and self.verifier.node(ev.node) is None:
                ev = Removed(ev.node.node_id, ev.revision)
            yield ev

    async def locate(self, rid: str, *, allow_streaming: bool = False) -> list[Candidate]:
        """Who holds `rid`, best first (complete, nearest, most room): each has .node (its endpoint,
        node id, incarnation) and .holder (gen, nbytes). A hint: the holder verifies when asked."""
        _, found = await self._call(self.backend.holders(rid))
        if not found:
            return []
        if any(self._unknown(h) for h in found):
            _, nodes = await self._call(self.backend.list_nodes())
            self._nodes = {n.node_id: n for n in self._believed(nodes)}
        if self.verifier is not None:
            verifier = self.verifier
            certs = {h.node_id: verifier.node(self._nodes[h.node_id]) for h in found if h.node_id in self._nodes}
            found = [h for h in found if (cert := certs.get(h.node_id)) is not None and verifier.holder(h, cert)]
        return order_candidates(found, self._nodes, self_id=None, now=time.time(),
                                labels=self.labels, allow_streaming=allow_streaming)

    def _unknown(self, holder: HolderRecord) -> bool:
        node = self._nodes.get(holder.node_id)
        return node is None or node.incarnation != holder.incarnation


def _verifier(ca: str | bytes, cluster: str) -> RecordVerifier:
    from kvd.trust import Authority, load_ca_public

    return RecordVerifier(Authority(ca if isinstance(ca, bytes) else load_ca_public(ca), cluster))
