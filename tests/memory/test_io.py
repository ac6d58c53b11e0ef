"""Received chunks are stored into scattered pool segments and checksummed in the same pass."""
from __future__ import annotations

import random

import pytest

from kvd.memory.io import STORE_PIECE, HostPoolIO, scatter
from kvd.wire.checksum import ALGORITHMS, digest


def _frames(sizes: list[int], seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(n) for n in sizes]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("sizes, segments", [
    ([1000], [(0, 1000)]),
    # frames and segments cut at different places, and pieces longer than STORE_PIECE
    ([STORE_PIECE * 2 + 17, 5, STORE_PIECE - 3], [(3 * STORE_PIECE + 11, STORE_PIECE + 1), (0, 7),
                                                  (STORE_PIECE, STORE_PIECE * 2 + 11)]),
    ([3, 4, 5], [(100, 2), (50, 10)]),
])
def test_scatter_stores_every_byte_in_order_and_returns_the_senders_checksum(algorithm, sizes, segments):
    assert sum(sizes) == sum(n for _, n in segments)
    frames = _frames(sizes, seed=len(sizes))
    pool = bytearray(5 * STORE_PIECE)
    stored = scatter(memoryview(pool), segments, frames, algorithm)
    assert stored == digest(algorithm, frames)
    assert b"".join(bytes(pool[off:off + n]) for off, n in segments) == b"".join(frames)


def test_host_io_checksums_what_it_stored():
    pool = bytearray(4096)
    frames = _frames([3000], seed=1)
    io = HostPoolIO(memoryview(pool))
    assert io.inbound([(1000, 3000)], frames, "xxh3_64") == digest("xxh3_64", frames)
    assert io.inbound([(0, 3000)], frames, "crc32") == digest("crc32", frames)
    assert bytes(pool[:3000]) == frames[0]


def test_a_corrupted_frame_is_stored_but_its_checksum_differs():
    """The exchange compares the returned checksum with the sender's and drops the entry."""
    frames = _frames([STORE_PIECE + 100], seed=2)
    sent = digest("xxh3_64", frames)
    flipped = bytearray(frames[0])
    flipped[STORE_PIECE + 50] ^= 0x10
    pool = bytearray(2 * STORE_PIECE)
    assert scatter(memoryview(pool), [(0, len(flipped))], [bytes(flipped)], "xxh3_64") != sent
