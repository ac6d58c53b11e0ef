"""The one small interface every registry backend (memory, etcd, redis) implements, and its types.

Runs in the daemon and in routers. Owns no state: backends hold the connection, callers (member.py,
registry.py) hold the policy. The contract, tested against every backend in tests/cluster:

- Every call is bounded by a deadline (the backend's `op_timeout`, 1 s by default; `wait_holders`
  takes its own), so a SIGSTOPped or partitioned server fails the call with `RegistryUnavailable`
  instead of hanging it.
- A session is a lease (etcd) or a TTL that this process refreshes (Redis). `keepalive()` raises
  `SessionLost` once the server no longer knows it (expired, revoked, or the server was wiped);
  everything registered or published under it is then gone or about to be, and the owner must open a
  new session, re-register with the same incarnation and re-publish.
- Registration is a compare-and-swap: a live record of the same node id with another incarnation is
  never replaced, the caller gets `Conflict` with that record.
- Each key has one writer, the node it names, so puts need no conditions; deletes do (`Unpublish`
  removes only the record it names, so a late unpublish never removes a newer record).
- Nothing read is trusted because it was written: a record whose key does not name its node id, one
  over MAX_RECORD_BYTES, or one not bound to a lease/TTL (kvd never writes such a node record, so it
  is never a conflict) is skipped; every read is bounded (pages, MAX_LISTING_BYTES, MAX_HOLDERS).
  Signatures are checked above the backends (member.py, registry.py), which see whole records.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, runtime_checkable

from ...errors import PeerUnavailable
from ..records import HolderRecord, NodeRecord

DEFAULT_OP_TIMEOUT = 1.0  # design R8: no registry call may take longer than this by default
MAX_RECORD_BYTES = 16 << 10  # a node or holder value over this is skipped (a signed node record is ~1 KiB)
MAX_LISTING_BYTES = 128 << 20  # a node listing stops here (logged): 100k signed records are ~70 MB
LIST_PAGE = 1000  # node keys read per registry call while listing
MAX_HOLDERS = 256  # holder records read per request id; past it a flood costs misses, not memory


class RegistryUnavailable(PeerUnavailable):
    """The registry did not answer within the deadline, refused the connection, or the breaker is
    open. A PeerUnavailable, so it crosses the wire as one."""


class SessionLost(RegistryUnavailable):
    """The session's lease or TTL is gone: re-open, re-register (same incarnation), re-publish."""


class RegistryRefused(RegistryUnavailable):
    """The registry answered and refused us: wrong or missing credentials, a user without the
    permission, a TLS certificate it does not accept. Retrying does not help until the operator
    fixes the configuration; the message says which (and never holds a password)."""


@dataclass(frozen=True)
class Registered:
    revision: int  # store revision of the write (0 where the backend has none, Redis)


@dataclass(frozen=True)
class Conflict:
    existing: NodeRecord  # the live record that holds the name: another process's
    # the backend's token for that exact stored value (etcd: its mod_revision; Redis: the raw value),
    # so that replace_node replaces only the record the caller judged, never a newer one
    version: object = field(default=None, compare=False)


@dataclass(frozen=True)
class Added:
    """A node appeared or its record changed (an upsert for the watcher's view)."""

    node: NodeRecord
    revision: int


@dataclass(frozen=True)
class Removed:
    node_id: str
    revision: int


@dataclass(frozen=True)
class Resync:
    """The watcher's view is replaced by this full listing (first event, and after any gap:
    reconnect, compaction, a wiped server)."""

    nodes: tuple[NodeRecord, ...]
    revision: int


NodeEvent = Added | Removed | Resync


@dataclass(frozen=True)
class Publish:
    record: HolderRecord


@dataclass(frozen=True)
class Unpublish:
    record: HolderRecord  # exactly the record that was written; a different one is left alone


PublishOp = Publish | Unpublish


@runtime_checkable
class Session(Protocol):
    ttl: float

    @property
    def token(self) -> str:
        """Opaque id of the session (the etcd lease id in hex), for logs and status."""
        ...

    async def keepalive(self) -> None:
        """Refresh the lease/TTL once; raises SessionLost or RegistryUnavailable."""
        ...

    async def close(self) -> None:
        """Revoke: everything bound to the session disappears now. Never raises."""
        ...


# the session type of one backend: its methods take only the sessions it opened itself
SessionT = TypeVar("SessionT", bound=Session)


@runtime_checkable
class Backend(Protocol[SessionT]):
    op_timeout: float
    # records the backend skipped as it read them, by (kind, reason): kind "node" | "holder",
    # reason "undecodable" | "too_large" | "key_mismatch" | "unleased" | "truncated"
    # (kvd_registry_records_dropped_total)
    dropped: Counter[tuple[str, str]]

    async def open_session(self, ttl: float) -> SessionT: ...

    async def register_node(self, session: SessionT, record: NodeRecord) -> Registered | Conflict:
        """Create the node key under the session unless a record with another incarnation lives
        there. A record with the same incarnation is ours (a previous session of this process) and is
        replaced."""
        ...

    async def update_node(self, session: SessionT, record: NodeRecord) -> None:
        """Rewrite our own registered record (same node id and incarnation); SessionLost if the key
        is gone or holds another incarnation."""
        ...

    async def replace_node(self, session: SessionT, record: NodeRecord, conflict: Conflict) -> Registered | Conflict:
        """Put our record in place of `conflict.existing`, exactly that stored version, under our
        session. The member calls it when the conflicting record is not to be believed (it does not
        verify against the cluster CA). A newer value meanwhile: Conflict with that one."""
        ...

    async def check_node(self, session: SessionT, record: NodeRecord) -> bool:
        """Does our node key hold exactly `record` (byte for byte), bound to this session? False
        when someone changed or deleted it: the member then writes it again."""
        ...

    async def get_node(self, node_id: str) -> NodeRecord | None:
        """One node's record (None when absent, undecodable, over the size cap, or stored under a
        key that is not its node id's): a single small read, for a holder whose node the watch
        has not shown yet."""
        ...

    async def list_nodes(self) -> tuple[int, list[NodeRecord]]: ...

    def watch_nodes(self) -> AsyncIterator[NodeEvent]:
        """Resync first, then Added/Removed; a new Resync after any gap. Runs until closed by the
        caller (aclose or cancel); reconnects by itself with backoff while the server is away."""
        ...

    async def holders(self, rid: str) -> tuple[int, list[HolderRecord]]:
        """Records whose value names `rid` (hash collisions filtered out), not expired; on Redis also
        only those whose node is registered with the record's incarnation."""
        ...

    async def wait_holders(self, rid: str, from_rev: int, timeout: float) -> tuple[int, list[HolderRecord]]:
        """Holders of `rid`, waiting up to `timeout` for the first one; nothing published after
        revision `from_rev` is missed. Returns an empty list at the deadline."""
        ...

    async def publish_batch(self, session: SessionT, ops: Sequence[PublishOp]) -> None:
        """Apply the ops (each op's key is distinct); idempotent, so a failed batch may be retried."""
        ...

    async def close(self) -> None: ...
