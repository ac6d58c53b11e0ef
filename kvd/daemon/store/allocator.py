"""Block allocator for the staging pool (daemon process): pure bookkeeping, no memory, no I/O.

The pool is `num_blocks` fixed-size blocks. Free space is kept as a sorted list of
extents (first_block, count), coalesced on free. An allocation prefers one contiguous
extent (best fit, so one memcpy per tensor) and falls back to several extents, largest
first, so a fragmented pool still serves any request that fits in its free blocks.
Running out raises PoolFull; it is never an assert.
"""
from __future__ import annotations

import bisect
import itertools

from kvd.errors import PoolFull
from kvd.wire.layout import Extent


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the pool needs at least one block")
        self.num_blocks = num_blocks
        self._free: list[Extent] = [(0, num_blocks)]  # sorted by first block
        self.free_blocks = num_blocks

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    def allocate(self, count: int) -> list[Extent]:
        """Reserve `count` blocks; returns extents in the order the entry uses them."""
        if count == 0:
            return []
        if count > self.free_blocks:
            raise PoolFull(
                f"pool full: need {count} blocks, {self.free_blocks} of {self.num_blocks} free"
            )
        best = None
        for index, (_, size) in enumerate(self._free):
            if size >= count and (best is None or size < self._free[best][1]):
                best = index
                if size == count:
                    break
        if best is not None:
            return [self._take(best, count)]
        # fragmented: take whole extents, largest first, until satisfied
        taken: list[Extent] = []
        remaining = count
        while remaining:
            index = max(range(len(self._free)), key=lambda i: self._free[i][1])
            take = min(remaining, self._free[index][1])
            taken.append(self._take(index, take))
            remaining -= take
        return taken

    def _take(self, index: int, count: int) -> Extent:
        start, size = self._free[index]
        if size == count:
            del self._free[index]
        else:
            self._free[index] = (start + count, size - count)
        self.free_blocks -= count
        return (start, count)

    def free(self, extents: list[Extent]) -> None:
        for start, count in extents:
            self._release(start, count)

    def _release(self, start: int, count: int) -> None:
        if count <= 0 or start < 0 or start + count > self.num_blocks:
            raise ValueError(f"extent ({start}, {count}) is outside the pool")
        index = bisect.bisect_left(self._free, (start, 0))
        prev_ok = index == 0 or self._free[index - 1][0] + self._free[index - 1][1] <= start
        next_ok = index == len(self._free) or start + count <= self._free[index][0]
        if not (prev_ok and next_ok):
            raise ValueError(f"double free of extent ({start}, {count})")
        self.free_blocks += count
        if index > 0 and self._free[index - 1][0] + self._free[index - 1][1] == start:
            index -= 1
            start, count = self._free[index][0], self._free[index][1] + count
            del self._free[index]
        if index < len(self._free) and start + count == self._free[index][0]:
            count += self._free[index][1]
            del self._free[index]
        self._free.insert(index, (start, count))

    def largest_free_extent(self) -> int:
        return max((size for _, size in self._free), default=0)

    def check_invariants(self) -> None:
        """For tests: sorted, non-overlapping, non-adjacent extents that add up."""
        total = 0
        for (a, n), (b, _) in itertools.pairwise(self._free):
            assert a + n < b, f"free extents overlap or touch: {(a, n)} {(b, _)}"
        for start, count in self._free:
            assert count > 0 and start >= 0 and start + count <= self.num_blocks
            total += count
        assert total == self.free_blocks, (total, self.free_blocks)
