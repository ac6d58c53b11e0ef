"""One entry's record (daemon process): its state, its leases, and which of its bytes have arrived.

Pure bookkeeping, owned by the Store (entries.py), which decides when an entry changes state.
"""
from __future__ import annotations

import bisect
import enum
import time
from dataclasses import dataclass, field
from typing import Any

from kvd.errors import BadRequest
from kvd.wire.layout import Extent, TensorSpec, physical_segments

from .intervals import Intervals


class State(enum.Enum):
    WRITING = "writing"  # a local client is copying its tensors in
    RECEIVING = "receiving"  # chunks are arriving from a peer
    READY = "ready"  # complete and visible to get
    CLAIMED = "claimed"  # taken by one consuming reader or outbound transfer; invisible


@dataclass(slots=True)
class Lease:
    token: int
    request_id: str
    consume: bool  # removing the entry when its claim ends successfully
    deadline: float | None  # monotonic; None: the holder (a transfer) manages its own time
    started: float = field(default_factory=time.monotonic)
    # False once the claim ended (ran out, or the transfer finished): the lease no longer hides
    # or consumes the entry, but pins its blocks until released
    claiming: bool = True


@dataclass(slots=True, eq=False)
class Entry:
    request_id: str
    token: int
    specs: list[TensorSpec]
    offsets: list[int]
    total_bytes: int
    extents: list[Extent]
    meta: dict[str, Any] | None
    state: State
    expires_at: float | None  # monotonic ttl deadline
    write_deadline: float | None = None  # WRITING/RECEIVING must finish by then
    leases: dict[int, Lease] = field(default_factory=dict)
    writer: bool = False  # a local client may still be copying into the blocks (WRITING, not committed)
    meta_bytes: int = 0  # what meta takes encoded (counted against the store's meta budget)
    removed: bool = False
    created: float = field(default_factory=time.time)
    remaining: list[int] = field(default_factory=list)  # per tensor: bytes (of its range) still missing
    written: Intervals = field(default_factory=Intervals)  # bytes a local producer announced as written

    def __post_init__(self) -> None:
        if not self.remaining:
            self.remaining = [hi - lo for lo, hi in self.tensor_ranges()]

    def tensor_ranges(self) -> list[tuple[int, int]]:
        """The logical bytes each tensor owns: its data and the alignment padding after it.

        These ranges partition [0, total_bytes), so sending every tensor's range sends the entry."""
        starts = self.offsets
        ends = [*starts[1:], self.total_bytes]
        return list(zip(starts, ends, strict=True))

    def complete_tensors(self) -> list[int]:
        return [i for i, left in enumerate(self.remaining) if left == 0]

    def mark_range(self, offset: int, length: int) -> list[int]:
        """Bytes [offset, offset+length) arrived (each byte once); returns tensors that just completed."""
        done = []
        end = offset + length
        first = max(0, bisect.bisect_right(self.offsets, offset) - 1)
        for index, (lo, hi) in enumerate(self.tensor_ranges()[first:], start=first):
            if lo >= end:
                break
            overlap = min(hi, end) - max(lo, offset)
            if overlap > 0:
                self.remaining[index] -= overlap
                if self.remaining[index] == 0:
                    done.append(index)
        return done

    def mark_tensors(self, indices: list[int]) -> list[tuple[int, int]]:
        """A local producer wrote these tensors; returns their (merged) byte ranges."""
        ranges = self.tensor_ranges()
        if not isinstance(indices, list) or not all(type(i) is int and 0 <= i < len(ranges) for i in indices):
            raise BadRequest(f"tensor indices for {self.request_id!r} must be ints in 0..{len(ranges) - 1} "
                             "(no tensor with that number)")
        picked: list[tuple[int, int]] = []  # merged [lo, hi) byte ranges
        for index in sorted(set(indices)):
            lo, hi = ranges[index]
            if hi > lo and self.written.overlaps(lo, hi):
                raise BadRequest(f"tensor {self.specs[index].name!r} of {self.request_id!r} was already written")
            self.written.add(lo, hi)
            self.remaining[index] = 0
            if picked and picked[-1][1] == lo:
                picked[-1] = (picked[-1][0], hi)
            elif hi > lo:
                picked.append((lo, hi))
        return [(lo, hi - lo) for lo, hi in picked]

    def mark_rest(self) -> tuple[list[tuple[int, int]], list[int]]:
        """The producer is done: every byte not yet announced is written; returns those ranges
        and the tensors they completed."""
        rest = self.written.gaps(0, self.total_bytes)
        done = []
        for lo, hi in rest:
            self.written.add(lo, hi)
            done += self.mark_range(lo, hi - lo)
        return [(lo, hi - lo) for lo, hi in rest], done

    def segments(self, block_size: int) -> list[list[tuple[int, int]]]:
        return [
            physical_segments(self.extents, block_size, offset, spec.nbytes)
            for spec, offset in zip(self.specs, self.offsets, strict=True)
        ]

    def describe(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "state": self.state.value,
            "bytes": self.total_bytes,
            "tensors": len(self.specs),
            "blocks": sum(count for _, count in self.extents),
            "age_s": round(time.time() - self.created, 3),
            "ttl_s": None if self.expires_at is None else round(self.expires_at - time.monotonic(), 3),
        }
