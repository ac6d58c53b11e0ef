"""Which holders of a request to try, best first (daemon and router processes: a get by request id,
`Registry.locate`).

Pure: no I/O. A candidate is a holder record and the node record it names; the ordering drops what
cannot serve (ourselves, lost nodes, a holder whose node restarted, expired or streaming records)
and prefers the nearest and roomiest.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .records import HolderRecord, NodeRecord


@dataclass(frozen=True)
class Candidate:
    holder: HolderRecord
    node: NodeRecord

    @property
    def endpoint(self) -> str:
        return self.node.endpoint


def order_candidates(
    holders: Iterable[HolderRecord], nodes: Mapping[str, NodeRecord], *, self_id: str | None, now: float,
    lost: Iterable[str] = (), labels: Mapping[str, str] | None = None, allow_streaming: bool = False,
    free: Mapping[str, int] | None = None,
) -> list[Candidate]:
    """Which holders to try, best first (design §3.5).

    Dropped: ourselves, nodes our own heartbeat marks lost, holders whose node is not registered or
    is registered with another incarnation (the holder restarted: its entries are gone), expired
    records, and streaming ones unless `allow_streaming` (R3: never offer partial bytes to a get).
    Order: complete before streaming, same zone, same host, most free pool (`free`, else pool size),
    newest record (latest expiry) first.
    """
    mine = labels or {}
    lost = set(lost)
    out: list[Candidate] = []
    for h in holders:
        node = nodes.get(h.node_id)
        if (h.node_id == self_id or h.node_id in lost or node is None or node.incarnation != h.incarnation
                or h.expired(now) or (h.state != "complete" and not allow_streaming)):
            continue
        out.append(Candidate(h, node))

    def rank(c: Candidate) -> tuple[bool, bool, bool, int, float, str]:
        nl = c.node.labels
        same = [bool(mine.get(k)) and nl.get(k) == mine.get(k) for k in ("zone", "host")]
        room = free.get(c.node.node_id, c.node.pool_bytes) if free is not None else c.node.pool_bytes
        return (c.holder.state != "complete", not same[0], not same[1], -room,
                -(c.holder.expires_at if c.holder.expires_at is not None else float("inf")), c.node.node_id)

    out.sort(key=rank)
    return out
