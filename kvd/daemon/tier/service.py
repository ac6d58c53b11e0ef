"""The KV tier's requests from local clients (daemon process): cache_put/commit, cache_get/release,
exists, clear, stats, events, answered at once from `page_store.py`; and its Prometheus families.

Each batch is one request and one reply: a put reserves pool room for its new pages and says
where to write them (the client copies, then commits the token); a get pins its hits and says
where to read them (the client copies, then releases the token, without a reply). Tokens belong
to the connection that got them: another connection cannot commit or release them, and a
connection that hangs up gives back what it held (its uncommitted pages go, its pins end).
Who holds which token is the local side's ledger (`local/ledger.py`), the one that keeps the handoffs'
reservations too, and a reservation's life is a handoff's (`local/reservation.py`): this service tells
the ledger what happened and answers as it says. One not
committed within the lease timeout ends (its pages are unlisted, and its commit answers None), but
its blocks stay parked until the writer commits, gives up or hangs up, since a writer that was only
paused (GC, SIGSTOP, swap) still copies into them when it runs again: freed at once, they could be
someone else's by then. A pin has no deadline either, since its reader may still be copying out (it
ends with the reader's release or its disconnect).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvd.errors import BadRequest, PeerUnavailable
from kvd.throttle import Throttle
from kvd.wire import protocol as p
from kvd.wire.layout import physical_segments

from ..local import events as ev
from ..local.ledger import LocalLedger
from ..store.page_names import check_batch
from ..store.page_store import TOP_NAMESPACES, CacheStore, Page
from .disk.level import DiskTier
from .disk.readback import Loaded
from .homes import TIMEOUT as TIER_TIMEOUT
from .homes import TierPeers

log = logging.getLogger(__name__)

MAX_LABEL = 64  # characters of a namespace shown as a metrics label (they are printable ASCII)


class CacheService:
    def __init__(self, store: CacheStore, block_size: int, lease_timeout: float, ledger: LocalLedger, *,
                 peers: TierPeers | None = None, reply: Callable[[bytes, p.Message], bool] | None = None,
                 disk: DiskTier | None = None, media: Callable[[], dict] | None = None) -> None:
        self.store = store
        self.block_size = block_size
        self.lease_timeout = lease_timeout
        self.ledger = ledger  # who holds which token (the local handlers' ledger: one for handoffs and pages)
        self._throttle = Throttle()
        # with a registry: pages homed elsewhere are sent there and asked of it (homes.py)
        self.peers = peers
        self.reply = reply  # a late answer to a client
        self._tasks: set[asyncio.Task[None]] = set()
        self.disk = disk  # with --cache-dir: what RAM misses may be on disk
        self.media = media  # the figures by medium (disk/media.py)
        self._routes = self.routes()

    def routes(self) -> dict[type[p.Message], Callable[[bytes, Any], p.Message | None]]:
        """Each cache request's handler, by type: `handle` dispatches through this table (one entry
        for every type of `p.CACHE_REQUESTS`)."""
        return {p.CachePut: self._put, p.CacheCommit: self._commit, p.CacheGet: self._get_anywhere,
                p.CacheRelease: self._release, p.CacheExists: self._exists, p.CacheClear: self._clear,
                p.CacheEvents: self._events, p.CacheStats: self._stats}

    def handle(self, rid: bytes, msg: p.Message) -> p.Message | None:
        handler = self._routes.get(type(msg))
        if handler is None:
            raise BadRequest(f"{msg.TYPE} is not a cache request")
        return handler(rid, msg)

    def _late(self) -> bool:
        """Whether an answer may come later, from a task (the daemon gave a way to send one)."""
        return self.reply is not None

    def _put(self, rid: bytes, msg: p.CachePut) -> p.CacheSlots:
        token, results = self.store.reserve(msg.namespace, msg.keys, msg.pages)
        if self.store.writing(token):
            self.ledger.handle(ev.PagesReserved(rid, token, time.monotonic() + self.lease_timeout))
        return p.CacheSlots(req=msg.req, token=token, slots=[self._slot(r) for r in results])

    def _commit(self, rid: bytes, msg: p.CacheCommit) -> p.Ok | None:
        # (None: not this connection's, or its lease ran out; a list: dropped, as it gave up)
        (done,) = self.ledger.handle(ev.PagesCommit(rid, msg.token, msg.ok))
        if isinstance(done, ev.Answer):
            return p.Ok(req=msg.req, value=done.value)
        assert isinstance(done, ev.PagesPublished)
        pages, published = done.pages, done.published
        if self.peers is not None and self._late():
            by_home = self._homes_of(self.peers, [page for page, ok in zip(pages, published, strict=True) if ok])
            if by_home:  # answered once the homes have them (or within the tier's deadline)
                self._later(self._commit_at_homes(self.peers, rid, msg.req, published, by_home))
                return None
        return p.Ok(req=msg.req, value=published)

    def _get_anywhere(self, rid: bytes, msg: p.CacheGet) -> p.CacheSlots | None:
        """A get whose misses may be on this node's disk or at their homes, when it has either."""
        if (self.peers is None and self.disk is None) or not self._late():
            return self._get(rid, msg)
        # (the hits stay pinned meanwhile: what the misses bring into RAM must not evict them)
        pinned, found = self.store.lease(msg.namespace, msg.keys, msg.sizes, count=False)
        misses = [i for i, page in enumerate(found) if page is None]
        try:
            on_disk = self.disk.wanted(msg.namespace, msg.keys, msg.sizes, misses) if self.disk else []
            by_home = (self._remote(self.peers, msg.namespace, msg.keys, sorted(set(misses) - set(on_disk)))
                       if self.peers is not None else {})
        except Exception:
            self.store.release(pinned)
            raise
        if not by_home and not on_disk:
            self.store.release(pinned)
            return self._get(rid, msg)
        self._later(self._get_from_homes(rid, msg, by_home, on_disk, pinned))
        return None

    def _release(self, rid: bytes, msg: p.CacheRelease) -> None:
        self.ledger.handle(ev.PagesRelease(rid, msg.token))  # (fire and forget: a stale token is ignored)

    def _exists(self, rid: bytes, msg: p.CacheExists) -> p.Ok | None:
        if (self.peers is None and self.disk is None) or not self._late():
            return p.Ok(req=msg.req, value=self.store.exists(msg.namespace, msg.keys))
        local = self._exists_here(msg.namespace, msg.keys)
        if self.disk is not None and local < len(msg.keys) and self.disk.probing(msg.namespace):
            self._later(self._exists_probed(self.disk, rid, msg, local))  # (the disk's scan is not over)
            return None
        if self.peers is None:
            return p.Ok(req=msg.req, value=local)
        by_home = self._remote(self.peers, msg.namespace, msg.keys, range(local, len(msg.keys)))
        if local == len(msg.keys) or not any(local in idx for idx in by_home.values()):
            return p.Ok(req=msg.req, value=local)
        self._later(self._exists_at_homes(self.peers, rid, msg, local, by_home))
        return None

    def _clear(self, rid: bytes, msg: p.CacheClear) -> p.Ok | None:
        store = self.store
        check_batch(msg.namespace, [])
        on_disk, cleared = 0, None
        if self.disk is not None:  # (first: it counts the pages only the disk holds)
            on_disk, cleared = self.disk.clear(msg.namespace,
                                               lambda key: store.held_size(msg.namespace, key) is not None)
        dropped = store.clear(msg.namespace) + on_disk
        cluster = self.peers is not None and self._late() and bool(self.peers.others())
        if cluster or cleared is not None:  # answered once every node did, the disk's files gone for good
            self._later(self._clear_everywhere(rid, msg, dropped, cleared, cluster))
            return None
        return p.Ok(req=msg.req, value=dropped)

    def _events(self, rid: bytes, msg: p.CacheEvents) -> p.Ok:
        check_batch(msg.namespace, [])
        return p.Ok(req=msg.req, value=self.store.events.read(msg.namespace, msg.epoch, msg.since))

    def _stats(self, rid: bytes, msg: p.CacheStats) -> p.Ok:
        stats = self.store.stats(msg.namespace)
        if msg.namespace is None:
            stats["expired_writes"] = self.ledger.expired_pages
            if self.peers is not None:  # the exchanges with other homes
                stats["cluster"] = dict(self.peers.counts)
            if self.media is not None:
                stats["media"] = self.media()
        elif self.disk is not None:
            stats["disk"] = self.disk.namespace_stats(msg.namespace)
        return p.Ok(req=msg.req, value=stats)

    def _get(self, rid: bytes, msg: p.CacheGet) -> p.CacheSlots:
        token, found = self.store.lease(msg.namespace, msg.keys, msg.sizes)
        for i, page in enumerate(found):  # a page held at another size: the caller's out is wrong, not a miss
            if page is None and (held := self.store.held_size(msg.namespace, msg.keys[i])) not in (None, msg.sizes[i]):
                self.store.release(token)
                raise BadRequest(f"cache_get: page {msg.keys[i]!r} of namespace {msg.namespace!r} holds {held} bytes, "
                                 f"and the out given for it has {msg.sizes[i]}: give an out of the page's size")
        if any(page is not None for page in found):
            self.ledger.handle(ev.PagesPinned(rid, token))
        return p.CacheSlots(req=msg.req, token=token,
                            slots=[None if page is None else self._segments(page) for page in found])

    # --- pages homed on other nodes ---------------------------------------------------------------------

    @staticmethod
    def _remote(peers: TierPeers, namespace: str, keys: list[str], indices: Iterable[int]) -> dict[str, list[int]]:
        """Of these indices of keys, those whose home is another node, by home."""
        indices = list(indices)
        by_home = peers.remote(namespace, [keys[i] for i in indices])
        return {home: [indices[j] for j in idx] for home, idx in by_home.items()}

    @staticmethod
    def _homes_of(peers: TierPeers, pages: list[Page]) -> dict[str, list[Page]]:
        if not pages:
            return {}
        namespace = pages[0].namespace  # (one batch, one namespace)
        return {home: [pages[i] for i in idx]
                for home, idx in peers.remote(namespace, [page.key for page in pages]).items()}

    async def _commit_at_homes(self, peers: TierPeers, rid: bytes, req: int, published: list[bool],
                               by_home: dict[str, list[Page]]) -> None:
        """The pages stay here too (a near copy): a home that missed them costs other nodes a miss."""
        try:
            await asyncio.gather(*(peers.store_at(home, pages[0].namespace, pages)
                                   for home, pages in by_home.items()))
        except Exception:  # (never: store_at says misses, not errors; the client is answered anyway)
            log.exception("tier: storing pages at their homes failed")
        self._answer_late(rid, p.Ok(req=req, value=published))

    async def close(self) -> None:
        """Shutting down: questions to other homes still in flight are called off (before the pool
        they would write into goes; their clients are going too)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _later(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro, name="cache-at-home")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _answer_late(self, rid: bytes, msg: p.Message) -> bool:
        """Answer a client from a task; False if it has gone."""
        # (the daemon always gives `reply`; a request that would answer later without it is
        # answered at once instead, see `_late`, save a clear of a disk, which needs it too)
        assert self.reply is not None, "a cache request answered later needs the daemon's reply"
        return self.reply(rid, msg)

    async def _clear_everywhere(self, rid: bytes, msg: p.CacheClear, dropped: int,
                                disk: asyncio.Task[None] | None = None, cluster: bool = True) -> None:
        """cache_clear means the cluster: every node of the tier drops the namespace (near copies
        and the pages it is home to) before the client hears that it is done. A node that does not
        confirm within the tier's deadline may still serve old pages: the client gets an error
        naming it, and a retry clears whatever is left. The disk level's files of the namespace are
        gone for good (a restart does not bring them back) before the answer, too."""
        try:
            if disk is not None:
                await asyncio.shield(disk)
            elsewhere, missing = await self.peers.clear(msg.namespace) if cluster and self.peers else (0, [])
        except Exception as exc:  # (never from peers.clear: it says who did not answer; the disk may fail)
            elsewhere, missing = 0, [f"{'the disk level' if disk is not None else 'the other nodes'} ({exc})"]
        if missing:
            reply: p.Message = p.error_reply(msg.req, PeerUnavailable(
                f"cache_clear({msg.namespace!r}): cleared here and on the nodes that answered, but "
                f"{', '.join(sorted(missing))} did not confirm within {TIER_TIMEOUT:g} s and may still serve the "
                "namespace's old pages: call cache_clear again"), None)
        else:
            reply = p.Ok(req=msg.req, value=dropped + elsewhere)
        self._answer_late(rid, reply)

    async def _get_from_homes(self, rid: bytes, msg: p.CacheGet, by_home: dict[str, list[int]],
                              on_disk: list[int] | None = None, pinned: int | None = None) -> None:
        read_back: list[Loaded] = []
        reply: p.Message
        try:
            # (on_disk names pages only with a disk, by_home only with peers)
            read_back = (await self.disk.load(msg.namespace, msg.keys, msg.sizes, on_disk)
                         if on_disk and self.disk else [])
            transit = (set(await self.peers.fetch(msg.namespace, msg.keys, msg.sizes, by_home))
                       if by_home and self.peers else set())
            slots = reply = self._get(rid, msg)
            if transit:  # read once: they go as soon as this reader lets go of them
                for page in [page for page in self.store.leased(slots.token) if page.key in transit]:
                    self.store.drop(page)
        except Exception as exc:
            reply = p.error_reply(msg.req, exc, None)
        finally:  # (the reader's lease holds what it found now)
            if read_back and self.disk:
                self.disk.release(read_back)
            if pinned is not None:
                self.store.release(pinned)
        if not self._answer_late(rid, reply) and isinstance(reply, p.CacheSlots):
            self.ledger.handle(ev.PagesRelease(rid, reply.token))  # its reader left meanwhile

    async def _exists_at_homes(self, peers: TierPeers, rid: bytes, msg: p.CacheExists, local: int,
                               by_home: dict[str, list[int]]) -> None:
        try:
            held = await peers.held(msg.namespace, msg.keys, by_home)
        except Exception:  # (as above: the client gets the local count)
            log.exception("tier: asking the homes failed")
            held = set()
        count = local
        while count < len(msg.keys) and (count in held or self._exists_here(msg.namespace, [msg.keys[count]])):
            count += 1
        self._answer_late(rid, p.Ok(req=msg.req, value=count))

    async def _exists_probed(self, disk: DiskTier, rid: bytes, msg: p.CacheExists, local: int) -> None:
        """exists while the disk's start-up scan runs: the files it has not listed yet are asked by name."""
        try:
            count = local + await disk.probe(msg.namespace, msg.keys[local:],
                                                  lambda key: self.store.exists(msg.namespace, [key]) == 1)
        except Exception:  # (a disk that fails: what is known)
            log.exception("tier: probing the disk failed")
            count = local
        peers = self.peers
        by_home = self._remote(peers, msg.namespace, msg.keys, range(count, len(msg.keys))) if peers else {}
        if peers and count < len(msg.keys) and any(count in idx for idx in by_home.values()):
            await self._exists_at_homes(peers, rid, msg, count, by_home)
        else:
            self._answer_late(rid, p.Ok(req=msg.req, value=count))

    def _exists_here(self, namespace: str, keys: list[str]) -> int:
        """How many keys, from the first, this node holds: in RAM or on its disk."""
        count = self.store.exists(namespace, keys)
        while self.disk is not None and count < len(keys) and (
                self.disk.held(namespace, keys[count]) or self.store.exists(namespace, [keys[count]])):
            count += 1
        return count

    def _slot(self, result: Page | bool) -> list[list[int]] | bool | None:
        if result is True:
            return True
        return None if result is False else self._segments(result)

    def _segments(self, page: Page) -> list[list[int]]:
        extents = page.extents
        assert extents is not None  # (a page just reserved or pinned is not freed)
        if len(extents) == 1:  # (the common case: one run of blocks)
            return [[extents[0][0] * self.block_size, page.nbytes]] if page.nbytes else []
        return [list(s) for s in physical_segments(extents, self.block_size, 0, page.nbytes)]

    def in_use(self, rid: bytes) -> bool:
        return self.ledger.in_use(rid)

    def sweep(self, now: float) -> None:
        """End the reservations whose writer did not commit in time: their pages are unlisted at
        once, their blocks parked until the writer lets go (its commit answers None)."""
        for action in self.ledger.handle(ev.LeaseTick(now)):
            assert isinstance(action, ev.PagesExpired)
            if self._throttle.allow("expired"):  # (a client that never commits could fill the log)
                log.warning("a cache put was not committed within %gs (--lease-timeout): its pages are dropped, "
                            "their blocks kept until its writer commits or disconnects (%d so far)",
                            self.lease_timeout, action.total)

    def validate(self) -> None:
        """For tests: the ledger's invariants (every open token is one connection's, a reservation's
        pages stay reserved while its writer may still write)."""
        self.ledger.validate()


def label(namespace: str) -> str:
    return namespace if len(namespace) <= MAX_LABEL else namespace[:MAX_LABEL - 3] + "..."


class CacheCollector(Collector):
    """The tier's gauges and counters, read at scrape time; per namespace only the TOP_NAMESPACES
    biggest (so the page stays bounded however many namespaces clients name)."""

    def __init__(self, store: CacheStore) -> None:
        self.store = store

    def collect(self) -> Iterator:
        store = self.store
        stats = store.stats()
        yield GaugeMetricFamily("kvd_cache_budget_bytes", "KV tier budget (--cache-size)", value=stats["budget"])
        yield GaugeMetricFamily("kvd_cache_used_bytes", "Pool bytes held by KV tier pages (whole blocks, parked "
                                "ones included)", value=stats["used_bytes"])
        yield GaugeMetricFamily("kvd_cache_parked_bytes", "Pool bytes of removed KV tier pages a reader still "
                                "copies from, or a writer whose lease ran out still holds", value=stats["parked_bytes"])
        top = sorted(store.namespaces(), key=lambda item: (-item[1].bytes, item[0]))[:TOP_NAMESPACES]
        for name, help_text, kind in (
                ("entries", "KV tier pages held", GaugeMetricFamily),
                ("bytes", "KV tier page bytes held", GaugeMetricFamily),
                ("hits", "KV tier keys found by cache_get", CounterMetricFamily),
                ("misses", "KV tier keys not found by cache_get", CounterMetricFamily),
                ("evictions", "KV tier pages evicted (budget full, or a handoff needed the room)", CounterMetricFamily),
                ("stored", "KV tier pages stored", CounterMetricFamily),
                ("refused", "KV tier pages refused (over the budget, or the pool full of handoffs)",
                 CounterMetricFamily)):
            yield kind(f"kvd_cache_{name}", help_text, value=stats[name])
            if top:  # (separate families: a namespace may be called anything, "" and "*" included)
                family = kind(f"kvd_cache_namespace_{name}", f"{help_text}, for the {TOP_NAMESPACES} namespaces "
                              "holding the most bytes", labels=["namespace"])
                for namespace, counts in top:
                    family.add_metric([label(namespace)], getattr(counts, name))
                yield family
