"""Fault injection for tests (daemon process): a PoolIO that corrupts what the wire delivers.

With `KVD_TEST_CORRUPT_EVERY_NTH_CHUNK=N` in a daemon's environment at start, it flips one bit
in every Nth chunk it receives, before the chunk is stored and checked, as a wire that corrupts
bytes would. With `KVD_TEST_CORRUPT_AFTER_EVERY_NTH_DIGEST=N`, it flips one bit of the pool right
after every Nth digest it takes of pool bytes (a one-sided plane's sender: the slice is hashed, then
changed before the plane writes it, as a fabric that corrupts bytes would). The variables are read
once, when the daemon builds its pool I/O: nothing of this is on the hot path of a daemon that does
not ask for it.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from .io import PoolIO, Segments

ENV = "KVD_TEST_CORRUPT_EVERY_NTH_CHUNK"
ENV_DIGEST = "KVD_TEST_CORRUPT_AFTER_EVERY_NTH_DIGEST"


class CorruptingPoolIO:
    def __init__(self, inner: PoolIO, every: int, every_digest: int = 0) -> None:
        self.inner = inner
        self.every = every
        self.every_digest = every_digest
        self.received = 0
        self.digests = 0

    def digest(self, segments: Segments, checksum: str) -> int:
        value = self.inner.digest(segments, checksum)
        self.digests += 1
        if self.every_digest and self.digests % self.every_digest == 0 and segments:
            offset, length = segments[0]
            pool = self.inner.pool  # type: ignore[attr-defined]  # (faults wrap a host pool's io: its view)
            pool[offset + length // 2] ^= 0x10
        return value

    def outbound(self, segments: Segments) -> tuple[list, object]:
        return self.inner.outbound(segments)

    def sent(self, hold: object, tracker_future) -> None:
        self.inner.sent(hold, tracker_future)

    def inbound(self, segments: Segments, frames: list, checksum: str) -> int:
        self.received += 1
        if self.every and self.received % self.every == 0 and frames:
            flipped = bytearray(frames[0])
            flipped[len(flipped) // 2] ^= 0x10
            frames = [bytes(flipped), *frames[1:]]
        return self.inner.inbound(segments, frames, checksum)


def with_fault_injection(io: PoolIO, environ: Mapping[str, str] = os.environ) -> PoolIO:
    every = int(environ.get(ENV, "0") or 0)
    every_digest = int(environ.get(ENV_DIGEST, "0") or 0)
    return CorruptingPoolIO(io, every, every_digest) if every > 0 or every_digest > 0 else io
