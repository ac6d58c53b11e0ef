"""What bounds a transfer (daemon process): chunk and slice sizes, windows, the digests, the stall
deadline. Plain data, built from the configuration by `transfers.TransferSettings`."""
from __future__ import annotations

from dataclasses import dataclass

# a one-sided plane (PROTOCOL.md 2.2b): entries below PLANE_MIN_BYTES go as chunk frames even on a link
# with a plane (one message each way, where a plane adds a grant's round trip); the rest as slices of
# SLICE_BYTES, one plane operation each, PLANE_IN_FLIGHT at once (bench/RESULTS.md: the cut-over measured)
PLANE_MIN_BYTES = 1 << 20
SLICE_BYTES = 16 << 20
PLANE_IN_FLIGHT = 2


@dataclass(frozen=True)
class Limits:
    chunk_size: int
    window: int
    checksum: str
    transfer_timeout: float
    plane_min_bytes: int = PLANE_MIN_BYTES
    slice_bytes: int = SLICE_BYTES
    plane_in_flight: int = PLANE_IN_FLIGHT
    # the digest of a plane's slices: blake3_64 where they cross a fabric kvd does not encrypt (a
    # --listen beyond loopback), and then required of every plane offer a peer makes us
    plane_checksum: str = "xxh3_64"
