"""The etcd backend (daemon and router processes): the registry contract on etcd v3, through its JSON
gateway (etcd_http.py).

Runs in the daemon and in routers. Key schema: records.EtcdKeys. A session is an etcd lease; the
node key and every holder key are put under it, so a dead daemon's records all vanish when the lease
expires (design §3.3). Registration is a Txn on create_revision == 0; unpublish a Txn on the exact
value written. Works with etcd 3.4 and 3.5 (both serve /v3/).
"""
from __future__ import annotations

import asyncio
import base64
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from .backend import (
    DEFAULT_OP_TIMEOUT, Added, Conflict, NodeEvent, Publish, PublishOp, Registered, RegistryUnavailable,
    Removed, Resync, SessionLost,
)
from .etcd_http import GatewayClient, GatewayError
from .records import (
    EtcdKeys, HolderRecord, NodeRecord, RecordError, decode_holder, decode_node, encode_holder, encode_node,
)

log = logging.getLogger(__name__)
_NOT_FOUND = 5  # gRPC status of "requested lease not found"


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
                 op_timeout: float = DEFAULT_OP_TIMEOUT) -> None:
        self.keys = EtcdKeys(cluster)
        self.op_timeout = op_timeout
        self._http = GatewayClient(endpoints)

    async def _call(self, path: str, req: dict[str, Any], *, stream: bool = False,
                    timeout: float | None = None) -> dict[str, Any]:
        """One call under the deadline; every failure becomes RegistryUnavailable or SessionLost."""
        t = self.op_timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(t):
                if not stream:
                    return await self._http.call(path, req)
                gen = self._http.stream(path, req)
                try:
                    async for msg in gen:
                        return msg
                finally:
                    await gen.aclose()
                raise ConnectionError("etcd: empty stream")
        except TimeoutError:
            raise RegistryUnavailable(f"etcd did not answer {path} within {t:.2f} s") from None
        except GatewayError as e:
            if e.code == _NOT_FOUND and "lease" in e.message:
                raise SessionLost(f"etcd: {e.message}") from None
            raise RegistryUnavailable(str(e)) from None
        except (OSError, EOFError, ValueError) as e:
            raise RegistryUnavailable(f"etcd {path}: {e}") from None

    async def open_session(self, ttl: float) -> EtcdSession:
        # leases are whole seconds; etcd raises TTLs below its minimum (1.5 x election timeout)
        resp = await self._call("/v3/lease/grant", {"TTL": max(1, math.ceil(ttl))})
        return EtcdSession(self, int(resp["ID"]), float(resp.get("TTL", ttl)))

    async def register_node(self, session: EtcdSession, record: NodeRecord,
                            _tries: int = 3) -> Registered | Conflict:
        if _tries == 0:
            raise RegistryUnavailable(f"etcd: node key {record.node_id} keeps changing under registration")
        key = _b64(self.keys.node(record.node_id))
        put = {"request_put": {"key": key, "value": _b64(encode_node(record)), "lease": str(session.lease)}}
        resp = await self._call("/v3/kv/txn", {
            "compare": [{"target": "CREATE", "key": key, "create_revision": "0", "result": "EQUAL"}],
            "success": [put], "failure": [{"request_range": {"key": key}}]})
        if resp.get("succeeded"):
            return Registered(_rev(resp))
        kvs = resp["responses"][0].get("response_range", {}).get("kvs", [])
        if not kvs:  # deleted between the compare and now: try again
            return await self.register_node(session, record, _tries - 1)
        kv = kvs[0]
        try:
            existing = decode_node(_unb64(kv.get("value")))
        except RecordError:
            existing = None
        if existing is not None and existing.incarnation != record.incarnation:
            return Conflict(existing)
        # our own record from a previous session (or garbage): replace it, unless it changed meanwhile
        resp = await self._call("/v3/kv/txn", {
            "compare": [{"target": "MOD", "key": key, "mod_revision": kv["mod_revision"], "result": "EQUAL"}],
            "success": [put], "failure": []})
        if resp.get("succeeded"):
            return Registered(_rev(resp))
        return await self.register_node(session, record, _tries - 1)

    async def update_node(self, session: EtcdSession, record: NodeRecord) -> None:
        key = _b64(self.keys.node(record.node_id))
        resp = await self._call("/v3/kv/txn", {
            "compare": [{"target": "LEASE", "key": key, "lease": str(session.lease), "result": "EQUAL"}],
            "success": [{"request_put": {"key": key, "value": _b64(encode_node(record)),
                                         "lease": str(session.lease)}}],
            "failure": []})
        if not resp.get("succeeded"):
            raise SessionLost(f"node {record.node_id} is not registered under lease {session.token}")

    def _decode_nodes(self, kvs: list[dict[str, Any]]) -> list[NodeRecord]:
        out = []
        for kv in kvs:
            try:
                out.append(decode_node(_unb64(kv.get("value"))))
            except RecordError as e:  # one bad record must not hide the others
                log.warning("etcd: skipping node key %s: %s", _unb64(kv.get("key")), e)
        return out

    async def list_nodes(self) -> tuple[int, list[NodeRecord]]:
        p = self.keys.nodes
        resp = await self._call("/v3/kv/range", {"key": _b64(p), "range_end": _prefix_end(p)})
        return _rev(resp), self._decode_nodes(resp.get("kvs", []))

    async def watch_nodes(self) -> AsyncIterator[NodeEvent]:
        p = self.keys.nodes
        backoff = 0.05
        while True:
            try:
                rev, nodes = await self.list_nodes()
                yield Resync(tuple(nodes), rev)
                backoff = 0.05
                async with aclosing(self._watch(p, rev + 1)) as events:
                    async for ev in events:
                        kv = ev.get("kv", {})
                        mod = int(kv.get("mod_revision", 0))
                        if ev.get("type") == "DELETE":
                            yield Removed(unquote(_unb64(kv.get("key")).decode()[len(p):]), mod)
                        else:
                            for node in self._decode_nodes([kv]):
                                yield Added(node, mod)
            except RegistryUnavailable as e:
                log.debug("etcd node watch: %s; re-listing", e)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    async def _watch(self, prefix: str, start: int) -> AsyncIterator[dict]:
        """Events on a prefix from revision `start`; RegistryUnavailable when the stream breaks or the
        revision was compacted (the caller re-lists). No deadline of its own: a watch idles by design,
        and the caller bounds it from outside."""
        req = {"create_request": {"key": _b64(prefix), "range_end": _prefix_end(prefix),
                                  "start_revision": str(start)}}
        gen = self._http.stream("/v3/watch", req)
        try:
            async for msg in gen:
                if msg.get("canceled") or msg.get("compact_revision"):
                    raise RegistryUnavailable(f"etcd watch cancelled (compacted at {msg.get('compact_revision')})")
                for ev in msg.get("events", []):
                    yield ev
            raise RegistryUnavailable("etcd watch stream ended")
        except (OSError, EOFError, ValueError, GatewayError) as e:
            raise RegistryUnavailable(f"etcd watch: {e}") from None
        finally:
            await gen.aclose()

    async def holders(self, rid: str) -> tuple[int, list[HolderRecord]]:
        p = self.keys.holders(rid)
        resp = await self._call("/v3/kv/range", {"key": _b64(p), "range_end": _prefix_end(p)})
        return _rev(resp), self._decode_holders(rid, resp.get("kvs", []))

    def _decode_holders(self, rid: str, kvs: list[dict[str, Any]]) -> list[HolderRecord]:
        now = time.time()
        out = []
        for kv in kvs:
            try:
                rec = decode_holder(_unb64(kv.get("value")))
            except RecordError as e:
                log.warning("etcd: skipping holder key %s: %s", _unb64(kv.get("key")), e)
                continue
            if rec.rid == rid and not rec.expired(now):  # rid_key hashes long ids: check the full id
                out.append(rec)
        return out

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
                        if ev.get("type") != "DELETE":
                            found = self._decode_holders(rid, [ev.get("kv", {})])
                            if found:
                                return int(ev["kv"].get("mod_revision", rev)), found
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
        reqs = []
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
