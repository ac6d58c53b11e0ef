"""The publish outbox of the holder directory (daemon process): what the registry should hold of
this node's entries, and what is still to be written.

Runs in the daemon, under member.py; no I/O and no asyncio, so it is tested without sockets.
The outbox decouples the store from the registry: the store's entry events call `publish` /
`unpublish`, which never block and never fail; one writer task drains `take()` in batches and reports
`done` / `failed`. The registry being slow or away therefore never slows a put or a get.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from .backends.backend import Publish, PublishOp, Unpublish
from .records import HolderRecord

OUTBOX_LIMIT = 100_000  # pending rids; past this the outbox gives up on deltas and asks for a resync
BATCH_OPS = 128  # etcd's --max-txn-ops default


class Outbox:
    """A coalescing queue of directory changes, keyed by rid: the last state wins.

    `_published` is what the registry is believed to hold (acknowledged writes); `_desired` the
    changes not yet written, oldest first. A publish and an unpublish of one rid that are both still
    pending cancel out. At most one op per rid is in flight, so acknowledgements cannot reorder.
    """

    def __init__(self, limit: int = OUTBOX_LIMIT) -> None:
        self.limit = limit
        self._desired: dict[str, HolderRecord | None] = {}
        self._published: dict[str, HolderRecord] = {}
        self._inflight: dict[str, PublishOp] = {}
        self.resync_needed = False
        self.overflows = 0

    def __len__(self) -> int:
        return len(self._desired)

    @property
    def published(self) -> Mapping[str, HolderRecord]:
        return self._published

    @property
    def idle(self) -> bool:
        return not self._desired and not self._inflight

    def publish(self, record: HolderRecord) -> None:
        self._set(record.rid, record)

    def unpublish(self, rid: str, gen: int | None = None) -> None:
        """Withdraw rid; with `gen`, only if the newest known record of rid has that gen (an entry's
        late release never withdraws the rid's newer entry)."""
        if gen is not None:
            current = self._current(rid)
            if current is None or current.gen != gen:
                return
        self._set(rid, None)

    def _current(self, rid: str) -> HolderRecord | None:
        if rid in self._desired:
            return self._desired[rid]
        op = self._inflight.get(rid)
        if op is not None:
            return op.record if isinstance(op, Publish) else None
        return self._published.get(rid)

    def _set(self, rid: str, value: HolderRecord | None) -> None:
        if self.resync_needed:
            return  # the coming resync reads the store's snapshot; deltas until then are moot
        self._desired[rid] = value
        if len(self._desired) > self.limit:
            self._desired.clear()
            self.resync_needed = True
            self.overflows += 1

    def take(self, max_ops: int = BATCH_OPS) -> list[PublishOp]:
        """The next batch: one op per rid, none for a rid whose previous op is still in flight."""
        ops: list[PublishOp] = []
        for rid in list(self._desired):
            if len(ops) >= max_ops:
                break
            if rid in self._inflight:
                continue
            want = self._desired.pop(rid)
            have = self._published.get(rid)
            if want is not None and want != have:
                op: PublishOp = Publish(want)
            elif want is None and have is not None:
                op = Unpublish(have)
            else:
                continue  # cancelled out, or already written
            self._inflight[rid] = op
            ops.append(op)
        return ops

    def done(self, ops: Iterable[PublishOp]) -> None:
        for op in ops:
            rid = op.record.rid
            self._inflight.pop(rid, None)
            if isinstance(op, Publish):
                self._published[rid] = op.record
            elif self._published.get(rid) == op.record:
                del self._published[rid]

    def failed(self, ops: Iterable[PublishOp]) -> None:
        """Put the ops back, unless a newer change of the same rid is already queued."""
        for op in ops:
            rid = op.record.rid
            self._inflight.pop(rid, None)
            if rid not in self._desired and not self.resync_needed:
                self._desired[rid] = op.record if isinstance(op, Publish) else None

    def resync(self, snapshot: Iterable[HolderRecord]) -> None:
        """Start over from the store's snapshot of publishable entries (after session loss, a wiped
        server, or an overflow): publish all of it; withdraw, conditionally, whatever we once
        published that the snapshot no longer has (on Redis it may survive a lost session).
        Call only while nothing is in flight (the writer task calls it between batches)."""
        snap = {r.rid: r for r in snapshot}
        stale = {rid: rec for rid, rec in self._published.items() if rid not in snap}
        self._published = stale
        self._desired = {rid: None for rid in stale}
        self._desired.update(snap)
        self._inflight.clear()
        self.resync_needed = False
