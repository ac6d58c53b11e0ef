"""Byte ranges a one-sided plane moves (daemon process), pure: a peer's ranges checked before we
use them, cut to a slice, and paired with ours piece by piece (a plane's descriptor lists pair up
range by range, equal lengths, while each side's blocks are split where its own pool split them)."""
from __future__ import annotations

from kvd.errors import ProtocolError

Ranges = list[tuple[int, int]]
MAX_RANGES = 1 << 16  # ranges one message may name (an entry of 64 Ki single-block extents at most)


def checked_ranges(value: object, total: int, what: str) -> Ranges:
    """A peer's ranges ([[offset, length], ...]): ints, non-empty, covering `total` bytes exactly."""
    if not isinstance(value, list) or len(value) > MAX_RANGES:
        raise ProtocolError(f"{what}: ranges must be a list of at most {MAX_RANGES}")
    ranges: Ranges = []
    for item in value:
        if (not isinstance(item, list) or len(item) != 2 or type(item[0]) is not int or type(item[1]) is not int
                or item[0] < 0 or item[1] <= 0):
            raise ProtocolError(f"{what}: a range is [offset >= 0, length > 0], got {str(item)[:60]}")
        ranges.append((item[0], item[1]))
    if sum(n for _, n in ranges) != total:
        raise ProtocolError(f"{what}: its ranges hold {sum(n for _, n in ranges)} bytes, the entry {total}")
    return ranges


def checked_slices(value: object, expected: Ranges) -> list[tuple[int, int, int]]:
    """A holder's slices ([[offset, length, digest], ...]): exactly the cut we make of the entry."""
    if not isinstance(value, list) or len(value) != len(expected):
        raise ProtocolError(f"an offer names {len(value) if isinstance(value, list) else 'no'} slices, "
                            f"the entry cuts into {len(expected)}")
    slices = []
    for item, (offset, length) in zip(value, expected, strict=True):
        if (not isinstance(item, list) or len(item) != 3 or item[0] != offset or item[1] != length
                or type(item[2]) is not int):
            raise ProtocolError(f"slice {str(item)[:60]} is not [{offset}, {length}, digest]")
        slices.append((offset, length, item[2]))
    return slices


def cut(ranges: Ranges, offset: int, length: int) -> Ranges:
    """The pieces of `ranges` (an entry's bytes, in order) that hold its bytes [offset, +length)."""
    pieces: Ranges = []
    start, end = 0, offset + length
    for base, size in ranges:
        lo, hi = max(offset, start), min(end, start + size)
        if lo < hi:
            pieces.append((base + lo - start, hi - lo))
        start += size
        if start >= end:
            break
    if sum(n for _, n in pieces) != length:
        raise ProtocolError(f"[{offset}, +{length}) lies outside the granted ranges")
    return pieces


def paired(ours: Ranges, theirs: Ranges) -> tuple[Ranges, Ranges]:
    """Both lists split at every boundary of either, so that piece i of one is as long as piece i of
    the other (the same bytes of the slice)."""
    local: Ranges = []
    remote: Ranges = []
    i = j = 0
    used_i = used_j = 0
    while i < len(ours) and j < len(theirs):
        take = min(ours[i][1] - used_i, theirs[j][1] - used_j)
        local.append((ours[i][0] + used_i, take))
        remote.append((theirs[j][0] + used_j, take))
        used_i += take
        used_j += take
        if used_i == ours[i][1]:
            i, used_i = i + 1, 0
        if used_j == theirs[j][1]:
            j, used_j = j + 1, 0
    if i != len(ours) or j != len(theirs):
        raise ProtocolError("the two sides' ranges of a slice differ in length")
    return local, remote
