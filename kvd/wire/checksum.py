"""Per-chunk checksums (both processes). xxh3_64 by default (measured 38.6 GB/s vs 2.6 GB/s for
zlib.crc32 on 4 MiB here, see bench/RESULTS.md); crc32 from the standard library as a dependency-free fallback."""
from __future__ import annotations

import typing
import zlib

import xxhash

from kvd.errors import BadRequest

Buffer = bytes | bytearray | memoryview
ALGORITHMS = ("xxh3_64", "crc32", "none")


class _Crc32:
    def __init__(self) -> None:
        self._value = 0

    def update(self, piece: Buffer) -> None:
        self._value = zlib.crc32(piece, self._value)

    def intdigest(self) -> int:
        return self._value


class _NoChecksum:
    def update(self, piece: Buffer) -> None:
        pass

    def intdigest(self) -> int:
        return 0


def hasher(algorithm: str):
    """A running checksum: `update(piece)` for each piece in order, then `intdigest()`."""
    if algorithm == "xxh3_64":
        return xxhash.xxh3_64()
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "none":
        return _NoChecksum()
    raise BadRequest(f"unknown checksum algorithm {algorithm!r}; choose one of {ALGORITHMS}")


def digest(algorithm: str, pieces: typing.Iterable[Buffer]) -> int:
    """Checksum of the concatenation of pieces, without concatenating them."""
    running = hasher(algorithm)
    for piece in pieces:
        running.update(piece)
    return running.intdigest()
