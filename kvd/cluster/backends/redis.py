"""The Redis backend: the registry contract on Redis (or Valkey) with redis-py's asyncio client.

Runs in the daemon and in routers; imports redis-py only when constructed (`pip install redis`).
Key schema: records.RedisKeys. Redis has no leases, so the contract is emulated (design §3.1, the
Mooncake Redis coordinator pattern): the node key carries a PX TTL that this process refreshes with an
owner-checked Lua script; registration is a create-if-absent Lua script; holders live in one HASH per
request (field = node id) with the entry's TTL, and readers drop holders whose node key is missing or
carries another incarnation. There is no revision and no reliable event stream (keyspace notifications
are lossy), so watches and waits poll. A node watch polls only the listing's version (a counter every
change to the listing bumps, expiries included), and reads the listing when it moved: an idle cluster of
N daemons costs N tiny calls per poll period, not N listings of N records.

Credentials are an ACL user and password (or the default user's password); TLS (rediss://) uses the
client context url.py built, its CA alone. Whoever can write the registry may have planted anything, so
the scripts (redis_lua.py) bound every read server-side, and this module skips, and counts in
`dropped`, what they flag: records over MAX_RECORD_BYTES, undecodable ones, a node key or holder field
that does not name its value's node id, a node record without a TTL. Listings page (ZSCAN, LIST_PAGE
members a call) and stop at MAX_LISTING_BYTES; holder reads stop at MAX_HOLDERS.
"""
from __future__ import annotations

import asyncio
import logging
import re
import secrets
import ssl
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..records import (
    HolderRecord,
    NodeRecord,
    RecordError,
    RedisKeys,
    decode_node,
    encode_holder,
    encode_node,
    key_part,
    vet_holder,
    vet_node,
)
from ..skips import Skips
from . import redis_lua as lua
from .backend import (
    DEFAULT_OP_TIMEOUT,
    LIST_PAGE,
    MAX_HOLDERS,
    MAX_LISTING_BYTES,
    MAX_RECORD_BYTES,
    Added,
    Conflict,
    NodeEvent,
    Publish,
    PublishOp,
    Registered,
    RegistryRefused,
    RegistryUnavailable,
    Removed,
    Resync,
    SessionLost,
)

log = logging.getLogger(__name__)
NO_TTL_HOLDER_MS = 24 * 3600 * 1000  # a holder hash always expires; entries without a TTL get a day
RELIST_EVERY = 10.0  # seconds: a node watch reads the whole listing this often even if its version holds
_REASONS = {b"L": "too_large", b"N": "unleased", b"T": "undecodable", b"P": "key_mismatch"}


def _tls_connection(context: ssl.SSLContext) -> type:
    """A redis-py connection class that does TLS with our context (redis-py's own ssl_* options
    would add the system CAs to --registry-ca's)."""
    from redis.asyncio.connection import Connection

    class TLSConnection(Connection):
        def _connection_arguments(self) -> Any:
            return {**super()._connection_arguments(), "ssl": context}

    return TLSConnection


@dataclass
class RedisSession:
    backend: RedisBackend
    ttl: float
    token: str = field(default_factory=lambda: secrets.token_hex(8))
    nodes: dict[str, int] = field(default_factory=dict)  # node id -> incarnation registered under it

    async def keepalive(self) -> None:
        b = self.backend
        if not self.nodes:
            await b._run(b._r.ping)
        for node_id, inc in self.nodes.items():
            res = await b._run(b._refresh, keys=b._node_keys(node_id),
                               args=[f"{inc:x}", b._ms(self.ttl), "", b._base(), MAX_RECORD_BYTES])
            if res != 1:
                raise SessionLost(f"redis: node key of {node_id} is {'gone' if res == 0 else 'not ours'}")

    async def close(self) -> None:
        b = self.backend
        for node_id, inc in self.nodes.items():
            try:
                await b._run(b._unregister, keys=b._node_keys(node_id), args=[f"{inc:x}", b._base(), MAX_RECORD_BYTES])
            except RegistryUnavailable as e:  # the key expires by itself anyway
                log.debug("redis: unregistering %s: %s", node_id, e)
        self.nodes.clear()


class RedisBackend:
    def __init__(self, host: str, port: int, db: int = 0, cluster: str = "kvd",
                 op_timeout: float = DEFAULT_OP_TIMEOUT, poll: float = 0.25,
                 relist: float = RELIST_EVERY, *, username: str = "", password: str = "",
                 tls: ssl.SSLContext | None = None, name: str = "", client_cert: bool = False) -> None:
        """`name`: the registry as messages show it (a redacted URL); `tls`: rediss:// with that context
        (`client_cert`: it holds a certificate of ours)."""
        try:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry  # (the asyncio client's own: a sync one is converted, with a warning)
            from redis.backoff import NoBackoff
        except ImportError:
            raise RuntimeError("the Redis registry needs redis-py: pip install redis") from None
        self.keys = RedisKeys(cluster)
        self.op_timeout = op_timeout
        self.name = name or f"redis{'s' if tls else ''}://{host}:{port}" + (f"/{db}" if db else "")
        self.poll = poll  # how often watch_nodes looks: Redis has no reliable change stream
        # ... and how often it reads the listing even at an unchanged version (a record deleted by hand,
        # or written by a kvd that does not bump the version)
        self.relist = relist
        self.version_key = self.keys.nodes_version
        self.user = username
        self._credentials = bool(password)
        # TLS 1.3 finishes the client's side of the handshake before the server has checked for a
        # client certificate: a server that wants one we lack may then just close the connection
        self._tls_without_cert = tls is not None and not client_cert
        self._plain_unanswered = tls is None  # redis:// with no answer yet: a hang-up may be a TLS server's
        self._skip = Skips(log, self.name)
        self.dropped: Counter[tuple[str, str]] = self._skip.dropped
        self.list_page, self.max_listing_bytes = LIST_PAGE, MAX_LISTING_BYTES
        # no retries inside redis-py: the deadline is ours, and a failure must surface within it
        opts: dict[str, Any] = dict(host=host, port=port, db=db, username=username or None, password=password or None,
                                    socket_timeout=op_timeout, socket_connect_timeout=op_timeout,
                                    retry=Retry(NoBackoff(), 0))
        if tls is None:
            self._r = aioredis.Redis(**opts)
        else:
            pool = aioredis.ConnectionPool(connection_class=_tls_connection(tls), **opts)
            self._r = aioredis.Redis.from_pool(pool)
        s = self._r.register_script
        self._register, self._refresh, self._unregister = s(lua.REGISTER), s(lua.REFRESH), s(lua.UNREGISTER)
        self._check, self._get_node, self._list = s(lua.CHECK), s(lua.GET_NODE), s(lua.LIST)
        self._holders, self._publish, self._unpublish = s(lua.HOLDERS), s(lua.PUBLISH), s(lua.UNPUBLISH)

    @staticmethod
    def _ms(seconds: float) -> int:
        return max(1, int(seconds * 1000))

    @staticmethod
    def _base() -> str:
        return str(secrets.randbits(48) << 8)  # where a missing version key starts

    def _node_keys(self, node_id: str) -> list[str]:
        return [self.keys.node(node_id), self.keys.nodes, self.version_key]

    async def _run(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kw: Any) -> Any:
        """One command or script under the deadline; every failure becomes RegistryUnavailable (or
        RegistryRefused: credentials or a certificate the server does not accept)."""
        from redis.exceptions import AuthenticationError, NoPermissionError, RedisError
        task = asyncio.current_task()
        assert task is not None  # (a coroutine runs in a task)
        cancels = task.cancelling()
        try:
            async with asyncio.timeout(self.op_timeout):
                result = await fn(*args, **kw)
            self._plain_unanswered = False
            return result
        except TimeoutError:
            raise RegistryUnavailable(f"redis at {self.name} did not answer within {self.op_timeout:.2f} s") from None
        except (AuthenticationError, NoPermissionError) as e:
            raise RegistryRefused(self._refusal(e)) from None
        except (RedisError, OSError) as e:
            if (tls := _tls_failure(e)) is not None:
                raise RegistryRefused(f"redis at {self.name}: TLS failed ({tls}); check --registry-ca, and "
                                      "--registry-cert/--registry-key where the server asks for a client "
                                      "certificate") from None
            hint = " (if Redis serves TLS, use rediss://)" if self._plain_unanswered and _HUNG_UP.search(str(e)) else ""
            raise RegistryUnavailable(f"redis at {self.name}: {type(e).__name__}: {e}{hint}") from None
        finally:
            # redis-py sometimes absorbs a cancellation that lands mid-command (seen: ~1 in 50 cancels
            # of a polling watch) and answers or fails as usual; the caller's loop would then carry on
            # forever. A cancel asked for meanwhile, and not our own deadline's, is raised here.
            if task.cancelling() > cancels:
                raise asyncio.CancelledError()

    def _refusal(self, e: Exception) -> str:
        who = f"user {self.user!r}" if self.user else "the default user"
        from redis.exceptions import NoPermissionError
        if isinstance(e, NoPermissionError):
            return f"redis at {self.name} refused kvd ({who}): no permission ({e}); its ACL needs ~kvd:* +@all"
        if not self._credentials:
            return (f"redis at {self.name} requires credentials and kvd gave none: put them in the URL "
                    f"(redis://USER:PASS@HOST:PORT) or the password in --registry-password-file ({e})")
        return f"redis at {self.name} refused kvd's credentials ({who}): {e}"

    # ---- what a read believes ----

    def _node_of(self, key: bytes | str, code: bytes, value: Any) -> NodeRecord | None:
        """The record a node key holds by the scripts' report, or None (counted, unless simply absent)."""
        key = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
        if code != b"V":
            if code in _REASONS:
                self._skip("node", _REASONS[code], key)
            return None
        return vet_node(lambda: value, key, lambda node_id: key == self.keys.node(node_id), self._skip)

    def _conflicting(self, record: NodeRecord, cur: bytes) -> NodeRecord | None:
        """The live record of another incarnation in `cur`, or None when registration may replace it
        (the script judged only its JSON shape; this is the full decode)."""
        try:
            existing = decode_node(cur)
        except RecordError:
            return None
        if existing.node_id != record.node_id or existing.incarnation == record.incarnation:
            return None
        return existing

    # ---- nodes ----

    async def open_session(self, ttl: float) -> RedisSession:
        try:
            await self._run(self._r.ping)
        except RegistryRefused:
            raise
        except RegistryUnavailable as e:  # (a first command that meets a closed TLS connection)
            if self._tls_without_cert and _HUNG_UP.search(str(e)):
                raise RegistryRefused(f"redis at {self.name}: TLS failed (the server closed the connection without "
                                      "an answer, as one that requires a client certificate does); give "
                                      "--registry-cert/--registry-key if it asks for one, and check "
                                      "--registry-ca") from None
            raise
        return RedisSession(self, ttl)

    async def _put(self, session: RedisSession, record: NodeRecord, judged: bytes = b"") -> bytes | None:
        cur = await self._run(self._register, keys=self._node_keys(record.node_id),
                              args=[encode_node(record), f"{record.incarnation:x}", self._ms(session.ttl),
                                    self._base(), MAX_RECORD_BYTES, record.node_id, judged])
        if cur is not None and not isinstance(cur, bytes):  # (the script answers the value in the way, or nil)
            raise RegistryUnavailable(f"redis at {self.name}: registering answered a {type(cur).__name__}")
        return cur

    async def register_node(self, session: RedisSession, record: NodeRecord, _tries: int = 3) -> Registered | Conflict:
        return await self._claim(session, record, b"", _tries)

    async def _claim(self, session: RedisSession, record: NodeRecord, judged: bytes,
                     tries: int) -> Registered | Conflict:
        for _ in range(tries):
            cur = await self._put(session, record, judged)
            if cur is None:
                session.nodes[record.node_id] = record.incarnation
                return Registered(0)
            if (existing := self._conflicting(record, cur)) is not None:
                return Conflict(existing, version=cur)
            judged = cur  # not a record kvd would write: replace exactly that value
        raise RegistryUnavailable(f"redis: node key {record.node_id} keeps changing under registration")

    async def replace_node(self, session: RedisSession, record: NodeRecord,
                           conflict: Conflict) -> Registered | Conflict:
        judged = conflict.version if isinstance(conflict.version, bytes) else b""
        return await self._claim(session, record, judged, 3)

    async def check_node(self, session: RedisSession, record: NodeRecord) -> bool:
        if session.nodes.get(record.node_id) != record.incarnation:
            return False
        answer = await self._run(self._check, keys=[self.keys.node(record.node_id)], args=[encode_node(record)])
        return bool(answer == 1)

    async def get_node(self, node_id: str) -> NodeRecord | None:
        key = self.keys.node(node_id)
        code, value = await self._run(self._get_node, keys=[key], args=[MAX_RECORD_BYTES])
        return self._node_of(key, code, value)

    async def update_node(self, session: RedisSession, record: NodeRecord) -> None:
        res = await self._run(self._refresh, keys=self._node_keys(record.node_id),
                              args=[f"{record.incarnation:x}", self._ms(session.ttl), encode_node(record),
                                    self._base(), MAX_RECORD_BYTES])
        if res != 1:
            raise SessionLost(f"redis: node {record.node_id} is not registered by this incarnation")

    async def list_nodes(self) -> tuple[int, list[NodeRecord]]:
        _, nodes = await self._listing(None)
        assert nodes is not None
        return 0, nodes

    async def _listing(self, known: bytes | None) -> tuple[bytes | None, list[NodeRecord] | None]:
        """(version, live nodes); nodes is None when the listing is still at version `known`. Pages
        through the index; the version is the first page's, so a change while paging shows at the
        next poll."""
        cursor, version, used, seen = b"0", None, 0, {}
        while True:
            reply = await self._run(self._list, keys=[self.keys.nodes, self.version_key],
                                    args=[self._base(), known if known is not None else "", cursor,
                                          self.list_page, self.keys.node(""), MAX_RECORD_BYTES])
            if cursor == b"0":
                version = reply[0]
                if not reply[1]:
                    return version, None
            cursor, flat = reply[2], reply[3:]
            for i in range(0, len(flat), 2):
                member, value = flat[i], flat[i + 1]
                if member not in seen:  # ZSCAN may return a member twice
                    code = b"V" if isinstance(value, bytes) else lua.LIST_CODES.get(value, b"T")
                    seen[member] = self._node_of(member, code, value)
                    used += len(member) + (len(value) if isinstance(value, bytes) else 0)
            if cursor == b"0":
                break
            if used >= self.max_listing_bytes:
                self._skip("node", "truncated", f"{self.keys.nodes}: stopped after {len(seen)} members ({used} bytes)")
                break
        return version, [rec for rec in seen.values() if rec is not None]

    async def watch_nodes(self) -> AsyncIterator[NodeEvent]:
        loop = asyncio.get_running_loop()
        rev = 0
        view: dict[str, NodeRecord] | None = None
        version: bytes | None = None  # the listing's version when `view` was read
        listed_at = 0.0
        while True:
            stale = view is None or version is None or loop.time() - listed_at >= self.relist
            try:
                version, nodes = await self._listing(None if stale else version)
            except RegistryUnavailable as e:
                log.debug("redis node watch: %s", e)
                view = None  # after an outage, start over with a Resync
                await asyncio.sleep(self.poll)
                continue
            if nodes is not None:
                listed_at = loop.time()
                rev += 1
                now = {n.node_id: n for n in nodes}
                if view is None:
                    yield Resync(tuple(nodes), rev)
                else:
                    for node_id in view.keys() - now.keys():
                        yield Removed(node_id, rev)
                    for node_id, rec in now.items():
                        if view.get(node_id) != rec:
                            yield Added(rec, rev)
                view = now
            await asyncio.sleep(self.poll)

    # ---- holders ----

    async def holders(self, rid: str) -> tuple[int, list[HolderRecord]]:
        key = self.keys.holders(rid)
        flat = await self._run(self._holders, keys=[key], args=[self.keys.node(""), MAX_HOLDERS, MAX_RECORD_BYTES])
        if len(flat) == 1:  # not a hash: none, or planted with another type
            if flat[0] != b"none":
                self._skip("holder", "undecodable", f"{key} is a {flat[0]!r}")
            return 0, []
        now = time.time()
        out = []
        for i in range(0, len(flat), 5):
            fld, code, value, ncode, nvalue = flat[i:i + 5]
            rec = self._holder_of(rid, fld, code, value, now)
            # the reader-side liveness filter: Redis cannot tie holders to the node's TTL
            node = self._node_of(self.keys.node("") + fld.decode("utf-8", "replace"), ncode, nvalue) if rec else None
            if rec is not None and node is not None and node.incarnation == rec.incarnation:
                out.append(rec)
        return 0, out

    def _holder_of(self, rid: str, fld: bytes, code: bytes, value: Any, now: float) -> HolderRecord | None:
        where = f"{self.keys.holders(rid)} field {fld[:64]!r}"
        if code != b"V":
            self._skip("holder", "too_large", where)
            return None
        return vet_holder(lambda: value, where, rid, lambda node_id: fld == key_part(node_id).encode(), now,
                          self._skip)

    async def wait_holders(self, rid: str, from_rev: int, timeout: float) -> tuple[int, list[HolderRecord]]:
        # polling with backoff; pub/sub would be lossy, so it could only ever be an optimisation
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        delay = 0.01
        while True:
            _, found = await self.holders(rid)
            left = deadline - loop.time()
            if found or left <= 0:
                return 0, found
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, 0.1)

    async def publish_batch(self, session: RedisSession, ops: Sequence[PublishOp]) -> None:
        if not ops:
            return
        pipe = self._r.pipeline(transaction=False)
        now = time.time()
        for op in ops:
            rec = op.record
            key, fld, value = self.keys.holders(rec.rid), key_part(rec.node_id), encode_holder(rec)
            if isinstance(op, Publish):
                ttl = self._ms(rec.expires_at - now) if rec.expires_at is not None else NO_TTL_HOLDER_MS
                await self._publish(keys=[key], args=[fld, value, ttl], client=pipe)
            else:
                await self._unpublish(keys=[key], args=[fld, value], client=pipe)
        await self._run(pipe.execute)

    async def close(self) -> None:
        try:
            await self._r.aclose()
        except Exception as e:
            log.debug("redis close: %s", e)


_HUNG_UP = re.compile(r"[Cc]onnection (closed by (the )?server|reset by peer)")  # (before any answer)


def _tls_failure(e: BaseException) -> ssl.SSLError | None:
    """The certificate or TLS alert under a redis-py connection error, if that is what it was."""
    seen: BaseException | None = e
    for _ in range(4):
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLError) and not isinstance(seen, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
