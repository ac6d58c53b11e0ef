"""The KV tier across a cluster (daemon process): pages whose rendezvous home is another node are
sent there on set, and asked of it on get and exists, over the peer connections.

With a registry, a page's home is `kvd.cluster.rendezvous.home` over the nodes whose (verified)
record advertises a tier budget. A set is kept where it was written (a near copy) and sent to its
home (`tier_store`, no reply); a get that misses here asks the home (`tier_fetch`), keeps what
comes back here, and serves it from here; exists asks `tier_ask`. Every question has a deadline
(`TIMEOUT`): a home that is down or slow costs a miss, never a hang. Answers are checked (a digest
over the page bytes, sizes against the question) before a byte lands in the pool. Host pools only.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvd.cluster.rendezvous import homes
from kvd.errors import KvdError, ProtocolError
from kvd.wire import protocol as p
from kvd.wire.checksum import digest
from kvd.wire.layout import Segment, physical_segments

from ..store.page_names import check_batch, page_size
from ..store.page_store import CacheStore, Page

if TYPE_CHECKING:
    from kvd.daemon.peer.links import PeerLink

    from .disk.level import DiskTier
    from .disk.readback import Loaded

log = logging.getLogger(__name__)

TIMEOUT = 1.0  # seconds a home has to answer before its pages count as misses
PER_MESSAGE = p.MAX_PAYLOAD_FRAMES  # pages per tier message (one payload frame each)


class TierPeers:
    def __init__(self, node_id: str, cache: CacheStore, pool: memoryview, block_size: int,
                 link_for: Callable[[str], PeerLink], nodes: Callable[[], list[str]], checksum: str,
                 disk: DiskTier | None = None) -> None:
        self.node_id = node_id
        self.cache = cache
        self.pool = pool
        self.block_size = block_size
        self._link_for = link_for  # node id -> PeerLink (resolved through the verified registry view)
        self.nodes = nodes  # the tier's nodes now (this one included once registered)
        self.checksum = checksum
        self._xfers = itertools.count(random.getrandbits(48) << 8)
        # xfer -> (home asked, answer type, its answer)
        self._waiting: dict[int, tuple[str, type[p.Message], asyncio.Future[p.Message]]] = {}
        self.counts = {"stored_sent": 0, "fetched": 0, "asked": 0, "timeouts": 0, "bad": 0}
        self.disk = disk  # with --cache-dir: a home answers from its disk too
        self._routes = self.routes()

    # --- where pages live -----------------------------------------------------------------------------

    def others(self) -> list[str]:
        """The tier's other nodes now."""
        return [node for node in self.nodes() if node != self.node_id]

    def is_home(self, namespace: str, key: str) -> bool:
        """Is this node the page's home (the disk level writes only the pages it is home to)?"""
        return not self.remote(namespace, [key])

    def remote(self, namespace: str, keys: list[str]) -> dict[str, list[int]]:
        """Indices of keys by their home, for the homes that are not this node."""
        nodes = self.nodes()
        by_home: dict[str, list[int]] = {}
        if not nodes or nodes == [self.node_id]:
            return by_home
        for i, node in enumerate(homes(namespace, keys, nodes)):
            if node is not None and node != self.node_id:
                by_home.setdefault(node, []).append(i)
        return by_home

    # --- bytes in and out of the pool -----------------------------------------------------------------------

    def _segments(self, page: Page) -> list[Segment]:
        if page.extents is None:  # (a page read or written is pinned or reserved: never freed meanwhile)
            raise RuntimeError(f"tier page {page.key!r} used after it was freed")
        return physical_segments(page.extents, self.block_size, 0, page.nbytes)

    def read(self, page: Page) -> bytes:
        return b"".join(self.pool[off:off + n] for off, n in self._segments(page))

    def _write(self, page: Page, data) -> None:
        data, pos = memoryview(data), 0
        for off, n in self._segments(page):
            self.pool[off:off + n] = data[pos:pos + n]
            pos += n

    def keep(self, namespace: str, keys: list[str], pages: list, payload: list, over_budget: bool = False) -> list[int]:
        """Store pages that came from a peer (checked by the caller); returns the indices refused
        (no room within the budget). over_budget: pages in transit to one reader, past the budget."""
        token, results = self.cache.reserve(namespace, keys, pages, over_budget=over_budget)
        written = [(r, data) for r, data in zip(results, payload, strict=True) if isinstance(r, Page)]
        try:
            for page, data in written:
                self._write(page, data)
        except BaseException:
            self.cache.commit(token, ok=False)
            raise
        if written:
            self.cache.commit(token)
        return [i for i, r in enumerate(results) if r is False]

    # --- what peers send ---------------------------------------------------------------------------------

    def wrap(self, inner: Callable) -> Callable:
        """A peer-message callback that takes the tier's messages and passes the rest to inner."""
        def on_message(source, msg: p.Message) -> None:
            if type(msg) in self._routes:
                channel = getattr(source, "channel", source)  # (a link, or a ROUTER channel)
                try:
                    self.on_peer(channel, msg)
                except Exception as exc:  # one bad message never hurts the others
                    self.counts["bad"] += 1
                    log.warning("tier message %s from %s refused: %s", msg.TYPE, channel.peer_name, exc)
                return
            inner(source, msg)
        return on_message

    def _checked(self, msg: p.TierStore | p.TierPages, count: int) -> None:
        if len(msg.pages) != count or len(msg.payload) != count:
            raise ProtocolError(f"{msg.TYPE}: {count} pages named, {len(msg.payload)} sent")
        if digest(msg.checksum, msg.payload) != msg.digest:
            raise ProtocolError(f"{msg.TYPE}: the page bytes fail their {msg.checksum} digest")
        for (dtype, shape), data in zip(msg.pages, msg.payload, strict=True):
            if page_size(dtype, shape) != len(data):
                raise ProtocolError(f"{msg.TYPE}: a page of {dtype} {shape} arrived as {len(data)} bytes")

    def routes(self) -> dict[type[p.Message], Callable[[Any, Any], None]]:
        """Each tier peer message's handler, by type: `on_peer` dispatches through this table, and a
        test checks that it names every type of `p.TIER_PEER`."""
        return {p.TierStore: self._on_store, p.TierFetch: self._on_fetch, p.TierAsk: self._on_ask,
                p.TierClear: self._on_clear,
                p.TierPages: self._on_answer, p.TierHeld: self._on_answer, p.TierCleared: self._on_answer}

    def on_peer(self, channel, msg: p.Message) -> None:
        handler = self._routes.get(type(msg))
        if handler is None:
            raise ProtocolError(f"{msg.TYPE} is not a tier message")
        handler(channel, msg)

    def _on_store(self, channel, msg: p.TierStore) -> None:
        self._checked(msg, len(msg.keys))
        refused = set(self.keep(msg.namespace, msg.keys, msg.pages, msg.payload))
        channel.send(p.TierHeld(xfer=msg.xfer, held=[i not in refused for i in range(len(msg.keys))]))

    def _on_fetch(self, channel, msg: p.TierFetch) -> None:
        pinned, on_disk = self._on_disk(msg)
        if on_disk and self.disk is not None:  # (on_disk is empty without a disk)
            self.disk.spawn(self._pages_from_disk(self.disk, channel, msg, on_disk, pinned))
        else:
            self.cache.release(pinned)
            self._send_pages(channel, msg)

    def _on_ask(self, channel, msg: p.TierAsk) -> None:
        held = [self.cache.exists(msg.namespace, [key]) == 1
                or (self.disk is not None and self.disk.held(msg.namespace, key)) for key in msg.keys]
        channel.send(p.TierHeld(xfer=msg.xfer, held=held))

    def _on_clear(self, channel, msg: p.TierClear) -> None:
        if self.disk is None:
            channel.send(p.TierCleared(xfer=msg.xfer, dropped=self.cache.clear(msg.namespace)))
            return
        check_batch(msg.namespace, [])
        on_disk, cleared = self.disk.clear(msg.namespace,
                                           lambda key: self.cache.held_size(msg.namespace, key) is not None)
        dropped = self.cache.clear(msg.namespace) + on_disk
        self.disk.spawn(self._cleared(channel, msg.xfer, dropped, cleared))

    def _on_answer(self, channel, msg: p.TierPages | p.TierHeld | p.TierCleared) -> None:
        """An answer to one of our questions: taken from the home asked, in the kind asked, once."""
        asked = self._waiting.get(msg.xfer)
        if asked is None:
            return  # (a question that timed out, or none of ours)
        home, answer, waiter = asked
        if channel.peer_name != home or not isinstance(msg, answer):
            raise ProtocolError(f"{msg.TYPE} for exchange {msg.xfer:x}, asked of {home} for a {answer.TYPE}")
        del self._waiting[msg.xfer]
        if not waiter.done():
            waiter.set_result(msg)

    def _send_pages(self, channel, msg: p.TierFetch) -> None:
        token, found = self.cache.lease(msg.namespace, msg.keys, msg.sizes)
        try:
            hits = [(i, page) for i, page in enumerate(found) if page is not None]
            payload = [self.read(page) for _, page in hits]  # (copied out: the pin can end now)
        finally:
            self.cache.release(token)
        channel.send(p.TierPages(
            xfer=msg.xfer, seq=0, offset=0, lengths=[len(d) for d in payload],
            digest=digest(self.checksum, payload), payload=payload, checksum=self.checksum,
            found=[i for i, _ in hits], pages=[[page.dtype, list(page.shape)] for _, page in hits]))

    # --- a home's disk (with --cache-dir) -------------------------------------------------------------

    def _on_disk(self, msg: p.TierFetch) -> tuple[int, list[int]]:
        """The keys asked that this home's RAM misses and its disk holds (at the size asked), and a
        lease pinning RAM's hits meanwhile (what is read back must not evict them)."""
        token, found = self.cache.lease(msg.namespace, msg.keys, msg.sizes, count=False)  # (checks the batch)
        if self.disk is None:
            return token, []
        return token, self.disk.wanted(msg.namespace, msg.keys, msg.sizes,
                                       [i for i, page in enumerate(found) if page is None], strict=False)

    async def _pages_from_disk(self, disk: DiskTier, channel, msg: p.TierFetch, on_disk: list[int],
                               pinned: int) -> None:
        read_back: list[Loaded] = []
        try:
            read_back = await disk.load(msg.namespace, msg.keys, msg.sizes, on_disk)
            self._send_pages(channel, msg)
        except Exception as exc:  # (the asker may be gone by now: it counts a miss)
            log.debug("tier: answering %s from disk failed: %s", channel.peer_name, exc)
        finally:
            disk.release(read_back)
            self.cache.release(pinned)

    async def _cleared(self, channel, xfer: int, dropped: int, cleared: asyncio.Task) -> None:
        """A clear is confirmed once the disk's files are gone for good (else never: the asker names us)."""
        try:
            await asyncio.shield(cleared)
            channel.send(p.TierCleared(xfer=xfer, dropped=dropped))
        except Exception as exc:
            log.warning("tier: clearing a namespace for %s failed on disk: %s", channel.peer_name, exc)

    # --- what we ask -------------------------------------------------------------------------------------

    async def store_at(self, home: str, namespace: str, pages: list[Page]) -> int:
        """Send pages set here to their home; returns how many it kept (within TIMEOUT: a home
        that does not answer costs misses later, never an error now)."""
        kept = 0
        for start in range(0, len(pages), PER_MESSAGE):
            batch = pages[start:start + PER_MESSAGE]
            payload = [self.read(page) for page in batch]
            msg = p.TierStore(xfer=next(self._xfers), seq=0, offset=0, lengths=[len(d) for d in payload],
                              digest=digest(self.checksum, payload), payload=payload, checksum=self.checksum,
                              namespace=namespace, keys=[page.key for page in batch],
                              pages=[[page.dtype, list(page.shape)] for page in batch])
            reply = await self._ask(home, msg, p.TierHeld)
            if reply is None:
                return kept
            kept += sum(1 for h in reply.held if h is True)
        self.counts["stored_sent"] += kept
        return kept

    async def _send(self, home: str, msg: p.Message, feature: str | None = None) -> None:
        link = self._link_for(home)
        if not link.connected:  # (a link sends nothing before its handshake)
            await link.ensure_ready(TIMEOUT)
        if feature is not None and feature not in link.channel.features:
            raise KvdError(f"{home} does not speak {feature} (an older kvd)")
        link.channel.send(msg)

    async def _ask(self, home: str, msg, answer: type[p.Message], feature: str | None = None) -> Any:
        """One question to a home, answered by it with an `answer` within TIMEOUT, or None."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiting[msg.xfer] = (home, answer, waiter)
        async def ask() -> p.Message:
            await self._send(home, msg, feature)
            return await waiter

        try:
            return await asyncio.wait_for(ask(), TIMEOUT)
        except (TimeoutError, KvdError) as exc:
            self.counts["timeouts"] += 1
            log.debug("tier: %s to %s unanswered: %s", msg.TYPE, home, exc)
            return None
        finally:
            self._waiting.pop(msg.xfer, None)

    async def clear(self, namespace: str) -> tuple[int, list[str]]:
        """Clear a namespace on every other node of the tier (their near copies and the pages they
        are home to): returns the visible pages they dropped, and the nodes that did not confirm."""
        others = self.others()

        async def one(node: str) -> p.TierCleared | None:
            return await self._ask(node, p.TierClear(xfer=next(self._xfers), namespace=namespace), p.TierCleared,
                                   feature=p.TIER_CLEAR)

        answers = await asyncio.gather(*(one(node) for node in others))
        dropped = sum(a.dropped for a in answers if a is not None and type(a.dropped) is int and a.dropped >= 0)
        return dropped, [node for node, a in zip(others, answers, strict=True) if a is None]

    async def fetch(self, namespace: str, keys: list[str], sizes: list[int],
                    by_home: dict[str, list[int]]) -> list[str]:
        """Fetch the keys (indices by home) from their homes and keep them here (a near copy within
        the budget, else in transit past it); returns the keys kept in transit, for the caller to
        drop once its reader has them pinned."""
        transit: list[str] = []
        clears = self.cache.clears  # a clear while we wait: what comes back is served once, never kept

        async def one(home: str, idx: list[int]) -> int:
            got = 0
            for start in range(0, len(idx), PER_MESSAGE):
                part = idx[start:start + PER_MESSAGE]
                reply = await self._ask(home, p.TierFetch(xfer=next(self._xfers), namespace=namespace,
                                                          keys=[keys[i] for i in part], sizes=[sizes[i] for i in part]),
                                        p.TierPages)
                if reply is None:
                    return got
                try:
                    self._checked(reply, len(reply.found))
                    if not all(type(j) is int and 0 <= j < len(part) for j in reply.found):
                        raise ProtocolError("tier_pages names a key it was not asked for")
                    if any(len(d) != sizes[part[j]] for j, d in zip(reply.found, reply.payload, strict=True)):
                        raise ProtocolError("tier_pages sent a page of another size")
                except KvdError as exc:  # (a ProtocolError, or a checksum we do not know)
                    self.counts["bad"] += 1
                    log.warning("tier: the answer of %s refused: %s", home, exc)
                    return got
                came = [keys[part[j]] for j in reply.found]
                refused = (list(range(len(came))) if self.cache.clears != clears
                           else self.keep(namespace, came, reply.pages, reply.payload))
                if refused:  # no room in our budget (or none at all): in transit, for this reader only
                    again = self.keep(namespace, [came[i] for i in refused], [reply.pages[i] for i in refused],
                                      [reply.payload[i] for i in refused], over_budget=True)
                    transit.extend(came[i] for n, i in enumerate(refused) if n not in again)
                got += len(reply.found)
            return got

        got = await asyncio.gather(*(one(home, idx) for home, idx in by_home.items()))
        self.counts["fetched"] += sum(got)
        return transit

    async def held(self, namespace: str, keys: list[str], by_home: dict[str, list[int]]) -> set[int]:
        """Which of the keys (indices by home) their homes hold."""
        async def one(home: str, idx: list[int]) -> set[int]:
            found: set[int] = set()
            for start in range(0, len(idx), 4096):
                part = idx[start:start + 4096]
                reply = await self._ask(home, p.TierAsk(xfer=next(self._xfers), namespace=namespace,
                                                        keys=[keys[i] for i in part]), p.TierHeld)
                if reply is None or len(reply.held) != len(part):
                    return found
                found |= {i for i, h in zip(part, reply.held, strict=True) if h is True}
            return found

        self.counts["asked"] += len(keys)
        results = await asyncio.gather(*(one(home, idx) for home, idx in by_home.items()))
        return set().union(*results) if results else set()


def tier_peers_for(config, cache: CacheStore, memory, peers, directory, disk: DiskTier | None) -> TierPeers | None:
    """The cluster side of the tier, when there is a cluster (a registry) and a host pool; disk: the
    disk level under this node's RAM (with --cache-dir), which its pages' homes answer from too."""
    if directory is None or config.device != "cpu":
        return None
    from kvd.cluster.rendezvous import cache_nodes

    return TierPeers(config.node_id, cache, memory.host_view(), config.block_size, peers.link_for,
                     lambda: cache_nodes(directory.member.nodes()), config.checksum, disk)
