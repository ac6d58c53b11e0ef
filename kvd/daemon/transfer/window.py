"""Peer transfer bookkeeping (daemon process), without sockets: which chunks to send next, which
bytes arrived.

`SendWindow` is the sender's view: byte ranges queued for sending (all of an entry at once,
or layer by layer while a stream is being written), cut into chunks, at most `max_in_flight`
unacknowledged. `ReceiveLedger` is the receiver's: each chunk exactly once, inside the
entry, never overlapping another. The daemon drives them with messages and does the I/O.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvd.errors import ProtocolError

from ..store.intervals import Intervals


@dataclass
class SendWindow:
    total_bytes: int
    chunk_size: int
    max_in_flight: int  # chunks sent and not yet acknowledged, at most (the transfer window)
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (offset, length) by seq
    queued_bytes: int = 0
    next_seq: int = 0
    in_flight: set[int] = field(default_factory=set)
    acked: int = 0
    # a range written next to the last chunk not yet sent grows that chunk, up to chunk_size (a one-sided
    # plane's: a stream's layers are small, and each chunk is one plane operation of its own)
    coalesce: bool = False

    @classmethod
    def whole(cls, total_bytes: int, chunk_size: int, max_in_flight: int) -> SendWindow:
        """A window over a complete entry."""
        sender = cls(total_bytes, chunk_size, max_in_flight)
        sender.add_range(0, total_bytes)
        return sender

    def recut(self, chunk_size: int, max_in_flight: int, coalesce: bool = False) -> SendWindow:
        """The same queued bytes cut into chunks of another size (before any was sent)."""
        if self.next_seq:
            raise ProtocolError("a window is cut again only before its first chunk goes")
        again = SendWindow(self.total_bytes, chunk_size, max_in_flight, coalesce=coalesce)
        spans: list[tuple[int, int]] = []
        for offset, length in self.chunks:
            if spans and spans[-1][0] + spans[-1][1] == offset:
                spans[-1] = (spans[-1][0], spans[-1][1] + length)
            else:
                spans.append((offset, length))
        for offset, length in spans:
            again.add_range(offset, length)
        return again

    def add_range(self, offset: int, length: int) -> None:
        """Queue bytes [offset, offset+length) of the entry (a stream adds them as they are written)."""
        if length < 0 or offset < 0 or offset + length > self.total_bytes:
            raise ProtocolError(f"range [{offset}, +{length}) is not inside the {self.total_bytes}-byte entry")
        if self.queued_bytes + length > self.total_bytes:
            raise ProtocolError("more bytes queued than the entry holds")
        if self.coalesce and len(self.chunks) > self.next_seq and length:
            last, size = self.chunks[-1]
            if last + size == offset and size < self.chunk_size:
                grow = min(length, self.chunk_size - size)
                self.chunks[-1] = (last, size + grow)
                self.queued_bytes += grow
                offset, length = offset + grow, length - grow
        for start in range(offset, offset + length, self.chunk_size):
            self.chunks.append((start, min(self.chunk_size, offset + length - start)))
        self.queued_bytes += length

    def ready_to_send(self) -> list[int]:
        """Sequence numbers to send now; marks them in flight."""
        seqs = []
        while self.next_seq < len(self.chunks) and len(self.in_flight) < self.max_in_flight:
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
        return self.queued_bytes == self.total_bytes and self.acked == len(self.chunks)

    @property
    def all_sent(self) -> bool:
        """Every byte of the entry has gone out (the receiver's `done` acknowledges what is in flight)."""
        return self.queued_bytes == self.total_bytes and self.next_seq == len(self.chunks)


@dataclass
class ReceiveLedger:
    total_bytes: int
    max_chunk: int
    _received: Intervals = field(default_factory=Intervals)
    _seqs: set[int] = field(default_factory=set)

    def check(self, seq: int, offset: int, length: int) -> None:
        """Raise ProtocolError unless chunk seq is new, inside the entry, and overlaps nothing received."""
        if seq in self._seqs or seq < 0:
            raise ProtocolError(f"chunk {seq} arrived twice (or has a negative number)")
        if not 0 < length <= self.max_chunk:
            raise ProtocolError(f"chunk {seq} has {length} bytes; allowed 1..{self.max_chunk}")
        if offset < 0 or offset + length > self.total_bytes:
            raise ProtocolError(f"chunk {seq} covers [{offset}, +{length}), outside the {self.total_bytes}-byte entry")
        if self._received.overlaps(offset, offset + length):
            raise ProtocolError(f"chunk {seq} overlaps bytes already received")

    def mark(self, seq: int, offset: int, length: int) -> None:
        self._seqs.add(seq)
        self._received.add(offset, offset + length)

    @property
    def received_bytes(self) -> int:
        return self._received.covered

    @property
    def complete(self) -> bool:
        return self.received_bytes == self.total_bytes
