"""The etcd backend (daemon and router processes): the registry contract on etcd v3, through its JSON
gateway (etcd_http.py), with user/password auth (etcd_auth.py) and TLS when the URL asks for them.

Runs in the daemon and in routers. Key schema: records.EtcdKeys. A session is an etcd lease; the
node key and every holder key are put under it, so a dead daemon's records all vanish when the lease
expires (design §3.3). Registration is a Txn on create_revision == 0; unpublish a Txn on the exact
value written. Works with etcd 3.4 and 3.5 (both serve /v3/).

Whoever can write the registry may have planted anything, so every read is bounded and filtered:
listings page (LIST_PAGE keys a call, at one revision) and stop at MAX_LISTING_BYTES; holder reads
stop at MAX_HOLDERS; a value over MAX_RECORD_BYTES, undecodable, under a key that is not its node
id's, or (a node record) bound to no lease is skipped and counted in `dropped`.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from ssl import SSLContext
from typing import Any, TypeVar
from urllib.parse import unquote

from ..health import Backoff
from ..records import (
    EtcdKeys,
    HolderRecord,
    NodeRecord,
    encode_holder,
    encode_node,
    vet_holder,
    vet_node,
)
from ..skips import Skips
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
from .etcd_auth import TokenAuth, refusal
from .etcd_http import BodyTooLarge, GatewayClient, GatewayError, TLSError

log = logging.getLogger(__name__)
_T = TypeVar("_T")  # what a bounded call returns
_NOT_FOUND, _OUT_OF_RANGE = 5, 11  # gRPC status codes: "requested lease not found", "revision compacted"
_VALUE_B64_MAX = (MAX_RECORD_BYTES + 2) // 3 * 4  # a value at the size cap, in the gateway's base64
# what one page of a range may weigh: a page of records under the size cap always fits
_PAGE_BODY = 2 * LIST_PAGE * MAX_RECORD_BYTES
_HOLDERS_BODY = 2 * MAX_HOLDERS * MAX_RECORD_BYTES


class _TooLarge(RegistryUnavailable):
    """A range answer over its cap: read it again in smaller pages."""


class _Compacted(RegistryUnavailable):
    """The revision a paged listing is pinned to was compacted meanwhile: list again."""


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def _unb64(s: str | None) -> bytes:
    return base64.b64decode(s) if s else b""


def _prefix_end(prefix: str) -> str:
    # the range end of a prefix: the prefix with its last byte + 1 (our prefixes end in '/')
    raw = prefix.encode()
    return _b64(raw[:-1] + bytes([raw[-1] + 1]))


def _rev(resp: dict[str, Any]) -> int:
    return int(resp.get("header", {}).get("revision", 0))


def _key(kv: dict[str, Any]) -> str:
    return _unb64(kv.get("key")).decode("utf-8", "replace")


@dataclass
class EtcdSession:
    backend: EtcdBackend
    lease: int
    ttl: float

    @property
    def token(self) -> str:
        return f"{self.lease:x}"

    async def keepalive(self) -> None:
        # the gateway's keepalive is a stream; one request in, one answer out, then it ends
        resp = await self.backend._call("/v3/lease/keepalive", {"ID": str(self.lease)}, stream=True)
        if int(resp.get("TTL", 0)) <= 0:
            raise SessionLost(f"etcd lease {self.token} expired or was revoked")

    async def close(self) -> None:
        try:
            await self.backend._call("/v3/lease/revoke", {"ID": str(self.lease)})
        except Exception as e:  # revoking is a courtesy: the lease expires by itself anyway
            log.debug("revoking etcd lease %s: %s", self.token, e)


class EtcdBackend:
    def __init__(self, endpoints: list[tuple[str, int]], cluster: str = "kvd",
                 op_timeout: float = DEFAULT_OP_TIMEOUT, *, username: str = "", password: str = "",
                 tls: SSLContext | None = None, name: str = "") -> None:
        """`name`: the registry as messages show it (a redacted URL); `tls`: https with that context."""
        self.keys = EtcdKeys(cluster)
        self.op_timeout = op_timeout
        self.name = name or ("etcds://" if tls else "etcd://") + ",".join(f"{h}:{p}" for h, p in endpoints)
        self._http = GatewayClient(endpoints, tls)
        self._auth = TokenAuth(username, password) if username else None
        self._skip = Skips(log, self.name)
        self.dropped: Counter[tuple[str, str]] = self._skip.dropped
        self.list_page, self.page_body, self.max_listing_bytes = LIST_PAGE, _PAGE_BODY, MAX_LISTING_BYTES

    # ---- calls ----

    async def _call(self, path: str, req: dict[str, Any], *, stream: bool = False,
                    timeout: float | None = None, max_body: int | None = None) -> dict[str, Any]:
        """One call under the deadline (a login it needs included); every failure becomes
        RegistryUnavailable, SessionLost or RegistryRefused."""
        return await self._bounded(path, self._authed(path, req, stream, max_body), timeout)

    async def _bounded(self, path: str, coro: Awaitable[_T], timeout: float | None = None) -> _T:
        t = self.op_timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(t):
                return await coro
        except TimeoutError:
            if self._auth is not None:
                # etcd holds a call whose token names a raft index it has not reached (the token of a
                # server since wiped) until that index comes: log in afresh rather than wait again
                self._auth.invalidate()
            raise RegistryUnavailable(f"etcd at {self.name} did not answer {path} within {t:.2f} s") from None
        except GatewayError as e:
            raise self._mapped(e) from None
        except TLSError as e:
            raise RegistryRefused(f"etcd at {self.name}: TLS failed ({e}); check --registry-ca, and "
                                  "--registry-cert/--registry-key where the server asks for a client "
                                  "certificate") from None
        except BodyTooLarge as e:
            raise _TooLarge(str(e)) from None
        except (OSError, EOFError, ValueError) as e:
            raise RegistryUnavailable(f"etcd at {self.name} {path}: {e}") from None

    async def _authed(self, path: str, req: dict[str, Any], stream: bool, max_body: int | None) -> dict[str, Any]:
        auth = self._auth
        if auth is not None and auth.token is None:
            await auth.login(self._http)
        stale = auth.token if auth is not None else None
        try:
            return await self._once(path, req, stream, max_body)
        except GatewayError as e:
            if auth is None or not auth.should_retry(e):
                raise
        await auth.login(self._http, stale)  # expired: once more with a fresh token
        return await self._once(path, req, stream, max_body)

    async def _once(self, path: str, req: dict[str, Any], stream: bool, max_body: int | None) -> dict[str, Any]:
        headers = self._auth.headers() if self._auth is not None else ()
        if not stream:
            return await self._http.call(path, req, headers=headers, max_body=max_body)
        async with aclosing(self._http.stream(path, req, headers=headers)) as gen:
            async for msg in gen:
                return msg
        raise ConnectionError("etcd: empty stream")

    def _mapped(self, e: GatewayError) -> RegistryUnavailable:
        if e.code == _NOT_FOUND and "lease" in e.message:
            return SessionLost(f"etcd: {e.message}")
        if (msg := refusal(e, self.name, self._auth.user if self._auth else "")) is not None:
            return RegistryRefused(msg)
        if e.code == _OUT_OF_RANGE and "compacted" in e.message:
            return _Compacted(f"etcd at {self.name}: {e.message}")
        return RegistryUnavailable(f"etcd at {self.name}: {e}")

    async def _login(self) -> None:
        """Before a stream: a watch carries the token from its first byte."""
        if self._auth is not None and self._auth.token is None:
            await self._bounded("/v3/auth/authenticate", self._auth.login(self._http))

    # ---- what a read believes ----

    def _node_of(self, kv: dict[str, Any]) -> NodeRecord | None:
        """The record in a node kv, or None (counted) when it is not to be read."""
        key = _key(kv)
        if len(kv.get("value") or "") > _VALUE_B64_MAX:
            self._skip("node", "too_large", key)
            return None
        if int(kv.get("lease") or 0) == 0:  # kvd writes node records only under a lease
            self._skip("node", "unleased", key)
            return None
        return vet_node(lambda: _unb64(kv.get("value")), key, lambda node_id: key == self.keys.node(node_id),
                        self._skip)

    def _holder_of(self, rid: str, kv: dict[str, Any], now: float) -> HolderRecord | None:
        key = _key(kv)
        if len(kv.get("value") or "") > _VALUE_B64_MAX:
            self._skip("holder", "too_large", key)
            return None
        return vet_holder(lambda: _unb64(kv.get("value")), key, rid,
                          lambda node_id: key == self.keys.holder(rid, node_id), now, self._skip)

    def _node_id_of(self, key: str) -> str | None:
        """The node id a node key names, or None for a key no node record is ever under."""
        node_id = unquote(key[len(self.keys.nodes):])
        return node_id if key.startswith(self.keys.nodes) and self.keys.node(node_id) == key else None

    # ---- nodes ----

    async def open_session(self, ttl: float) -> EtcdSession:
        # leases are whole seconds; etcd raises TTLs below its minimum (1.5 x election timeout)
        resp = await self._call("/v3/lease/grant", {"TTL": max(1, math.ceil(ttl))})
        return EtcdSession(self, int(resp["ID"]), float(resp.get("TTL", ttl)))

    def _put(self, session: EtcdSession, record: NodeRecord) -> dict[str, Any]:
        return {"request_put": {"key": _b64(self.keys.node(record.node_id)), "value": _b64(encode_node(record)),
                                "lease": str(session.lease)}}

    async def register_node(self, session: EtcdSession, record: NodeRecord,
                            _tries: int = 3) -> Registered | Conflict:
        if _tries == 0:
            raise RegistryUnavailable(f"etcd: node key {record.node_id} keeps changing under registration")
        key = _b64(self.keys.node(record.node_id))
        resp = await self._call("/v3/kv/txn", {
            "compare": [{"target": "CREATE", "key": key, "create_revision": "0", "result": "EQUAL"}],
            "success": [self._put(session, record)], "failure": [{"request_range": {"key": key}}]},
            max_body=_HOLDERS_BODY)
        if resp.get("succeeded"):
            return Registered(_rev(resp))
        kvs = resp["responses"][0].get("response_range", {}).get("kvs", [])
        if not kvs:  # deleted between the compare and now: try again
            return await self.register_node(session, record, _tries - 1)
        existing = self._node_of(kvs[0])
        if existing is not None and existing.node_id == record.node_id and existing.incarnation != record.incarnation:
            return Conflict(existing, version=int(kvs[0]["mod_revision"]))
        # our own record from a previous session, or one kvd never wrote (garbage, oversized, another
        # node's id, no lease): replace it, unless it changed meanwhile
        return await self._put_over(session, record, int(kvs[0]["mod_revision"]), _tries)

    async def _put_over(self, session: EtcdSession, record: NodeRecord, mod: int, tries: int) -> Registered | Conflict:
        key = _b64(self.keys.node(record.node_id))
        resp = await self._call("/v3/kv/txn", {
            "compare": [{"target": "MOD", "key": key, "mod_revision": str(mod), "result": "EQUAL"}],
            "success": [self._put(session, record)], "failure": []})
        if resp.get("succeeded"):
            return Registered(_rev(resp))
        return await self.register_node(session, record, tries - 1)

    async def replace_node(self, session: EtcdSession, record: NodeRecord, conflict: Conflict) -> Registered | Conflict:
        if not isinstance(conflict.version, int):  # not a conflict this backend reported
            return await self.register_node(session, record)
        return await self._put_over(session, record, conflict.version, 3)

    async def check_node(self, session: EtcdSession, record: NodeRecord) -> bool:
        key = _b64(self.keys.node(record.node_id))
        resp = await self._call("/v3/kv/txn", {
            "compare": [{"target": "VALUE", "key": key, "value": _b64(encode_node(record)), "result": "EQUAL"},
                        {"target": "LEASE", "key": key, "lease": str(session.lease), "result": "EQUAL"}],
            "success": [], "failure": []})
        return bool(resp.get("succeeded"))

    async def get_node(self, node_id: str) -> NodeRecord | None:
        resp = await self._call("/v3/kv/range", {"key": _b64(self.keys.node(node_id))}, max_body=_HOLDERS_BODY)
        kvs = resp.get("kvs", [])
        return self._node_of(kvs[0]) if kvs else None

    async def update_node(self, session: EtcdSession, record: NodeRecord) -> None:
        key = _b64(self.keys.node(record.node_id))
        resp = await self._call("/v3/kv/txn", {
            "compare": [{"target": "LEASE", "key": key, "lease": str(session.lease), "result": "EQUAL"}],
            "success": [self._put(session, record)], "failure": []})
        if not resp.get("succeeded"):
            raise SessionLost(f"node {record.node_id} is not registered under lease {session.token}")

    async def _range(self, prefix: str, kind: str, *, page: int, most: int, page_body: int,
                     budget: int) -> tuple[int, list[dict[str, Any]]]:
        """Up to `most` kvs under a prefix, `page` keys a call, all at the first page's revision; a page
        over `page_body` is read again in smaller ones. Stops (counted as truncated) at `most` kvs or
        once the answers weigh `budget` bytes."""
        for _ in range(3):
            try:
                return await self._pages(prefix, kind, page=page, most=most, page_body=page_body, budget=budget)
            except _Compacted:
                continue  # compacted under a long listing: start over at the new revision
        raise RegistryUnavailable(f"etcd at {self.name}: {prefix} compacted under three listings in a row")

    async def _pages(self, prefix: str, kind: str, *, page: int, most: int, page_body: int,
                     budget: int) -> tuple[int, list[dict[str, Any]]]:
        start, end = prefix.encode(), _prefix_end(prefix)
        rev, used, limit = 0, 0, page
        out: list[dict[str, Any]] = []
        while True:
            req: dict[str, Any] = {"key": _b64(start), "range_end": end, "limit": str(min(limit, most - len(out)))}
            if rev:
                req["revision"] = str(rev)
            try:
                resp = await self._call("/v3/kv/range", req, max_body=page_body)
            except _TooLarge:
                used += page_body
                if limit == 1 or used >= budget:
                    self._skip(kind, "truncated", f"{prefix}: a record too large to read, after {len(out)} records")
                    return rev, out
                limit = max(1, limit // 16)  # oversized values in this page: smaller pages over them
                continue
            rev = rev or _rev(resp)
            kvs = resp.get("kvs", [])
            out += kvs
            used += sum(len(kv.get("key") or "") + len(kv.get("value") or "") for kv in kvs)
            if not resp.get("more") or not kvs:
                return rev, out
            if len(out) >= most or used >= budget:
                self._skip(kind, "truncated", f"{prefix}: stopped after {len(out)} records ({used} bytes)")
                return rev, out
            start, limit = _unb64(kvs[-1]["key"]) + b"\0", page

    async def list_nodes(self) -> tuple[int, list[NodeRecord]]:
        rev, kvs = await self._range(self.keys.nodes, "node", page=self.list_page, most=1 << 62,
                                     page_body=self.page_body, budget=self.max_listing_bytes)
        return rev, [rec for kv in kvs if (rec := self._node_of(kv)) is not None]

    async def watch_nodes(self) -> AsyncIterator[NodeEvent]:
        backoff = Backoff(0.05, 1.0)  # between re-listings, reset by one that succeeds
        while True:
            try:
                rev, nodes = await self.list_nodes()
                yield Resync(tuple(nodes), rev)
                backoff.reset()
                async with aclosing(self._watch(self.keys.nodes, rev + 1)) as events:
                    async for ev in events:
                        if (node_ev := self._node_event(ev)) is not None:
                            yield node_ev
            except RegistryUnavailable as e:
                log.debug("etcd node watch: %s; re-listing", e)
            await asyncio.sleep(backoff.failed())

    def _node_event(self, ev: dict[str, Any]) -> NodeEvent | None:
        kv = ev.get("kv", {})
        node_id = self._node_id_of(_key(kv))
        if node_id is None:  # not a key any node is registered under: nothing to add or remove
            return None
        mod = int(kv.get("mod_revision", 0))
        if ev.get("type") != "DELETE" and (rec := self._node_of(kv)) is not None:
            return Added(rec, mod)
        return Removed(node_id, mod)  # deleted, or overwritten with a record no listing would show

    async def _watch(self, prefix: str, start: int) -> AsyncGenerator[dict[str, Any], None]:
        """Events on a prefix from revision `start`; RegistryUnavailable when the stream breaks or the
        revision was compacted (the caller re-lists). No deadline of its own: a watch idles by design,
        and the caller bounds it from outside."""
        await self._login()
        # fragment: etcd splits a big batch of events into messages under its request limit
        req = {"create_request": {"key": _b64(prefix), "range_end": _prefix_end(prefix),
                                  "start_revision": str(start), "fragment": True}}
        headers = self._auth.headers() if self._auth is not None else ()
        try:
            async with aclosing(self._http.stream("/v3/watch", req, headers=headers)) as gen:
                async for msg in gen:
                    if msg.get("canceled") or msg.get("compact_revision"):
                        raise self._cancelled(msg)
                    for ev in msg.get("events", []):
                        yield ev
            raise RegistryUnavailable("etcd watch stream ended")
        except TLSError as e:
            raise RegistryRefused(f"etcd at {self.name}: TLS failed ({e})") from None
        except (OSError, EOFError, ValueError, GatewayError) as e:
            raise RegistryUnavailable(f"etcd watch: {e}") from None

    def _cancelled(self, msg: dict[str, Any]) -> RegistryUnavailable:
        reason = str(msg.get("cancel_reason") or "")
        if self._auth is not None and "auth token" in reason:
            self._auth.invalidate()  # the next call logs in again
        elif (refused := refusal(reason, self.name, self._auth.user if self._auth else "")) is not None:
            return RegistryRefused(refused)
        why = reason or f"compacted at {msg.get('compact_revision')}"
        return RegistryUnavailable(f"etcd watch cancelled ({why})")

    # ---- holders ----

    async def holders(self, rid: str) -> tuple[int, list[HolderRecord]]:
        rev, kvs = await self._range(self.keys.holders(rid), "holder", page=MAX_HOLDERS, most=MAX_HOLDERS,
                                     page_body=_HOLDERS_BODY, budget=_HOLDERS_BODY)
        now = time.time()
        return rev, [rec for kv in kvs if (rec := self._holder_of(rid, kv, now)) is not None]

    async def wait_holders(self, rid: str, from_rev: int, timeout: float) -> tuple[int, list[HolderRecord]]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        rev, start = from_rev, from_rev + 1
        while True:
            left = deadline - loop.time()
            if left <= 0:
                return rev, []
            try:
                # a watch from from_rev + 1 sees every put after the caller's lookup: no gap
                async with asyncio.timeout(left), aclosing(self._watch(self.keys.holders(rid), start)) as evs:
                    async for ev in evs:
                        kv = ev.get("kv", {})
                        if ev.get("type") != "DELETE" and (rec := self._holder_of(rid, kv, time.time())):
                            return int(kv.get("mod_revision", rev)), [rec]
            except TimeoutError:
                return rev, []
            except RegistryUnavailable:
                # stream broke (server restarted, compaction): look again, then watch from there
                await asyncio.sleep(min(0.05, max(0.0, deadline - loop.time())))
                if deadline - loop.time() <= 0:
                    return rev, []
                rev, found = await self.holders(rid)
                if found:
                    return rev, found
                start = rev + 1

    async def publish_batch(self, session: EtcdSession, ops: Sequence[PublishOp]) -> None:
        if not ops:
            return
        lease = str(session.lease)
        reqs: list[dict[str, Any]] = []
        for op in ops:
            key = _b64(self.keys.holder(op.record.rid, op.record.node_id))
            value = _b64(encode_holder(op.record))
            if isinstance(op, Publish):
                reqs.append({"request_put": {"key": key, "value": value, "lease": lease}})
            else:  # a nested Txn per delete, so one record that changed does not fail the batch
                reqs.append({"request_txn": {
                    "compare": [{"target": "VALUE", "key": key, "value": value, "result": "EQUAL"}],
                    "success": [{"request_delete_range": {"key": key}}], "failure": []}})
        await self._call("/v3/kv/txn", {"compare": [], "success": reqs, "failure": []})

    async def close(self) -> None:
        await self._http.close()
