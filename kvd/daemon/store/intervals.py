"""Disjoint half-open intervals of bytes, merged as they are added (daemon process). Pure bookkeeping.

Used wherever "each byte exactly once" must hold: chunks arriving from a peer, and the parts
of a streamed put that its producer announces as written.
"""
from __future__ import annotations

import bisect


class Intervals:
    def __init__(self) -> None:
        self._starts: list[int] = []  # sorted; _ends[i] belongs to _starts[i]; no two touch
        self._ends: list[int] = []
        self.covered = 0  # bytes inside the intervals

    def overlaps(self, lo: int, hi: int) -> bool:
        """Does [lo, hi) share a byte with what was added?"""
        index = bisect.bisect_right(self._starts, lo)
        if index > 0 and self._ends[index - 1] > lo:
            return True
        return index < len(self._starts) and self._starts[index] < hi

    def add(self, lo: int, hi: int) -> None:
        """Add [lo, hi), which must not overlap (check with `overlaps` first)."""
        if hi <= lo:
            return
        self.covered += hi - lo
        index = bisect.bisect_right(self._starts, lo)
        if index > 0 and self._ends[index - 1] == lo:  # merge with the interval before
            index -= 1
            lo = self._starts[index]
            del self._starts[index], self._ends[index]
        if index < len(self._starts) and self._starts[index] == hi:  # and the one after
            hi = self._ends[index]
            del self._starts[index], self._ends[index]
        self._starts.insert(index, lo)
        self._ends.insert(index, hi)

    def spans(self) -> list[tuple[int, int]]:
        """What was added, in order, as (start, end)."""
        return list(zip(self._starts, self._ends, strict=True))

    def gaps(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The parts of [lo, hi) not yet added, in order, as (start, end)."""
        gaps = []
        cursor = lo
        for start, end in zip(self._starts, self._ends, strict=True):
            if end <= cursor:
                continue
            if start >= hi:
                break
            if start > cursor:
                gaps.append((cursor, start))
            cursor = max(cursor, end)
        if cursor < hi:
            gaps.append((cursor, hi))
        return gaps
