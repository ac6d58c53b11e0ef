"""The transfer machine's handlers for the receiver's rows (daemon process; pure): an offer taken
(pushed to us, or answering our pull), with or without its accept, its chunks checked and
stored, and the entry published once every byte is in.

As in `sending.py`, each is a row's `does` in `table.py`, called with the machine's books, the
transfer (or in `no transfer`, the channel) and the event; it returns actions and never assigns
a state. `take` and `publish` are what the plane's rows (`onesided.py`) share with these.
"""
from __future__ import annotations

import logging

from kvd.errors import BadRequest, ChecksumMismatch, ProtocolError
from kvd.wire import protocol as p
from kvd.wire.checksum import ALGORITHMS
from kvd.wire.layout import TensorSpec, physical_segments

from ..store.entry import Entry, State
from .channel import Channel
from .states import NONE, Action, Books, Inbound, Kind, OpEnded, Progress, Published, Received, Send
from .window import ReceiveLedger

log = logging.getLogger(__name__)


def take(m: Books, target: Inbound | Channel, msg: p.Offer) -> tuple[Inbound, Entry]:
    """Reserve room for an offer, pushed (target: its channel) or answering our pull."""
    if msg.checksum not in ALGORITHMS:
        raise BadRequest(f"unknown checksum {msg.checksum!r}")
    if not 0 < msg.chunk_size <= p.MAX_CHUNK_BYTES:
        raise BadRequest(f"chunk size {msg.chunk_size} outside 1..{p.MAX_CHUNK_BYTES}")
    if isinstance(target, Inbound) and msg.request_id != target.request_id:
        raise ProtocolError(f"offer for {msg.request_id!r}, but {target.request_id!r} was pulled")
    specs = [TensorSpec.from_wire(t) for t in msg.tensors]
    entry = m.store.reserve(msg.request_id, specs, peer_ttl(msg.ttl, m.store.default_ttl), msg.meta,
                            State.RECEIVING, None)
    if entry.total_bytes != msg.total_bytes:
        m.store.remove(entry)
        raise ProtocolError(f"offer says {msg.total_bytes} bytes, its tensors need {entry.total_bytes}")
    now = m.clock()
    inbound = target if isinstance(target, Inbound) else Inbound(msg.xfer, target, msg.request_id, Kind.PUSHED,
                                                                 NONE, started=now)
    inbound.entry, inbound.checksum = entry, msg.checksum
    inbound.ledger = ReceiveLedger(entry.total_bytes, msg.chunk_size)
    inbound.deadline = now + m.limits.transfer_timeout
    m.transfers[msg.xfer] = inbound
    return inbound, entry


def take_offer(m: Books, target: Inbound | Channel, msg: p.Offer) -> list[Action]:
    """Take an offer without a word back (a small sealed one: its chunks are all on their way
    already; `done` alone will answer)."""
    entry = take(m, target, msg)[1]
    return [Progress(entry, entry.complete_tensors())]  # a stream reader may be waiting for it


def accept_offer(m: Books, target: Inbound | Channel, msg: p.Offer) -> list[Action]:
    return [*take_offer(m, target, msg), Send(m.transfers[msg.xfer].channel, p.Accept(xfer=msg.xfer))]


def take_offer_and_publish(m: Books, target: Inbound | Channel, msg: p.Offer) -> list[Action]:
    """A sealed offer of zero bytes: nothing will follow."""
    inbound, entry = take(m, target, msg)
    return [Progress(entry, entry.complete_tensors()), *publish(m, inbound, msg)]


def take_offer_with_chunk(m: Books, target: Inbound | Channel, msg: p.Offer) -> list[Action]:
    """An offer that carries its only chunk: done (or abort) is the whole answer."""
    return store(m, take(m, target, msg)[0], _inline_chunk(msg))


def take_offer_with_entry(m: Books, target: Inbound | Channel, msg: p.Offer) -> list[Action]:
    return store_and_publish(m, take(m, target, msg)[0], _inline_chunk(msg))


def store(m: Books, inbound: Inbound, msg: p.Chunk) -> list[Action]:
    entry, length, completed = _check_and_mark(m, inbound, msg)
    if completed:
        return [Received(inbound, length), Progress(entry, completed)]
    return [Received(inbound, length)]


def store_and_ack(m: Books, inbound: Inbound, msg: p.Chunk) -> list[Action]:
    entry, length, completed = _check_and_mark(m, inbound, msg)
    ack = Send(inbound.channel, p.ChunkAck(xfer=inbound.xfer, seq=msg.seq))
    if completed:
        return [Received(inbound, length), ack, Progress(entry, completed)]
    return [Received(inbound, length), ack]


def store_and_publish(m: Books, inbound: Inbound, msg: p.Chunk) -> list[Action]:
    # no ack, no progress: its done acknowledges the chunk, and the entry is published
    return [Received(inbound, _check_and_mark(m, inbound, msg)[1]), *publish(m, inbound, msg)]


def _check_and_mark(m: Books, inbound: Inbound, msg: p.Chunk) -> tuple[Entry, int, list[int]]:
    """Store a chunk's bytes and mark them arrived: (the entry, its length, the tensors it completed)."""
    entry, ledger = inbound.receiving()
    length = sum(msg.lengths)
    ledger.check(msg.seq, msg.offset, length)
    # stored first, checked after: these bytes are nobody's yet (each byte arrives once, and
    # none of them is marked as arrived until the check passes; a failure drops the entry)
    segments = physical_segments(entry.extents, m.store.block_size, msg.offset, length)
    if m.io.inbound(segments, msg.payload, inbound.checksum) != msg.digest:
        raise ChecksumMismatch(f"chunk {msg.seq} of {entry.request_id!r} failed its {inbound.checksum} check")
    ledger.mark(msg.seq, msg.offset, length)
    inbound.deadline = m.clock() + m.limits.transfer_timeout
    return entry, length, entry.mark_range(msg.offset, length)


def publish(m: Books, inbound: Inbound, event: p.Seal | p.Chunk | p.Offer | p.Placed | OpEnded) -> list[Action]:
    entry = inbound.receiving()[0]
    m.store.publish(entry)
    log.debug("received %s from %s (%d bytes)", entry.request_id, inbound.channel.peer_name, entry.total_bytes)
    return [Send(inbound.channel, p.Done(xfer=inbound.xfer)), Published(entry)]


def _inline_chunk(msg: p.Offer) -> p.Chunk:
    """The chunk an offer carries (its row's guard saw lengths)."""
    if not (msg.sealed and msg.total_bytes <= msg.chunk_size) or msg.lengths is None:
        raise ProtocolError("an offer may carry its entry only when it is sealed and one chunk long")
    return p.Chunk(xfer=msg.xfer, seq=0, offset=0, lengths=msg.lengths, digest=msg.digest or 0, payload=msg.payload)


def peer_ttl(offered: float | None, limit: float | None) -> float | None:
    """A peer's ttl for an entry it sends us, held to ours: a peer may shorten an entry's life, never
    make it outlive our own default (0, "forever", included); without a default of ours, as offered."""
    if limit is None or offered is None:
        return offered
    return limit if offered == 0 else min(offered, limit)
