"""Fault injection for tests (daemon process): a PoolIO that corrupts what the wire delivers.

With `KVD_TEST_CORRUPT_EVERY_NTH_CHUNK=N` in a daemon's environment at start, it flips one bit
in every Nth chunk it receives, before the chunk is stored and checked, as a wire that corrupts
bytes would. The variable is read once, when the daemon builds its pool I/O: nothing of this is
on the hot path of a daemon that does not ask for it.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from .io import PoolIO, Segments

ENV = "KVD_TEST_CORRUPT_EVERY_NTH_CHUNK"


class CorruptingPoolIO:
    def __init__(self, inner: PoolIO, every: int) -> None:
        self.inner = inner
        self.every = every
        self.received = 0

    def outbound(self, segments: Segments) -> tuple[list, object]:
        return self.inner.outbound(segments)

    def sent(self, hold: object, tracker_future) -> None:
        self.inner.sent(hold, tracker_future)

    def inbound(self, segments: Segments, frames: list, checksum: str) -> int:
        self.received += 1
        if self.received % self.every == 0 and frames:
            flipped = bytearray(frames[0])
            flipped[len(flipped) // 2] ^= 0x10
            frames = [bytes(flipped), *frames[1:]]
        return self.inner.inbound(segments, frames, checksum)


def with_fault_injection(io: PoolIO, environ: Mapping[str, str] = os.environ) -> PoolIO:
    every = int(environ.get(ENV, "0") or 0)
    return CorruptingPoolIO(io, every) if every > 0 else io
