"""Where an entry's bytes live (both processes): tensor offsets in an entry, entry offsets in the pool.

Pure functions, no I/O. An entry is a logical byte range holding its tensors back to back,
each starting on an ALIGNMENT boundary. That range is backed by pool blocks given as
extents (first_block, block_count); `physical_segments` turns a logical range into
(pool_offset, length) pieces. Client and daemon both use these, so they always agree.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvd.errors import BadRequest

from .dtypes import itemsize

# 256 B keeps every tensor aligned for vector loads and for GPU copies alike
ALIGNMENT = 256
MAX_TENSORS = 4096
MAX_NAME_LEN = 256
MAX_DIMS = 8

Extent = tuple[int, int]  # (first block index, number of blocks)
Segment = tuple[int, int]  # (pool byte offset, length)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One named tensor of an entry: what the bytes mean."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    def to_wire(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape)]

    @classmethod
    def from_wire(cls, raw: object) -> TensorSpec:
        if not (isinstance(raw, (list, tuple)) and len(raw) == 3):
            raise BadRequest(f"tensor spec must be [name, dtype, shape], got {raw!r:.80}")
        name, dtype, shape = raw
        if not isinstance(name, str) or not (0 < len(name) <= MAX_NAME_LEN):
            raise BadRequest(f"tensor name must be a non-empty string of at most {MAX_NAME_LEN} chars")
        if not isinstance(dtype, str):
            raise BadRequest("tensor dtype must be a string")
        itemsize(dtype)  # validates the name
        if not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS:
            raise BadRequest(f"tensor shape must be a list of at most {MAX_DIMS} dims")
        if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape):
            raise BadRequest(f"tensor {name!r}: shape dims must be non-negative ints, got {shape!r}")
        return cls(name, dtype, tuple(shape))


def validate_specs(specs: list[TensorSpec]) -> None:
    if len(specs) > MAX_TENSORS:
        raise BadRequest(f"too many tensors: {len(specs)} in one request, at most {MAX_TENSORS}; split it into "
                         "several requests (docs/client.md, Limits)")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise BadRequest("tensor names within one request must be unique")


def tensor_offsets(specs: list[TensorSpec]) -> tuple[list[int], int]:
    """Logical offset of each tensor and the entry's total logical size."""
    offsets: list[int] = []
    cursor = 0
    for spec in specs:
        cursor = -(-cursor // ALIGNMENT) * ALIGNMENT
        offsets.append(cursor)
        cursor += spec.nbytes
    return offsets, cursor


def blocks_needed(total_bytes: int, block_size: int) -> int:
    return -(-total_bytes // block_size)


def split_extents(extents: list[Extent], blocks: int) -> tuple[list[Extent], list[Extent]]:
    """The first `blocks` blocks of extents (in order), and the rest."""
    head: list[Extent] = []
    tail: list[Extent] = []
    for first, count in extents:
        take = max(0, min(count, blocks))
        if take:
            head.append((first, take))
        if count > take:
            tail.append((first + take, count - take))
        blocks -= take
    return head, tail


def physical_segments(extents: list[Extent], block_size: int, offset: int, length: int) -> list[Segment]:
    """Map logical [offset, offset+length) onto pool byte ranges, merging adjacent pieces."""
    segments: list[Segment] = []
    if length <= 0:
        return segments
    logical_start = 0
    end = offset + length
    for first_block, count in extents:
        extent_bytes = count * block_size
        logical_end = logical_start + extent_bytes
        if logical_end > offset and logical_start < end:
            lo = max(offset, logical_start)
            hi = min(end, logical_end)
            pool_off = first_block * block_size + (lo - logical_start)
            if segments and segments[-1][0] + segments[-1][1] == pool_off:
                segments[-1] = (segments[-1][0], segments[-1][1] + hi - lo)
            else:
                segments.append((pool_off, hi - lo))
        if logical_end >= end:
            break
        logical_start = logical_end
    covered = sum(n for _, n in segments)
    if covered != length:
        capacity = sum(count for _, count in extents) * block_size
        raise BadRequest(f"range [{offset}, {end}) lies outside the entry's {capacity} bytes")
    return segments


def chunk_ranges(total_bytes: int, chunk_size: int) -> list[tuple[int, int]]:
    """Split an entry into (offset, length) chunks for the network."""
    return [(off, min(chunk_size, total_bytes - off)) for off in range(0, total_bytes, chunk_size)]
