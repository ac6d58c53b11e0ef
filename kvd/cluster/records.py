"""Node and holder records, their JSON form, and the registry key schema (daemon and router processes).

Pure: no I/O, no asyncio. Runs wherever records are read or written (daemon, router, tests).
Values are JSON (not msgpack) so that etcdctl, redis-cli and routers in any language can read them;
`proto/REGISTRY.md` documents the same schema. Every record carries `"v": 1`; readers ignore fields
they do not know and reject a record that lacks a field they need, with `RecordError`.
"""
from __future__ import annotations

import builtins
import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ProtocolError

RECORD_VERSION = 1
ROLES = ("prefill", "decode", "any")
HOLDER_STATES = ("complete", "streaming")
MAX_PLAIN_RID = 128  # longer (or non-printable) request ids are hashed into their key (design §3.3)
_CLUSTER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_KEY_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._@+=")


class RecordError(ProtocolError):
    """A registry value could not be decoded as a kvd record."""


@dataclass(frozen=True)
class NodeRecord:
    """One daemon's advertisement; lives exactly as long as its session (lease / TTL)."""

    node_id: str
    incarnation: int  # random 63-bit number, new on every daemon start; JSON: lowercase hex
    endpoint: str  # "tcp://host:port" that peers dial
    role: str = "any"  # prefill | decode | any
    pool_bytes: int = 0
    block_size: int = 0
    protocol: tuple[int, int] = (1, 1)  # lowest and highest wire protocol version spoken
    curve_public: str | None = None  # z85 CURVE server key when CURVE is on
    labels: dict[str, str] = field(default_factory=dict)  # zone, host, model, ... (free form)
    started_at: float = 0.0  # unix time of the daemon's start
    device: str = "cpu"
    cache_bytes: int = 0  # the KV tier's budget (--cache-size); 0: takes no tier pages. Sent only when > 0
    # with a cluster CA: the node's cert (base64) and its signature over the rest (base64); readers
    # that know the CA drop a record without both (kvd.cluster.signing)
    cert: str | None = None
    sig: str | None = None
    payload: bytes = field(default=b"", compare=False, repr=False)  # what sig covers, as read


@dataclass(frozen=True)
class HolderRecord:
    """"Node `node_id` holds request `rid`": a hint, verified by the holder before it serves."""

    rid: str
    node_id: str
    incarnation: int  # the holder's incarnation when it published
    gen: int  # the holder store's reservation token for the entry (Pull's expect_gen)
    nbytes: int
    state: str = "complete"  # complete | streaming; plain gets only use complete ones
    expires_at: float | None = None  # unix time the entry's own TTL ends, None for no TTL
    sig: str | None = None  # with a cluster CA: the holder node's signature (base64) over the rest
    payload: bytes = field(default=b"", compare=False, repr=False)  # what sig covers, as read

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now


# ---- encode ----

def _dumps(obj: dict[str, Any]) -> bytes:
    # sorted keys and no spaces: one record has exactly one encoding, so conditional deletes can
    # compare values byte for byte
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _node_fields(rec: NodeRecord) -> dict[str, Any]:
    fields = {
        "v": RECORD_VERSION, "node_id": rec.node_id, "incarnation": f"{rec.incarnation:x}",
        "endpoint": rec.endpoint, "role": rec.role, "pool_bytes": rec.pool_bytes,
        "block_size": rec.block_size, "protocol": list(rec.protocol),
        "curve_public": rec.curve_public, "labels": dict(rec.labels),
        "started_at": rec.started_at, "device": rec.device,
    }
    if rec.cache_bytes:  # (absent otherwise: a record without a tier keeps its old bytes)
        fields["cache_bytes"] = rec.cache_bytes
    if rec.cert is not None:
        fields["cert"] = rec.cert
    return fields


def _holder_fields(rec: HolderRecord) -> dict[str, Any]:
    return {
        "v": RECORD_VERSION, "rid": rec.rid, "node_id": rec.node_id,
        "incarnation": f"{rec.incarnation:x}", "gen": rec.gen, "nbytes": rec.nbytes,
        "state": rec.state, "expires_at": rec.expires_at,
    }


def _signed(fields: dict[str, Any], sig: str | None) -> bytes:
    return _dumps(fields if sig is None else {**fields, "sig": sig})


def encode_node(rec: NodeRecord) -> bytes:
    return _signed(_node_fields(rec), rec.sig)


def encode_holder(rec: HolderRecord) -> bytes:
    return _signed(_holder_fields(rec), rec.sig)


def node_payload(rec: NodeRecord) -> bytes:
    """What a node record's signature covers: its encoding without "sig" (the exact bytes as read,
    unknown fields included, for a decoded record; rebuilt for one made here)."""
    return rec.payload or _dumps(_node_fields(rec))


def holder_payload(rec: HolderRecord) -> bytes:
    return rec.payload or _dumps(_holder_fields(rec))


# ---- decode ----

class _Fields:
    """Typed access to a decoded JSON object; every complaint names the record kind and field.
    (Its methods are named for the types they read: past `str` and `int`, annotations say builtins.)"""

    def __init__(self, raw: bytes | str, kind: str) -> None:
        self.kind = kind
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise RecordError(f"{kind} record is not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise RecordError(f"{kind} record is not a JSON object")
        if obj.get("v") != RECORD_VERSION:
            raise RecordError(f"{kind} record has version {obj.get('v')!r}, this kvd reads v{RECORD_VERSION}")
        self.obj = obj

    def payload(self) -> bytes:
        """The record's canonical encoding without its signature: what "sig" signs."""
        return _dumps({k: v for k, v in self.obj.items() if k != "sig"}) if "sig" in self.obj else b""

    def fail(self, name: str, what: str) -> RecordError:
        return RecordError(f"{self.kind} record: field {name!r} {what}")

    def str(self, name: str, *, optional: bool = False, choices: tuple[str, ...] = ()) -> Any:
        v = self.obj.get(name)
        if v is None and optional:
            return None
        if not isinstance(v, str) or not v:
            raise self.fail(name, "must be a non-empty string")
        if choices and v not in choices:
            raise self.fail(name, f"must be one of {', '.join(choices)}, not {v!r}")
        return v

    def int(self, name: builtins.str, default: builtins.int | None = None) -> builtins.int:
        v = self.obj.get(name, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise self.fail(name, "must be a non-negative integer")
        return v

    def num(self, name: builtins.str, *, optional: bool = False, default: float = 0.0) -> Any:
        v = self.obj.get(name, None if optional else default)
        if v is None and optional:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.fail(name, "must be a finite number")
        return float(v)

    def hex(self, name: builtins.str) -> builtins.int:
        v = self.str(name)
        try:
            n = int(v, 16)
        except ValueError:
            raise self.fail(name, "must be a hex number") from None
        if n < 0:
            raise self.fail(name, "must be non-negative")
        return n


def decode_node(raw: bytes | str) -> NodeRecord:
    f = _Fields(raw, "node")
    proto = f.obj.get("protocol", [1, 1])
    if (not isinstance(proto, list) or len(proto) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in proto) or proto[0] > proto[1]):
        raise f.fail("protocol", "must be [min, max] integers")
    labels = f.obj.get("labels") or {}
    if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise f.fail("labels", "must be an object of strings")
    endpoint = f.str("endpoint")
    if not valid_endpoint(endpoint):
        raise f.fail("endpoint", f"must be tcp://HOST:PORT, not {endpoint[:80]!r}")
    return NodeRecord(
        node_id=f.str("node_id"), incarnation=f.hex("incarnation"), endpoint=endpoint,
        role=f.str("role", choices=ROLES) if "role" in f.obj else "any",
        pool_bytes=f.int("pool_bytes", 0), block_size=f.int("block_size", 0),
        protocol=(proto[0], proto[1]), curve_public=f.str("curve_public", optional=True),
        labels=dict(labels), started_at=f.num("started_at"),
        device=f.str("device") if "device" in f.obj else "cpu", cache_bytes=f.int("cache_bytes", 0),
        cert=f.str("cert", optional=True), sig=f.str("sig", optional=True), payload=f.payload(),
    )


def decode_holder(raw: bytes | str) -> HolderRecord:
    f = _Fields(raw, "holder")
    return HolderRecord(
        rid=f.str("rid"), node_id=f.str("node_id"), incarnation=f.hex("incarnation"),
        gen=f.int("gen"), nbytes=f.int("nbytes"),
        state=f.str("state", choices=HOLDER_STATES) if "state" in f.obj else "complete",
        expires_at=f.num("expires_at", optional=True), sig=f.str("sig", optional=True), payload=f.payload(),
    )



# --- what a reader believes (both backends) ----------------------------------------------------------

Skip = Callable[[str, str, str], None]  # (kind, reason, detail): a record not believed, counted and logged


def vet_node(read: Callable[[], bytes | str], where: str, stored_under: Callable[[str], bool],
             skip: Skip) -> NodeRecord | None:
    """The node record stored at `where`, or None (skipped) when it does not decode or names a node
    whose key is not the one it was found under (`stored_under(node_id)`). `read()` gives its bytes
    (a ValueError: undecodable, as a bad base64 value). The backend checks what only it can see
    first (size, lease)."""
    try:
        rec = decode_node(read())
    except (RecordError, ValueError) as e:
        skip("node", "undecodable", f"{where}: {e}")
        return None
    if not stored_under(rec.node_id):
        skip("node", "key_mismatch", f"{where} holds node {rec.node_id!r}")
        return None
    return rec


def vet_holder(read: Callable[[], bytes | str], where: str, rid: str, stored_under: Callable[[str], bool],
               now: float, skip: Skip) -> HolderRecord | None:
    """A holder record of `rid` stored at `where`, or None: skipped when it does not decode or its
    node's key is not the one it was found under; ignored (not counted) when it is another request's
    (long ids share a hashed key) or has expired."""
    try:
        rec = decode_holder(read())
    except (RecordError, ValueError) as e:
        skip("holder", "undecodable", f"{where}: {e}")
        return None
    if rec.rid != rid or rec.expired(now):  # rid_key hashes long ids: check the full id
        return None
    if not stored_under(rec.node_id):
        skip("holder", "key_mismatch", f"{where} holds node {rec.node_id!r}")
        return None
    return rec

# a peer endpoint as a registry may name one: TCP only (never ipc://, which would skip the uid check
# and reach local files), a host name or an IP literal, and a port
_ENDPOINT_RE = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}[A-Za-z0-9])?):([0-9]{1,5})$")


def valid_endpoint(endpoint: str) -> bool:
    match = _ENDPOINT_RE.match(endpoint)
    return match is not None and 0 < int(match.group(2)) < 65536


# ---- keys (design §3.3) ----

def check_cluster(cluster: str) -> str:
    if not isinstance(cluster, str) or not _CLUSTER_RE.match(cluster):
        raise ValueError(f"cluster name {cluster!r}: use 1-64 letters, digits, '.', '_' or '-'")
    return cluster


def key_part(s: str) -> str:
    """Percent-encode a name for one key segment: '/', ':', '%' and '~' never appear raw.
    (urllib's quote always keeps '~', which the hashed form of rid_key needs for itself.)"""
    return "".join(chr(b) if b in _KEY_SAFE else f"%{b:02X}" for b in s.encode("utf-8", "surrogatepass"))


def rid_key(rid: str) -> str:
    """The key segment for a request id: percent-encoded when short and printable ASCII, else
    '~' + blake2b-128 hex. Percent-encoding escapes '~', so the two forms never collide; the
    full id is in the value and readers check it (hash collisions then cost a miss, never a wrong hit)."""
    raw = rid.encode("utf-8", "surrogatepass")
    if len(raw) <= MAX_PLAIN_RID and all(0x20 <= b < 0x7F for b in raw):
        return key_part(rid)
    return "~" + hashlib.blake2b(raw, digest_size=16).hexdigest()


@dataclass(frozen=True)
class EtcdKeys:
    """/kvd/<cluster>/nodes/<node_id> and /kvd/<cluster>/req/<rid_key>/<node_id>."""

    cluster: str

    @property
    def prefix(self) -> str:
        return f"/kvd/{check_cluster(self.cluster)}/"

    @property
    def nodes(self) -> str:
        return self.prefix + "nodes/"

    def node(self, node_id: str) -> str:
        return self.nodes + key_part(node_id)

    def holders(self, rid: str) -> str:
        return f"{self.prefix}req/{rid_key(rid)}/"

    def holder(self, rid: str, node_id: str) -> str:
        return self.holders(rid) + key_part(node_id)


@dataclass(frozen=True)
class RedisKeys:
    """kvd:<c>:node:<id> (string, PX TTL), kvd:<c>:nodes (ZSET id -> expiry ms),
    kvd:<c>:nodes:version (a counter every change to the listing bumps, so watchers poll it, not the
    listing), kvd:<c>:req:<rid_key> (HASH node_id -> holder record)."""

    cluster: str

    @property
    def prefix(self) -> str:
        return f"kvd:{check_cluster(self.cluster)}:"

    @property
    def nodes(self) -> str:
        return self.prefix + "nodes"

    @property
    def nodes_version(self) -> str:
        return self.prefix + "nodes:version"

    def node(self, node_id: str) -> str:
        return f"{self.prefix}node:{key_part(node_id)}"

    def holders(self, rid: str) -> str:
        return f"{self.prefix}req:{rid_key(rid)}"
