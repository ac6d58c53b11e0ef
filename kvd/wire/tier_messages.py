"""The KV tier's messages (both processes): client <-> local daemon requests for evictable pages
by (namespace, key), batched, one reply each. Plain data like `messages.py`; `protocol.py`
adds them to its table of types and re-exports them. The keys' and batches' bounds are the
daemon's (`kvd.daemon.store.page_store`), written in `proto/PROTOCOL.md`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from .messages import Chunk, Message


@dataclass(slots=True)
class CachePut(Message):
    """Client -> daemon: room for a batch of pages; answered by cache_slots."""

    TYPE: ClassVar[str] = "cache_put"
    req: int
    namespace: str
    keys: list[Any]  # [key, ...]
    pages: list[Any]  # per key: [dtype, shape]


@dataclass(slots=True)
class CacheSlots(Message):
    """Daemon -> client (cache_put, cache_get): per key null (refused / miss) or its pool
    segments [[offset, length], ...]; for a put, true: already held, nothing to write."""

    TYPE: ClassVar[str] = "cache_slots"
    req: int
    token: int  # the batch's reservation (put: cache_commit it) or read lease (get: cache_release it)
    slots: list[Any]


@dataclass(slots=True)
class CacheCommit(Message):
    """Client -> daemon: the put's pages are written (ok) or will not be; answered by ok."""

    TYPE: ClassVar[str] = "cache_commit"
    req: int
    token: int
    ok: bool = True


@dataclass(slots=True)
class CacheGet(Message):
    """Client -> daemon: lease a batch's hits for copying out; answered by cache_slots."""

    TYPE: ClassVar[str] = "cache_get"
    req: int
    namespace: str
    keys: list[Any]
    sizes: list[Any]  # per key: the bytes the caller expects (a page of another size is a miss)


@dataclass(slots=True)
class CacheRelease(Message):
    """Client -> daemon, fire and forget: the get's copies are over; unpin its pages."""

    TYPE: ClassVar[str] = "cache_release"
    req: int
    token: int


@dataclass(slots=True)
class CacheExists(Message):
    """Client -> daemon: how many keys, from the first, are held (ok with an int)."""

    TYPE: ClassVar[str] = "cache_exists"
    req: int
    namespace: str
    keys: list[Any]


@dataclass(slots=True)
class CacheClear(Message):
    """Client -> daemon: drop a namespace's pages (ok with how many went)."""

    TYPE: ClassVar[str] = "cache_clear"
    req: int
    namespace: str


@dataclass(slots=True)
class CacheStats(Message):
    """Client -> daemon: the tier's counters, of one namespace or of all (ok with a map)."""

    TYPE: ClassVar[str] = "cache_stats"
    req: int
    namespace: str | None = None


@dataclass(slots=True)
class CacheEvents(Message):
    """Client -> daemon: the namespace's pages stored and removed since `since` of log `epoch`
    (0, 0: start following); ok with {"epoch", "next", "events": [[kind, key], ...], "lost"}."""

    TYPE: ClassVar[str] = "cache_events"
    req: int
    namespace: str
    epoch: int = 0
    since: int = 0


CACHE_REQUESTS = (CachePut, CacheCommit, CacheGet, CacheRelease, CacheExists, CacheClear, CacheStats, CacheEvents)


# ---- daemon <-> daemon: a page's home in a cluster (kvd.cluster.rendezvous) ------------------
# Outside the transfer table: small request/reply exchanges, answered at once, on the same
# connections. The page messages extend chunk for its payload frames (lengths, digest): the
# codec checks their frames as a chunk's; xfer names the exchange, seq and offset are 0.


@dataclass(slots=True)
class TierStore(Chunk):
    """A page set on another node, for its home: keep these pages (answered by tier_held: kept or not)."""

    TYPE: ClassVar[str] = "tier_store"
    checksum: str = "xxh3_64"
    namespace: str = ""
    keys: list[Any] = field(default_factory=list)
    pages: list[Any] = field(default_factory=list)  # per key: [dtype, shape]; its bytes are payload frame i


@dataclass(slots=True)
class TierFetch(Message):
    """Ask a page's home for pages (answered by tier_pages; never consumes them)."""

    TYPE: ClassVar[str] = "tier_fetch"
    xfer: int
    namespace: str
    keys: list[Any]
    sizes: list[Any]


@dataclass(slots=True)
class TierPages(Chunk):
    """The home's answer to tier_fetch: payload frame i is the page of keys[found[i]]."""

    TYPE: ClassVar[str] = "tier_pages"
    checksum: str = "xxh3_64"
    found: list[Any] = field(default_factory=list)
    pages: list[Any] = field(default_factory=list)  # per found page: [dtype, shape]


@dataclass(slots=True)
class TierAsk(Message):
    """Ask a page's home which keys it holds (answered by tier_held)."""

    TYPE: ClassVar[str] = "tier_ask"
    xfer: int
    namespace: str
    keys: list[Any]


@dataclass(slots=True)
class TierHeld(Message):
    TYPE: ClassVar[str] = "tier_held"
    xfer: int
    held: list[Any]  # per key: bool


@dataclass(slots=True)
class TierClear(Message):
    """cache_clear on another node: drop this namespace's pages here too (answered by tier_cleared;
    sent only to a peer whose hello lists the `tier_clear` feature)."""

    TYPE: ClassVar[str] = "tier_clear"
    xfer: int
    namespace: str


@dataclass(slots=True)
class TierCleared(Message):
    TYPE: ClassVar[str] = "tier_cleared"
    xfer: int
    dropped: int  # visible pages that went here


TIER_PEER = (TierStore, TierFetch, TierPages, TierAsk, TierHeld, TierClear, TierCleared)
TIER_MESSAGES: dict[str, type[Message]] = {cls.TYPE: cls for cls in (*CACHE_REQUESTS, CacheSlots, *TIER_PEER)}

__all__ = [
    'CACHE_REQUESTS',
    'TIER_MESSAGES',
    'TIER_PEER',
    'CacheClear',
    'CacheCommit',
    'CacheEvents',
    'CacheExists',
    'CacheGet',
    'CachePut',
    'CacheRelease',
    'CacheSlots',
    'CacheStats',
    'TierAsk',
    'TierClear',
    'TierCleared',
    'TierFetch',
    'TierHeld',
    'TierPages',
    'TierStore',
]
