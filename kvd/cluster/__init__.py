"""kvd.cluster: discovery and the request directory on a registry (etcd or Redis), in the daemon
process and in routers' processes.

Runs in the daemon (`ClusterMember`: registration, publishing, lookups) and in routers and proxies
(`Registry`: a read-only view). Imports only the standard library and kvd's leaves (kvd.errors,
kvd.throttle, kvd.trust), never the daemon; the Redis backend imports redis-py when it is opened
(`pip install redis`); the etcd backend needs nothing extra (it speaks etcd's JSON gateway). See proto/REGISTRY.md for the key schema and the semantics.

Modules: records (records, JSON, keys), signing (signed records: who signs, what a reader
believes), outbox (what is still to be written), candidates (which holder to try), health
(breaker, backoff, membership state), backends/ (backend: the interface; inmemory / etcd / redis;
etcd_http and etcd_auth: the gateway's HTTP client and its login; redis_lua: the Redis scripts),
skips (what a backend skips as it reads, counted and logged), url (URLs, credentials, TLS and the
backend factory), member (the daemon side), registry (the router side).
"""
from .backends.backend import (
    Added,
    Backend,
    Conflict,
    NodeEvent,
    Publish,
    Registered,
    RegistryRefused,
    RegistryUnavailable,
    Removed,
    Resync,
    Session,
    SessionLost,
    Unpublish,
)
from .candidates import Candidate, order_candidates
from .health import Breaker, Membership
from .member import ClusterMember
from .outbox import Outbox
from .records import HolderRecord, NodeRecord, RecordError, rid_key
from .registry import Registry
from .url import RegistryURL, open_backend, parse_url

__all__ = [
    "Added",
    "Backend",
    "Breaker",
    "Candidate",
    "ClusterMember",
    "Conflict",
    "HolderRecord",
    "Membership",
    "NodeEvent",
    "NodeRecord",
    "Outbox",
    "Publish",
    "RecordError",
    "Registered",
    "Registry",
    "RegistryRefused",
    "RegistryURL",
    "RegistryUnavailable",
    "Removed",
    "Resync",
    "Session",
    "SessionLost",
    "Unpublish",
    "open_backend",
    "order_candidates",
    "parse_url",
    "rid_key",
]
