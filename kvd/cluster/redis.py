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
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .backend import (
    DEFAULT_OP_TIMEOUT, Added, Conflict, NodeEvent, Publish, PublishOp, Registered, RegistryUnavailable,
    Removed, Resync, SessionLost,
)
from .records import (
    HolderRecord, NodeRecord, RecordError, RedisKeys, decode_holder, decode_node, encode_holder, encode_node,
    key_part,
)

log = logging.getLogger(__name__)
NO_TTL_HOLDER_MS = 24 * 3600 * 1000  # a holder hash always expires; entries without a TTL get a day
RELIST_EVERY = 10.0  # seconds: a node watch reads the whole listing this often even if its version holds

# Every script that changes the node listing bumps its version key (KEYS[3]), so that watchers need
# not read the listing to learn that it did not change. A missing version starts at a random base (the
# last ARGV), so that a wiped server never repeats a version a watcher saw before the wipe.
_BUMP = """
local function bump(key, base)
  if redis.call('INCR', key) == 1 then redis.call('SET', key, base) end
end
"""
# KEYS: nodes zset, version. ARGV: version base. Drops index members whose score (expiry) has passed.
_PRUNE = """
local function prune(index, version, base)
  local t = redis.call('TIME')
  if redis.call('ZREMRANGEBYSCORE', index, '-inf', t[1] * 1000 + math.floor(t[2] / 1000)) > 0 then
    bump(version, base)
  end
end
"""
# KEYS: node key, nodes zset, version. ARGV: value, incarnation, ttl ms, version base.
# -> nil (registered) | the holder's value
_REGISTER = _BUMP + """
local cur = redis.call('GET', KEYS[1])
if cur then
  local ok, rec = pcall(cjson.decode, cur)
  if ok and type(rec) == 'table' and rec['incarnation'] ~= ARGV[2] then return cur end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
local t = redis.call('TIME')
redis.call('ZADD', KEYS[2], t[1] * 1000 + math.floor(t[2] / 1000) + tonumber(ARGV[3]), KEYS[1])
bump(KEYS[3], ARGV[4])
return false
"""
# KEYS: node key, nodes zset, version. ARGV: incarnation, ttl ms, new value or '', version base.
# -> 1 ok, 0 gone, -1 not ours. A plain refresh leaves the listing (and its version) as it was.
_REFRESH = _BUMP + """
local cur = redis.call('GET', KEYS[1])
if not cur then return 0 end
local ok, rec = pcall(cjson.decode, cur)
if not ok or type(rec) ~= 'table' or rec['incarnation'] ~= ARGV[1] then return -1 end
if ARGV[3] ~= '' then
  redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[2])
  bump(KEYS[3], ARGV[4])
else redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
local t = redis.call('TIME')
redis.call('ZADD', KEYS[2], t[1] * 1000 + math.floor(t[2] / 1000) + tonumber(ARGV[2]), KEYS[1])
return 1
"""
# KEYS: node key, nodes zset, version. ARGV: incarnation, version base
_UNREGISTER = _BUMP + """
local cur = redis.call('GET', KEYS[1])
local gone = 0
if cur then
  local ok, rec = pcall(cjson.decode, cur)
  if ok and type(rec) == 'table' and rec['incarnation'] == ARGV[1] then gone = redis.call('DEL', KEYS[1]) end
end
if redis.call('ZREM', KEYS[2], KEYS[1]) + gone > 0 then bump(KEYS[3], ARGV[2]) end
return 1
"""
# KEYS: nodes zset, version. ARGV: version base, the version the caller has read ('' = none).
# -> {version, 0} when the listing is still at that version, else {version, 1, values of the live node keys}
_LIST = _BUMP + _PRUNE + """
prune(KEYS[1], KEYS[2], ARGV[1])
local version = redis.call('GET', KEYS[2])
if ARGV[2] ~= '' and version == ARGV[2] then return {version, 0} end
local members = redis.call('ZRANGE', KEYS[1], 0, -1)
local out = {version, 1}
if #members == 0 then return out end
for _, v in ipairs(redis.call('MGET', unpack(members))) do out[#out + 1] = v end
return out
"""
# KEYS: holders hash. ARGV: node key prefix -> {field, holder value, node value or false, ...}
_HOLDERS = """
local all = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #all, 2 do
  out[#out + 1] = all[i]; out[#out + 1] = all[i + 1]
  out[#out + 1] = redis.call('GET', ARGV[1] .. all[i])
end
return out
"""
# KEYS: holders hash. ARGV: field, value, ttl ms (the hash lives as long as its longest entry)
_PUBLISH = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[3]) then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
return 1
"""
# KEYS: holders hash. ARGV: field, value: delete only the exact record that was written
_UNPUBLISH = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""


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
            res = await b._run(b._refresh, keys=b._node_keys(node_id), args=[f"{inc:x}", b._ms(self.ttl), "",
                                                                              b._base()])
            if res != 1:
                raise SessionLost(f"redis: node key of {node_id} is {'gone' if res == 0 else 'not ours'}")

    async def close(self) -> None:
        b = self.backend
        for node_id, inc in self.nodes.items():
            try:
                await b._run(b._unregister, keys=b._node_keys(node_id), args=[f"{inc:x}", b._base()])
            except RegistryUnavailable as e:  # the key expires by itself anyway
                log.debug("redis: unregistering %s: %s", node_id, e)
        self.nodes.clear()


class RedisBackend:
    def __init__(self, host: str, port: int, db: int = 0, cluster: str = "kvd",
                 op_timeout: float = DEFAULT_OP_TIMEOUT, poll: float = 0.25,
                 relist: float = RELIST_EVERY) -> None:
        try:
            import redis.asyncio as aioredis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise RuntimeError("the Redis registry needs redis-py: pip install redis") from None
        self.keys = RedisKeys(cluster)
        self.op_timeout = op_timeout
        self.poll = poll  # how often watch_nodes looks: Redis has no reliable change stream
        # ... and how often it reads the listing even at an unchanged version (a record deleted by hand,
        # or written by a kvd that does not bump the version)
        self.relist = relist
        self.version_key = self.keys.nodes_version
        # no retries inside redis-py: the deadline is ours, and a failure must surface within it
        self._r = aioredis.Redis(host=host, port=port, db=db, socket_timeout=op_timeout,
                                 socket_connect_timeout=op_timeout, retry=Retry(NoBackoff(), 0))
        s = self._r.register_script
        self._register, self._refresh, self._unregister = s(_REGISTER), s(_REFRESH), s(_UNREGISTER)
        self._list, self._holders, self._publish, self._unpublish = (
            s(_LIST), s(_HOLDERS), s(_PUBLISH), s(_UNPUBLISH))

    @staticmethod
    def _ms(seconds: float) -> int:
        return max(1, int(seconds * 1000))

    @staticmethod
    def _base() -> str:
        return str(secrets.randbits(48) << 8)  # where a missing version key starts

    def _node_keys(self, node_id: str) -> list[str]:
        return [self.keys.node(node_id), self.keys.nodes, self.version_key]

    async def _run(self, fn, *args: Any, **kw: Any) -> Any:
        """One command or script under the deadline; every failure becomes RegistryUnavailable."""
        from redis.exceptions import RedisError
        task = asyncio.current_task()
        cancels = task.cancelling()
        try:
            async with asyncio.timeout(self.op_timeout):
                return await fn(*args, **kw)
        except TimeoutError:
            raise RegistryUnavailable(f"redis did not answer within {self.op_timeout:.2f} s") from None
        except (RedisError, OSError) as e:
            raise RegistryUnavailable(f"redis: {type(e).__name__}: {e}") from None
        finally:
            # redis-py sometimes absorbs a cancellation that lands mid-command (seen: ~1 in 50 cancels
            # of a polling watch) and answers or fails as usual; the caller's loop would then carry on
            # forever. A cancel asked for meanwhile, and not our own deadline's, is raised here.
            if task.cancelling() > cancels:
                raise asyncio.CancelledError()

    async def open_session(self, ttl: float) -> RedisSession:
        await self._run(self._r.ping)
        return RedisSession(self, ttl)

    async def register_node(self, session: RedisSession, record: NodeRecord) -> Registered | Conflict:
        cur = await self._run(self._register, keys=self._node_keys(record.node_id),
                              args=[encode_node(record), f"{record.incarnation:x}", self._ms(session.ttl),
                                    self._base()])
        if cur is None:
            session.nodes[record.node_id] = record.incarnation
            return Registered(0)
        return Conflict(decode_node(cur))

    async def update_node(self, session: RedisSession, record: NodeRecord) -> None:
        res = await self._run(self._refresh, keys=self._node_keys(record.node_id),
                              args=[f"{record.incarnation:x}", self._ms(session.ttl), encode_node(record),
                                    self._base()])
        if res != 1:
            raise SessionLost(f"redis: node {record.node_id} is not registered by this incarnation")

    async def list_nodes(self) -> tuple[int, list[NodeRecord]]:
        _, nodes = await self._listing(None)
        assert nodes is not None
        return 0, nodes

    async def _listing(self, known: bytes | None) -> tuple[bytes | None, list[NodeRecord] | None]:
        """(version, live nodes); nodes is None when the listing is still at version `known`."""
        reply = await self._run(self._list, keys=[self.keys.nodes, self.version_key],
                                args=[self._base(), known if known is not None else ""])
        version, changed, values = reply[0], reply[1], reply[2:]
        if not changed:
            return version, None
        out = []
        for v in values:
            if v is None:
                continue  # expired between the index and the key
            try:
                out.append(decode_node(v))
            except RecordError as e:
                log.warning("redis: skipping a node record: %s", e)
        return version, out

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

    async def holders(self, rid: str) -> tuple[int, list[HolderRecord]]:
        flat = await self._run(self._holders, keys=[self.keys.holders(rid)], args=[self.keys.node("")])
        now = time.time()
        out = []
        for i in range(0, len(flat), 3):
            try:
                rec = decode_holder(flat[i + 1])
                node = decode_node(flat[i + 2]) if flat[i + 2] else None
            except RecordError as e:
                log.warning("redis: skipping a holder of %r: %s", rid, e)
                continue
            # the reader-side liveness filter: Redis cannot tie holders to the node's TTL
            if rec.rid == rid and not rec.expired(now) and node is not None and node.incarnation == rec.incarnation:
                out.append(rec)
        return 0, out

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
