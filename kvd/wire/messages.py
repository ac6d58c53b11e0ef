"""The protocol's messages (both processes): one dataclass per message type, with the fields
`proto/PROTOCOL.md` gives it, and the table of types by wire name. Plain data; the codec is
`protocol.py`, which re-exports every name here."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

# a field added to a v1 message after v1 was fixed: sent only when it differs from its default,
# so v1 bytes stay as they were and a v1 peer (which ignores unknown keys) never sees it unset
EXTENSION = {"extension": True}
# optional parts of v1 a daemon says it speaks in peer_hello / peer_hello_ok (`features`); a peer
# that does not list one is never sent it
INLINE_OFFER = "inline_offer"  # an offer may carry its entry's only chunk (Offer.lengths/digest)
TIER_CLEAR = "tier_clear"  # the tier's namespaces are cleared cluster-wide (tier_clear / tier_cleared)
FEATURES = (INLINE_OFFER, TIER_CLEAR)


@dataclass(slots=True)
class Message:
    TYPE: ClassVar[str] = ""


# ---- client <-> local daemon -------------------------------------------------------------


@dataclass(slots=True)
class Hello(Message):
    """Client -> daemon, first message: who is calling."""

    TYPE: ClassVar[str] = "hello"
    req: int
    client: str = ""


@dataclass(slots=True)
class HelloOk(Message):
    """Daemon -> client: where the shared pool lives, so the client can map it."""

    TYPE: ClassVar[str] = "hello_ok"
    req: int
    node_id: str
    incarnation: int
    pool_path: str  # file the client opens and mmaps (a tmpfs file or /proc/PID/fd/N of a memfd)
    pool_size: int
    block_size: int
    device: str
    pool_handle: bytes | None = None  # CUDA IPC handle, when the pool is GPU memory


@dataclass(slots=True)
class PutAlloc(Message):
    """Client -> daemon: reserve pool space for a request's tensors."""

    TYPE: ClassVar[str] = "put_alloc"
    req: int
    request_id: str
    tensors: list[Any]  # [[name, dtype, shape], ...]
    ttl: float | None = None  # seconds; None = daemon default
    meta: dict[str, Any] | None = None  # opaque to the transport (KV layout lives here)
    stream: bool = False  # tensors will be announced with put_part as they are written
    dest: str | None = None  # streaming push: start sending to this peer right away
    give_back: int | None = field(default=None, metadata=EXTENSION)  # a scratch token returned unused


@dataclass(slots=True)
class PutSlots(Message):
    """Daemon -> client: where to write each tensor; token names this reservation."""

    TYPE: ClassVar[str] = "put_slots"
    req: int
    token: int
    segments: list[Any]  # per tensor: [[pool_offset, length], ...]


@dataclass(slots=True)
class PutCommit(Message):
    """Client -> daemon: the bytes are written; publish (or push to dest)."""

    TYPE: ClassVar[str] = "put_commit"
    req: int
    request_id: str
    token: int
    dest: str | None = None  # peer name or tcp:// endpoint
    lend: bool = field(default=False, metadata=EXTENSION)  # put_ok may lend blocks for the next put


@dataclass(slots=True)
class Put(Message):
    """Client -> daemon: the tensors are already written into the scratch blocks this
    connection was lent (`put_ok`); make them an entry and publish (or push to dest)."""

    TYPE: ClassVar[str] = "put"
    req: int
    request_id: str
    tensors: list[Any]
    scratch: int  # token of the lent blocks; used up by this request, whatever the outcome
    ttl: float | None = None
    meta: dict[str, Any] | None = None
    dest: str | None = None


@dataclass(slots=True)
class PutOk(Message):
    """Daemon -> client: the put is done; maybe new scratch blocks for the next one."""

    TYPE: ClassVar[str] = "put_ok"
    req: int
    scratch: int | None = None  # token of blocks lent to this connection, or none lent
    extents: list[Any] = field(default_factory=list)  # [[first_block, count], ...] in the order used


@dataclass(slots=True)
class PutPart(Message):
    """Client -> daemon, fire and forget: these tensors (indices) of a streamed put are written."""

    TYPE: ClassVar[str] = "put_part"
    req: int
    request_id: str
    token: int
    tensors: list[Any]  # indices into the put_alloc's tensor list


@dataclass(slots=True)
class GetStream(Message):
    """Client -> daemon: lease a cache while it is still arriving; tensors_ready follows as it fills."""

    TYPE: ClassVar[str] = "get_stream"
    req: int
    request_id: str
    timeout: float
    source: str | None = None  # pull from this peer, streaming chunks to the reader as they land
    keep: bool = False  # with source: the holder keeps its copy


@dataclass(slots=True)
class TensorsReady(Message):
    """Daemon -> client (after get_slots for a get_stream): these tensors are complete."""

    TYPE: ClassVar[str] = "tensors_ready"
    req: int
    tensors: list[Any]  # indices
    complete: bool = False  # every tensor is now complete; nothing more follows


@dataclass(slots=True)
class Get(Message):
    """Client -> daemon: find (or wait for, or pull) a request's cache."""

    TYPE: ClassVar[str] = "get"
    req: int
    request_id: str
    timeout: float
    source: str | None = None
    keep: bool = False


@dataclass(slots=True)
class GetSlots(Message):
    """Daemon -> client: where the cache's tensors are; the entry is leased to this reader."""

    TYPE: ClassVar[str] = "get_slots"
    req: int
    token: int
    tensors: list[Any]
    segments: list[Any]
    meta: dict[str, Any] | None = None


@dataclass(slots=True)
class GetDone(Message):
    """Client -> daemon: reading is over; consume the entry or give it back."""

    TYPE: ClassVar[str] = "get_done"
    req: int
    request_id: str
    token: int
    consume: bool = True
    reply: bool = False  # False: fire and forget


@dataclass(slots=True)
class Delete(Message):
    """Client -> daemon: drop a request's entry; with token, only the writer's own reservation."""

    TYPE: ClassVar[str] = "delete"
    req: int
    request_id: str
    # the put_slots token of a reservation this connection writes: it stops writing (aborts, or
    # acknowledges that the put ended without it); never touches another entry of that id
    token: int | None = field(default=None, metadata=EXTENSION)


@dataclass(slots=True)
class Stats(Message):
    TYPE: ClassVar[str] = "stats"
    req: int


@dataclass(slots=True)
class ListEntries(Message):
    """Client -> daemon: entries by request id, a page at a time (a v1 client gets the first page)."""

    TYPE: ClassVar[str] = "list"
    req: int
    after: str | None = field(default=None, metadata=EXTENSION)  # the last request id of the page before
    limit: int | None = field(default=None, metadata=EXTENSION)  # at most this many (and at most LIST_PAGE)


LIST_PAGE = 2000  # entries per list reply at most (~150 bytes each: far below a reply's 1 MiB header)


def next_page_after(page: list[dict[str, Any]], after: str | None) -> str | None:
    """Where the list after `page` starts, or None when `page` was the last: a short page is the
    last, and so is one that does not start after `after` (a daemon that knows no paging sends
    everything, every time)."""
    if len(page) < LIST_PAGE or (after is not None and page[0]["request_id"] <= after):
        return None
    last: str = page[-1]["request_id"]
    return last


@dataclass(slots=True)
class ClusterNodes(Message):
    """Client -> daemon: the cluster's nodes as this daemon's registry view has them."""

    TYPE: ClassVar[str] = "cluster_nodes"
    req: int


@dataclass(slots=True)
class ClusterLocate(Message):
    """Client -> daemon: which nodes the registry says hold request_id (a hint)."""

    TYPE: ClassVar[str] = "cluster_locate"
    req: int
    request_id: str


@dataclass(slots=True)
class Ok(Message):
    """Reply carrying a plain result (bool, map, list or nothing)."""

    TYPE: ClassVar[str] = "ok"
    req: int
    value: Any = None


@dataclass(slots=True)
class Error(Message):
    """Reply to a failed request; code is one of kvd.errors' codes."""

    TYPE: ClassVar[str] = "error"
    req: int
    code: int
    message: str
    origin: str | None = None  # node id of the daemon that detected the fault


# ---- daemon <-> daemon --------------------------------------------------------------------


@dataclass(slots=True)
class PeerHello(Message):
    """First message on a peer connection."""

    TYPE: ClassVar[str] = "peer_hello"
    node_id: str
    incarnation: int
    features: list[Any] = field(default_factory=list, metadata=EXTENSION)  # optional parts it speaks (FEATURES)
    # with a cluster CA: the sender's cert (kvd.trust), naming node_id and the CURVE key it connected with
    cert: bytes | None = field(default=None, metadata=EXTENSION)
    # a one-sided data plane the sender offers for this link (kvd.daemon.plane.base.PlaneInfo.to_wire)
    plane: dict[str, Any] | None = field(default=None, metadata=EXTENSION)


@dataclass(slots=True)
class PeerHelloOk(Message):
    TYPE: ClassVar[str] = "peer_hello_ok"
    node_id: str
    incarnation: int
    features: list[Any] = field(default_factory=list, metadata=EXTENSION)
    plane: dict[str, Any] | None = field(default=None, metadata=EXTENSION)  # the listener's, if both ends take one


@dataclass(slots=True)
class Offer(Message):
    """Sender -> receiver: a cache is coming; allocate room for it."""

    TYPE: ClassVar[str] = "offer"
    xfer: int
    request_id: str
    tensors: list[Any]
    total_bytes: int
    chunk_size: int
    checksum: str  # "xxh3_64" | "crc32" | "none"
    ttl: float | None = None
    meta: dict[str, Any] | None = None
    sealed: bool = True  # False: a stream; the receiver publishes only after a seal message
    # the whole entry inline, as chunk 0 (feature "inline_offer": a sealed entry of one chunk),
    # so that a small push is one message each way: lengths and digest as in a chunk
    lengths: list[Any] | None = field(default=None, metadata=EXTENSION)
    digest: int | None = field(default=None, metadata=EXTENSION)
    # on a link with a one-sided plane (PROTOCOL.md 2.2b): "nixl" when its bytes ride it; a served
    # pull's offer then names the holder's ranges and each slice [offset, length, digest] to read
    plane: str | None = field(default=None, metadata=EXTENSION)
    regions: list[Any] | None = field(default=None, metadata=EXTENSION)
    slices: list[Any] | None = field(default=None, metadata=EXTENSION)
    payload: list[Any] = field(default_factory=list)  # raw frames, not part of the header


@dataclass(slots=True)
class Seal(Message):
    """Sender -> receiver: the producer committed the stream; publish once every byte is in."""

    TYPE: ClassVar[str] = "seal"
    xfer: int


@dataclass(slots=True)
class Accept(Message):
    """Receiver -> sender: room reserved, start sending chunks."""

    TYPE: ClassVar[str] = "accept"
    xfer: int


@dataclass(slots=True)
class Chunk(Message):
    """Sender -> receiver: bytes [offset, offset + sum(lengths)) of the entry, in payload frames."""

    TYPE: ClassVar[str] = "chunk"
    xfer: int
    seq: int
    offset: int
    lengths: list[Any]
    digest: int  # checksum of the payload bytes in order; 0 when checksum is "none"
    payload: list[Any] = field(default_factory=list)  # raw frames, not part of the header


@dataclass(slots=True)
class ChunkAck(Message):
    """Receiver -> sender: chunk seq verified and stored; opens the window by one."""

    TYPE: ClassVar[str] = "chunk_ack"
    xfer: int
    seq: int


@dataclass(slots=True)
class Done(Message):
    """Receiver -> sender: every chunk verified; the entry is published on the receiver."""

    TYPE: ClassVar[str] = "done"
    xfer: int


@dataclass(slots=True)
class Abort(Message):
    """Either side: the transfer is over and failed; free what it holds."""

    TYPE: ClassVar[str] = "abort"
    xfer: int
    code: int
    message: str


@dataclass(slots=True)
class Pull(Message):
    """Puller -> holder: send me this request's cache (holder answers with Offer or Abort)."""

    TYPE: ClassVar[str] = "pull"
    xfer: int
    request_id: str
    timeout: float
    keep: bool = False
    # the entry's generation (the holder's reservation token) a registry record named: the holder
    # answers not_found when its entry of that id is another one (a stale hint never serves bytes)
    expect_gen: int | None = field(default=None, metadata=EXTENSION)
    plane: str | None = field(default=None, metadata=EXTENSION)  # the puller would read over this plane


@dataclass(slots=True)
class Ping(Message):
    TYPE: ClassVar[str] = "ping"
    nonce: int


@dataclass(slots=True)
class Pong(Message):
    TYPE: ClassVar[str] = "pong"
    nonce: int


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello, HelloOk, PutAlloc, PutSlots, Put, PutOk, PutPart, PutCommit, Get, GetStream, TensorsReady,
        GetSlots, GetDone, Delete, Stats, ListEntries, ClusterNodes, ClusterLocate, Ok, Error,
        PeerHello, PeerHelloOk, Offer, Seal, Accept, Chunk, ChunkAck, Done, Abort, Pull, Ping, Pong,
    )
}

__all__ = [
    'EXTENSION',
    'FEATURES',
    'INLINE_OFFER',
    'LIST_PAGE',
    'MESSAGE_TYPES',
    'TIER_CLEAR',
    'Abort',
    'Accept',
    'Chunk',
    'ChunkAck',
    'ClusterLocate',
    'ClusterNodes',
    'Delete',
    'Done',
    'Error',
    'Get',
    'GetDone',
    'GetSlots',
    'GetStream',
    'Hello',
    'HelloOk',
    'ListEntries',
    'Offer',
    'Ok',
    'PeerHello',
    'PeerHelloOk',
    'Ping',
    'Pong',
    'Pull',
    'Put',
    'PutAlloc',
    'PutCommit',
    'PutOk',
    'PutPart',
    'PutSlots',
    'Seal',
    'Stats',
    'TensorsReady',
    'next_page_after',
]
