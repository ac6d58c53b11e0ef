"""Where a KV tier page lives in a cluster (daemon process; pure): rendezvous (highest-random-weight)
hashing of (namespace, key) over the nodes that advertise a cache budget (`NodeRecord.cache_bytes`).

Every daemon computes the same home from the same node list, with no registry write per page.
When a node joins, only the keys whose new highest weight is its own move to it (about 1/N); when
one leaves, only its keys move, each to its next-highest node. A moved key is a miss at its new
home, never another page's bytes: pages are found by (namespace, key) at the holder itself.
Weights are blake2b-64 of (node id, namespace, key), NUL-separated (neither may contain NUL).
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from .records import NodeRecord


def weight(node_id: str, namespace: str, key: str) -> int:
    digest = hashlib.blake2b(f"{node_id}\0{namespace}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def home(namespace: str, key: str, nodes: Sequence[str]) -> str | None:
    """The node with the highest weight for this page, or None without nodes (ties: the lower id)."""
    best, best_weight = None, -1
    for node in nodes:
        w = weight(node, namespace, key)
        if w > best_weight or (w == best_weight and best is not None and node < best):
            best, best_weight = node, w
    return best


def homes(namespace: str, keys: Iterable[str], nodes: Sequence[str]) -> list[str | None]:
    """home() of each key of a batch (one namespace)."""
    nodes = sorted(set(nodes))
    return [home(namespace, key, nodes) for key in keys]


def cache_nodes(records: Iterable[NodeRecord]) -> list[str]:
    """The nodes that take tier pages: those whose record advertises a cache budget (a record
    from before the field, or of a node with --cache-size 0, takes none)."""
    return sorted({rec.node_id for rec in records if rec.cache_bytes > 0})
