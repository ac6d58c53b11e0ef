"""`ClusterMember`: one daemon's presence in the cluster registry. Runs in the daemon process's event loop.

Owns three tasks: the session (open a lease, register, keep it alive, and after a loss re-register
with the same incarnation), the writer (drains the outbox into the registry in batches, and re-publishes
a store snapshot after every (re-)registration), and the node watch (the daemon's view of the cluster).
The daemon gives it a `snapshot` callable and calls `publish` / `unpublish` from its entry events; both
return at once and never fail. Nothing here ever raises into the daemon's startup or stops it: with
the registry away the daemon runs on static peers (design R5, R6).
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from kvd.throttle import Throttle
from kvd.trust import NodeCert

from .backends.backend import (
    Added,
    Backend,
    Conflict,
    NodeEvent,
    RegistryRefused,
    RegistryUnavailable,
    Removed,
    Resync,
    Session,
    SessionLost,
)
from .candidates import Candidate, order_candidates
from .health import Backoff, Breaker, Membership
from .outbox import BATCH_OPS, OUTBOX_LIMIT, Outbox
from .records import HolderRecord, NodeRecord
from .signing import RecordSigner, RecordVerifier

log = logging.getLogger(__name__)
Snapshot = Callable[[], Iterable[HolderRecord]]
MAX_LOOKUPS = 8  # unknown holder nodes read one by one per lookup (holder records name whom they like)


class ClusterMember:
    def __init__(self, backend: Backend, record: NodeRecord, *, ttl: float = 5.0, snapshot: Snapshot = tuple,
                 breaker: Breaker | None = None, outbox_limit: int = OUTBOX_LIMIT, flush_interval: float = 0.005,
                 resync_jitter: float = 2.0, on_node_event: Callable[[NodeEvent], None] | None = None,
                 signer: RecordSigner | None = None, verifier: RecordVerifier | None = None) -> None:
        """With a cluster CA: `signer` signs this node's records, `verifier` decides which records of
        others to believe (the view, holders, a conflicting record under our id)."""
        self.signer, self.verifier = signer, verifier
        self.backend, self.record, self.ttl = backend, signer.node(record) if signer else record, ttl
        self.snapshot = snapshot
        self.breaker = breaker or Breaker()
        self.membership = Membership(ttl)
        self.outbox = Outbox(outbox_limit)
        self.flush_interval = flush_interval
        self.resync_jitter = resync_jitter  # spreads re-publication when a whole fleet reconnects at once
        self.on_node_event = on_node_event
        self.ops: Counter[tuple[str, str]] = Counter()  # (op, ok|error) for kvd_registry_ops_total
        self.lookups: Counter[str] = Counter()  # hit | miss | stale | unavailable
        self.conflict: NodeRecord | None = None
        self.last_error: str | None = None  # the registry's last refusal or failure, for status
        self.refused = False  # the registry refuses our credentials (until a call succeeds)
        self._view: dict[str, NodeRecord] = {}  # verified records only, when there is a verifier
        self._certs: dict[str, NodeCert] = {}  # node id -> its verified cert (with a verifier)
        # node ids that holders named and the watch has not shown: looked up one at a time, backing off
        self._missing: dict[str, Backoff] = {}
        self._said = Throttle()  # "refused", "unreachable": an operator must fix it; once a minute is enough
        self._session: Session | None = None
        self._work = asyncio.Event()
        self._registered = asyncio.Event()
        self._kick = asyncio.Event()  # wakes the session task early (the writer saw the session die)
        self._tasks: list[asyncio.Task] = []
        self._backoff = Backoff(0.05, 1.0)  # the writer's, after a failed batch
        self._resync_at: float | None = None  # when the pending re-publication of the snapshot is due
        self._resync_timer: asyncio.TimerHandle | None = None

    # ---- lifecycle ----
    async def start(self) -> None:
        """Start the tasks and return at once; registration happens in the background."""
        for name, coro in (("session", self._session_loop()), ("writer", self._writer_loop()),
                           ("nodes", self._watch_loop())):
            self._tasks.append(asyncio.create_task(coro, name=f"kvd-cluster-{name}"))

    async def wait_registered(self, timeout: float) -> bool:
        try:
            async with asyncio.timeout(timeout):
                await self._registered.wait()
            return True
        except TimeoutError:
            return False

    async def stop(self) -> None:
        """Revoke the session: the node and its holder records leave the registry now."""
        self.membership.close()
        if self._resync_timer is not None:
            self._resync_timer.cancel()
            self._resync_timer = None
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None
        await self.backend.close()

    # ---- what the daemon calls ----
    def publish(self, record: HolderRecord) -> None:
        self.outbox.publish(self.signer.holder(record) if self.signer else record)
        self._work.set()

    def unpublish(self, rid: str, gen: int | None = None) -> None:
        self.outbox.unpublish(rid, gen)
        self._work.set()

    def nodes(self, role: str | None = None) -> list[NodeRecord]:
        """The cluster as this daemon's watch sees it (this node included once registered)."""
        return sorted((n for n in self._view.values() if role is None or n.role in (role, "any")),
                      key=lambda n: n.node_id)

    def node(self, node_id: str) -> NodeRecord | None:
        return self._view.get(node_id)

    def cert_of(self, node_id: str) -> NodeCert | None:
        """The verified cert of a node in the view (with a verifier; else None)."""
        return self._certs.get(node_id)

    async def locate(self, rid: str, *, allow_streaming: bool = False, exclude: Iterable[str] = ()) -> list[Candidate]:
        """Holders of rid other than us, best first; fails fast while the registry is known down."""
        _, cands = await self._lookup(rid, allow_streaming, set(exclude))
        return cands

    async def find(self, rid: str, timeout: float, *, allow_streaming: bool = False,
                   exclude: Iterable[str] = ()) -> list[Candidate]:
        """Like locate, but waits up to `timeout` for a holder to be published (a get without a
        source). Returns [] at the deadline (a miss); RegistryUnavailable if the registry is down."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        skip = set(exclude)
        rev, cands = await self._lookup(rid, allow_streaming, skip, count=False)
        while not cands:
            left = deadline - loop.time()
            if left <= 0:
                self.lookups["miss"] += 1
                return []
            try:
                rev, found = await self._guarded("wait_holders", self.backend.wait_holders(rid, rev, left))
                cands = await self._candidates(found, allow_streaming, skip)
            except RegistryUnavailable:
                self.lookups["unavailable"] += 1
                raise
            if found and not cands:
                await asyncio.sleep(min(0.05, max(0.0, deadline - loop.time())))  # only ourselves, or streaming
        self.lookups["hit"] += 1
        return cands

    def renew(self, signer: RecordSigner) -> None:
        """This node's cert was renewed: sign our records anew and write them again (same incarnation)."""
        self.signer = signer
        self.record = signer.node(self.record)
        if self.membership.registered:
            self.membership.on_session_lost()
            self._registered.clear()
            self._kick.set()

    def note_stale(self) -> None:
        """The daemon tried a candidate and the holder said no (identity or generation changed)."""
        self.lookups["stale"] += 1

    def status(self) -> dict[str, Any]:
        return {
            "state": self.membership.state, "registered": self.membership.registered, "up": self.breaker.up,
            "breaker": self.breaker.state, "session": self._session.token if self._session else None,
            "node_id": self.record.node_id, "incarnation": f"{self.record.incarnation:x}",
            "nodes": len(self._view), "outbox": len(self.outbox), "published": len(self.outbox.published),
            "resyncs": self.membership.resyncs, "outbox_overflows": self.outbox.overflows,
            "conflict": None if self.conflict is None else {
                "node_id": self.conflict.node_id, "incarnation": f"{self.conflict.incarnation:x}",
                "endpoint": self.conflict.endpoint},
            "ops": {f"{op}:{res}": n for (op, res), n in sorted(self.ops.items())},
            "lookups": dict(self.lookups),
            "dropped": {f"{kind}:{reason}": n for (kind, reason), n in sorted(self.dropped().items())},
            "last_error": self.last_error,
            "refused": self.refused,
            "signed": self.signer is not None,
        }

    def dropped(self) -> Counter[tuple[str, str]]:
        """Records not believed, by (kind, reason): the backend's (malformed, oversized, under the
        wrong key) and the verifier's (unsigned, bad signature, bad cert)."""
        total: Counter[tuple[str, str]] = Counter(getattr(self.backend, "dropped", None) or {})
        if self.verifier is not None:
            total.update(self.verifier.dropped)
        return total

    # ---- internals ----
    async def _guarded(self, op: str, coro) -> Any:
        """Run one registry call and feed its outcome to the breaker and the counters."""
        try:
            result = await coro
        except RegistryRefused as e:
            self.ops[(op, "refused")] += 1
            self.breaker.failure()
            self.last_error, self.refused = str(e), True
            if self._said.allow("refused"):
                log.error("%s (static peers keep working; retrying)", e)
            raise
        except RegistryUnavailable as e:
            self.ops[(op, "error")] += 1
            self.breaker.failure()
            self.last_error = str(e)
            raise
        self.ops[(op, "ok")] += 1
        self.breaker.success()
        self.refused = False
        return result

    async def _lookup(self, rid: str, allow_streaming: bool, skip: set[str],
                      count: bool = True) -> tuple[int, list[Candidate]]:
        if not self.breaker.allow():
            self.lookups["unavailable"] += 1
            raise RegistryUnavailable("registry unavailable: lookups fail fast until it answers again")
        try:
            rev, found = await self._guarded("holders", self.backend.holders(rid))
        except RegistryUnavailable:
            self.lookups["unavailable"] += 1
            raise
        cands = await self._candidates(found, allow_streaming, skip)
        if count:
            self.lookups["hit" if cands else "miss"] += 1
        return rev, cands

    async def _candidates(self, found: list[HolderRecord], allow_streaming: bool, skip: set[str]) -> list[Candidate]:
        unknown = {h.node_id for h in found if h.node_id != self.record.node_id and h.node_id not in self._view}
        for node_id in sorted(unknown)[:MAX_LOOKUPS]:
            await self._look_up(node_id)  # a holder our watch has not shown us yet (it just joined)
        if self.verifier is not None:  # only holders their own node signed
            found = [h for h in found if h.node_id in self._certs and self.verifier.holder(h, self._certs[h.node_id])]
        return order_candidates(found, self._view, self_id=self.record.node_id, now=time.time(), lost=skip,
                                labels=self.record.labels, allow_streaming=allow_streaming)

    async def _look_up(self, node_id: str) -> None:
        """Read one node's record, at most once per backoff per node id: a holder record naming a
        node that is not registered (stale, or forged) must not cost a registry read per waiting get
        every 50 ms."""
        backoff = self._missing.get(node_id)
        if backoff is not None and not backoff.due():
            return
        if backoff is None:
            if len(self._missing) >= 4096:  # bounded: names in holder records are anyone's to make up
                self._missing.clear()
            backoff = self._missing[node_id] = Backoff(0.5, 30.0)
        backoff.failed()
        node = await self._guarded("get_node", self.backend.get_node(node_id))
        if node is not None and node.node_id == node_id and self._believe(node):
            self._view[node_id] = node
            self._missing.pop(node_id, None)

    def _believe(self, node: NodeRecord) -> bool:
        """Whether a node record is to be believed (always, without a CA); keeps its cert."""
        if self.verifier is None:
            return True
        cert = self.verifier.node(node)
        if cert is None:
            self._certs.pop(node.node_id, None)
            return False
        self._certs[node.node_id] = cert
        return True

    async def _session_loop(self) -> None:
        backoff = Backoff(0.1, max(self.ttl / 3, 0.1))  # between attempts while the registry fails
        while True:
            try:
                if self._session is None:
                    self._session = await self._guarded("open_session", self.backend.open_session(self.ttl))
                if not self.membership.registered:
                    await self._register()
                    if not self.membership.registered:
                        await self._sleep(min(self.ttl / 2, 1.0))
                        if self._session is not None:  # waiting out a conflict: the lease must not lapse
                            await self._guarded("keepalive", self._session.keepalive())
                        continue
                await self._sleep(self.ttl / 3)
                session = self._session
                if session is None or not self.membership.registered:
                    continue  # the writer saw the session die meanwhile
                async with asyncio.timeout(max(self.ttl / 2, 0.05)):  # the keepalive watchdog (R8)
                    await self._guarded("keepalive", session.keepalive())
                    intact = await self._guarded("check_node", self.backend.check_node(session, self.record))
                self.membership.on_refreshed()
                backoff.reset()
                if not intact:  # someone changed or deleted our record: a keepalive alone never notices
                    log.warning("this node's record in the registry was changed or deleted: writing it again")
                    self.membership.on_session_lost()
                    self._registered.clear()
            except SessionLost as e:
                self.breaker.success()  # the server answered: it is up, only our session is gone
                log.warning("registry session lost (%s): registering again as %s", e, self.record.node_id)
                self._lost()
            except (RegistryUnavailable, TimeoutError) as e:
                if self.membership.on_refresh_failed():
                    log.warning("registry unreachable for a whole TTL (%s): presuming the session lost", e)
                    self._lost()
                elif ((self._session is None or not self.membership.registered)
                      and not isinstance(e, RegistryRefused)  # (a refusal is logged by _guarded, as an error)
                      and self._said.allow("unreachable")):
                    log.warning("cannot reach the cluster registry to register %s (%s): serving static peers "
                                "meanwhile, retrying", self.record.node_id, e)
                await asyncio.sleep(backoff.failed())
            except Exception:  # a bug here must not end the daemon's membership for good
                log.exception("registry session task failed; starting over")
                self._lost()
                await asyncio.sleep(1.0)

    async def _register(self) -> None:
        assert self._session is not None
        res = await self._guarded("register", self.backend.register_node(self._session, self.record))
        if isinstance(res, Conflict) and self.verifier is not None and not self._believe(res.existing):
            # under our id, a record this cluster's CA does not vouch for: forged, or left by hand
            log.warning("node id %r is held in the registry by a record that does not verify: replacing it",
                        self.record.node_id)
            res = await self._guarded("register", self.backend.replace_node(self._session, self.record, res))
        if isinstance(res, Conflict):
            self.conflict = res.existing
            if self.membership.on_conflict():
                log.error("node id %r is held by another live daemon (incarnation %x at %s): staying out of "
                          "the registry (static peers only) until it leaves", self.record.node_id,
                          res.existing.incarnation, res.existing.endpoint)
            return
        self.conflict = None
        first = self.membership.registrations == 0
        self.membership.on_registered()
        log.info("registered %s in the cluster registry (session %s)%s", self.record.node_id,
                 self._session.token, "" if first else ", re-publishing entries")
        self._registered.set()
        self._work.set()

    def _lost(self) -> None:
        self.membership.on_session_lost()
        self._registered.clear()
        self._session = None  # a new lease; the old one is gone (or will be) with everything under it

    async def _sleep(self, seconds: float) -> None:
        try:
            async with asyncio.timeout(seconds):
                await self._kick.wait()
        except TimeoutError:
            pass
        self._kick.clear()

    async def _writer_loop(self) -> None:
        while True:
            await self._work.wait()
            await self._registered.wait()
            await asyncio.sleep(self.flush_interval)  # let a burst of entry events coalesce
            self._work.clear()
            try:
                await self._flush()
            except Exception:  # e.g. the daemon's snapshot callable failed: keep the writer alive
                log.exception("registry writer failed; retrying")
                self.outbox.resync_needed = True
                self._work.set()
                await asyncio.sleep(1.0)

    async def _flush(self) -> None:
        if self.membership.resync_needed or self.outbox.resync_needed:
            self._resync_when_due()
        while self.membership.registered and (ops := self.outbox.take(BATCH_OPS)):
            try:
                await self._guarded("publish", self.backend.publish_batch(self._session, ops))
            except SessionLost:
                self.outbox.failed(ops)
                self._lost()
                self._kick.set()  # the session task re-registers now, not at its next keepalive
            except RegistryUnavailable:
                self.outbox.failed(ops)
                self._work.set()
                await asyncio.sleep(self._backoff.failed())
                return
            else:
                self.outbox.done(ops)
                self._backoff.reset()

    def _resync_when_due(self) -> None:
        """Re-publish the store's snapshot, after a random delay when this is a re-registration (a
        whole fleet re-registering at once after a registry blip spreads its bulk writes). Only the
        bulk waits: entries completed meanwhile go out at once (a get by request id for a new
        entry must not wait out the jitter)."""
        loop = asyncio.get_running_loop()
        if self._resync_at is None:
            spread = self.membership.registrations > 1 and self.resync_jitter > 0
            self._resync_at = loop.time() + (random.uniform(0, self.resync_jitter) if spread else 0.0)
        if loop.time() < self._resync_at:
            if self._resync_timer is None:
                self._resync_timer = loop.call_at(self._resync_at, self._resync_due)
            return
        self._resync_at = None
        snapshot = self.snapshot()
        self.outbox.resync([self.signer.holder(r) for r in snapshot] if self.signer else snapshot)
        self.membership.on_resynced()

    def _resync_due(self) -> None:
        self._resync_timer = None
        self._work.set()

    async def _watch_loop(self) -> None:
        async for ev in self.backend.watch_nodes():
            if isinstance(ev, Resync):
                self._certs = {}
                view = {}
                for i, node in enumerate(ev.nodes):
                    if self._believe(node):
                        view[node.node_id] = node
                    if self.verifier is not None and i % 256 == 255:
                        await asyncio.sleep(0)  # (verifying a big listing must not stall the loop)
                self._view = view
                if self.verifier is not None:
                    ev = Resync(tuple(view.values()), ev.revision)
            elif isinstance(ev, Added):
                if self._believe(ev.node):
                    self._view[ev.node.node_id] = ev.node
                else:  # a forged record overwrote the node's key: the node's own record is gone
                    self._view.pop(ev.node.node_id, None)
                    ev = Removed(ev.node.node_id, ev.revision)
            elif isinstance(ev, Removed):
                self._view.pop(ev.node_id, None)
                self._certs.pop(ev.node_id, None)
            if self.on_node_event is not None:
                try:
                    self.on_node_event(ev)
                except Exception:
                    log.exception("cluster node event handler failed")
