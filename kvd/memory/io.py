"""Moving chunk bytes between the pool and the network (daemon process), whatever memory the pool is in.

The peer transfers (`kvd.daemon.peer.transfers`) ask for a chunk's bytes as host buffers to
send (`outbound`) and hand over received frames to store and checksum (`inbound`). For a host
pool both are direct: zero-copy views out of the pool, one memcpy in. A GPU pool goes through
pinned host bounce buffers (`kvd.memory.cuda`).
"""
from __future__ import annotations

import typing

from kvd.wire.checksum import digest, hasher

Segments = list[tuple[int, int]]
# received bytes are copied into the pool this much at a time and hashed right after, while the
# piece is still in the CPU's cache: one pass over memory instead of two (the L2 here is 1 MiB)
STORE_PIECE = 256 << 10


class PoolIO(typing.Protocol):
    def outbound(self, segments: Segments) -> tuple[list, object]:
        """Host buffers holding these pool bytes, in order, and a hold to pass to `sent`."""
        ...

    def sent(self, hold: object, tracker_future) -> None:
        """The buffers of `hold` are with ZeroMQ until tracker_future's tracker is done."""
        ...

    def inbound(self, segments: Segments, frames: list, checksum: str) -> int:
        """Store received frames (in order) into these pool bytes; done when it returns. Returns
        the `checksum` of the bytes received, for the caller to compare with the sender's."""
        ...

    def digest(self, segments: Segments, checksum: str) -> int:
        """The `checksum` of these pool bytes as they are (what a one-sided plane wrote or will read)."""
        ...


class HostPoolIO:
    def __init__(self, pool: memoryview) -> None:
        self.pool = pool

    def outbound(self, segments: Segments) -> tuple[list, object]:
        return [self.pool[off:off + n] for off, n in segments], None  # zero-copy: sent from the pool

    def sent(self, hold: object, tracker_future) -> None:
        pass  # the blocks themselves stay leased until the transfer's trackers are done

    def inbound(self, segments: Segments, frames: list, checksum: str) -> int:
        return scatter(self.pool, segments, frames, checksum)

    def digest(self, segments: Segments, checksum: str) -> int:
        return digest(checksum, (self.pool[off:off + n] for off, n in segments))


def scatter(pool: memoryview, segments: Segments, frames: list, checksum: str = "none") -> int:
    """Copy the payload frames, in order, into the pool segments, and return the `checksum` of
    what was stored: each piece is hashed from the pool right after it is copied there."""
    running = hasher(checksum)
    piece = STORE_PIECE if checksum != "none" else 1 << 62
    seg_index, seg_used = 0, 0
    for frame in frames:
        data = memoryview(frame)
        pos = 0
        while pos < len(data):
            off, n = segments[seg_index]
            take = min(n - seg_used, len(data) - pos, piece)
            stored = pool[off + seg_used:off + seg_used + take]
            stored[:] = data[pos:pos + take]
            running.update(stored)
            pos += take
            seg_used += take
            if seg_used == n:
                seg_index, seg_used = seg_index + 1, 0
    return running.intdigest()
