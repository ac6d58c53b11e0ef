"""Per-chunk checksums. xxh3_64 by default (measured 38.6 GB/s vs 2.6 GB/s for zlib.crc32 on 4 MiB here, see
bench/RESULTS.md); crc32 from the standard library as a dependency-free fallback."""
from __future__ import annotations

import typing
import zlib

import xxhash

from .errors import BadRequest

Buffer = typing.Union[bytes, bytearray, memoryview]
ALGORITHMS = ("xxh3_64", "crc32", "none")


def digest(algorithm: str, pieces: typing.Iterable[Buffer]) -> int:
    """Checksum of the concatenation of pieces, without concatenating them."""
    if algorithm == "xxh3_64":
        hasher = xxhash.xxh3_64()
        for piece in pieces:
            hasher.update(piece)
        return hasher.intdigest()
    if algorithm == "crc32":
        value = 0
        for piece in pieces:
            value = zlib.crc32(piece, value)
        return value
    if algorithm == "none":
        return 0
    raise BadRequest(f"unknown checksum algorithm {algorithm!r}; choose one of {ALGORITHMS}")
