"""Peer transfer bookkeeping, without sockets: which chunks to send next, which arrived.

`SendWindow` is the sender's view (chunks in flight, at most `window` unacknowledged);
`ReceiveLedger` is the receiver's (each chunk exactly once, at a position and size the
offer allows). The daemon drives them with messages and carries out what they say.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ProtocolError
from .layout import chunk_ranges


@dataclass
class SendWindow:
    total_bytes: int
    chunk_size: int
    window: int
    chunks: list[tuple[int, int]] = field(init=False)
    next_seq: int = 0
    in_flight: set[int] = field(default_factory=set)
    acked: int = 0

    def __post_init__(self) -> None:
        self.chunks = chunk_ranges(self.total_bytes, self.chunk_size)

    def ready_to_send(self) -> list[int]:
        """Sequence numbers to send now; marks them in flight."""
        seqs = []
        while self.next_seq < len(self.chunks) and len(self.in_flight) < self.window:
            self.in_flight.add(self.next_seq)
            seqs.append(self.next_seq)
            self.next_seq += 1
        return seqs

    def ack(self, seq: int) -> None:
        if seq not in self.in_flight:
            raise ProtocolError(f"ack for chunk {seq}, which is not in flight")
        self.in_flight.discard(seq)
        self.acked += 1

    @property
    def all_acked(self) -> bool:
        return self.acked == len(self.chunks)


@dataclass
class ReceiveLedger:
    total_bytes: int
    chunk_size: int
    received: set[int] = field(default_factory=set)

    @property
    def chunk_count(self) -> int:
        return len(chunk_ranges(self.total_bytes, self.chunk_size)) if self.total_bytes else 0

    def check(self, seq: int, offset: int, length: int) -> None:
        """Raise ProtocolError unless chunk seq is new and exactly where the offer put it."""
        if not 0 <= seq < self.chunk_count:
            raise ProtocolError(f"chunk {seq} out of range (0..{self.chunk_count - 1})")
        if seq in self.received:
            raise ProtocolError(f"chunk {seq} arrived twice")
        expected_offset = seq * self.chunk_size
        expected_length = min(self.chunk_size, self.total_bytes - expected_offset)
        if offset != expected_offset or length != expected_length:
            raise ProtocolError(
                f"chunk {seq} covers [{offset}, +{length}), expected [{expected_offset}, +{expected_length})"
            )

    def mark(self, seq: int) -> None:
        self.received.add(seq)

    @property
    def complete(self) -> bool:
        return len(self.received) == self.chunk_count
