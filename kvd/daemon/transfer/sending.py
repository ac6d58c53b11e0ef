"""The transfer machine's handlers for the sender's rows (daemon process; pure): a pull we serve,
an offer and its eager chunks, the window that opens with accept and each chunk_ack, a stream's
bytes as its producer writes them and its seal, and the end with the receiver's done.

Each is a row's `does` in `table.py`: called with the machine's books (`Books`), the transfer (or,
in `no transfer`, the channel the message came on) and the event, it returns the actions to carry
out; it never assigns a state (the machine does, from the row). `pump` sends whatever the window
lets go: chunk frames, or on a one-sided plane its writes (`post_writes`, which `onesided.py` uses).
"""
from __future__ import annotations

import logging

from kvd.errors import BadRequest
from kvd.wire import protocol as p
from kvd.wire.checksum import digest
from kvd.wire.layout import physical_segments

from ..store.entry import Entry
from .channel import Channel
from .ranges import cut, paired
from .states import (
    NONE,
    Action,
    Books,
    Commit,
    EntryReady,
    Kind,
    Outbound,
    PostOp,
    Send,
    SendChunk,
    Tick,
    WaitForEntry,
    Written,
)
from .window import SendWindow

log = logging.getLogger(__name__)

MAX_PULL_WAIT = 3600.0  # seconds a holder waits for a pulled entry to appear (a local get's limit too)
# chunks every sender sends right after the offer, before the receiver accepts (wasted if it
# refuses); a receiver whose whole entry fits in them needs no accept (proto/PROTOCOL.md)
EAGER_CHUNKS = 2


def serve(m: Books, channel: Channel, msg: p.Pull) -> list[Action]:
    """A peer pulls an entry: wait for it (the pull's timeout is its own timer: WaitForEntry)."""
    if not 0 <= msg.timeout <= MAX_PULL_WAIT:  # (NaN fails this too)
        raise BadRequest(f"pull timeout must be between 0 and {MAX_PULL_WAIT:g} seconds")
    now = m.clock()
    out = Outbound(msg.xfer, channel, msg.request_id, Kind.SERVE, NONE, pull=msg, started=now,
                   plane_min=m.limits.plane_min_bytes)
    m.transfers[msg.xfer] = out
    return [WaitForEntry(out, now + msg.timeout)]


def offer_entry(m: Books, out: Outbound, event: EntryReady) -> list[Action]:
    return _serve_entry(m, out, event.entry, sealed=True)


def offer_stream_entry(m: Books, out: Outbound, event: EntryReady) -> list[Action]:
    """The pulled entry is a local stream still being written: what is written goes now, the
    rest as it is written, and the seal at its commit, so that a pulled stream streams too."""
    return _serve_entry(m, out, event.entry, sealed=False)


def _serve_entry(m: Books, out: Outbound, entry: Entry, sealed: bool) -> list[Action]:
    keep = out.pull is not None and out.pull.keep  # (a served pull has its Pull)
    out.lease_token = m.store.lease(entry, consume=not keep, deadline=None, incomplete=not sealed).token
    out.entry = entry
    out.window = window = (SendWindow.whole if sealed else SendWindow)(entry.total_bytes, m.limits.chunk_size,
                                                                       m.limits.window)
    for lo, hi in [] if sealed else entry.written.spans():
        window.add_range(lo, hi - lo)
    return send_offer(m, out, sealed)


def offer(m: Books, out: Outbound, event: object) -> list[Action]:
    return send_offer(m, out, sealed=True)


def offer_stream(m: Books, out: Outbound, event: object) -> list[Action]:
    return send_offer(m, out, sealed=False)


def offer_message(m: Books, out: Outbound, sealed: bool) -> p.Offer:
    entry = out.sending()[0]
    now = m.clock()
    out.deadline = now + m.limits.transfer_timeout
    return p.Offer(
        xfer=out.xfer, request_id=entry.request_id, tensors=[s.to_wire() for s in entry.specs],
        total_bytes=entry.total_bytes, chunk_size=m.limits.chunk_size, checksum=m.limits.checksum,
        # what is left of the ttl (never 0, which would mean "keep forever" to the receiver)
        ttl=None if entry.expires_at is None else max(0.001, entry.expires_at - now),
        meta=entry.meta, sealed=sealed,
    )


def send_offer(m: Books, out: Outbound, sealed: bool) -> list[Action]:
    entry, window = out.sending()
    # chunks follow the offer without waiting for accept (one round trip less per transfer),
    # but only EAGER_CHUNKS of them until the receiver has said it has room; a sealed offer that
    # small is answered without accept or acks, so all of it goes (a stream committed before its
    # link was up may be cut into more, smaller chunks: one per tensor written)
    small = sealed and entry.total_bytes <= EAGER_CHUNKS * m.limits.chunk_size
    window.max_in_flight = max(EAGER_CHUNKS, len(window.chunks)) if small else EAGER_CHUNKS
    msg = offer_message(m, out, sealed)
    chunks = pump(m, out)
    if sealed and len(window.chunks) == 1 and chunks and p.INLINE_OFFER in out.channel.features:
        # the whole entry is one chunk, and the peer takes it inside the offer: one message
        # each way (offer, done) instead of two messages, two decodes and two sends
        first = chunks[0]
        assert isinstance(first, SendChunk)  # (a chunk frame's: no plane here)
        chunk = first.msg
        msg.lengths, msg.digest, msg.payload = chunk.lengths, chunk.digest, chunk.payload
        return [SendChunk(out, msg, first.hold)]
    return [Send(out.channel, msg), *chunks]


def queue(m: Books, out: Outbound, event: Written) -> list[Action]:
    window = out.sending()[1]
    for offset, length in event.ranges:
        window.add_range(offset, length)
    return []


def queue_and_send(m: Books, out: Outbound, event: Written) -> list[Action]:
    return queue(m, out, event) + pump(m, out)


def seal(m: Books, out: Outbound, event: Commit) -> list[Action]:
    return [Send(out.channel, p.Seal(xfer=out.xfer))]


def open_window(m: Books, out: Outbound, msg: p.Accept) -> list[Action]:
    out.sending()[1].max_in_flight = m.limits.window
    out.deadline = m.clock() + m.limits.transfer_timeout
    return pump(m, out)


def ack_and_send(m: Books, out: Outbound, msg: p.ChunkAck) -> list[Action]:
    out.sending()[1].ack(msg.seq)
    out.deadline = m.clock() + m.limits.transfer_timeout
    return pump(m, out)


def finish_sending(m: Books, out: Outbound, msg: p.Done) -> list[Action]:
    # the claim ends now (a push's entry is gone); the blocks stay until ZeroMQ lets go
    m.store.end_claim(out.lease_token, success=True)
    log.debug("sent %s to %s (%d bytes)", out.request_id, out.channel.peer_name, out.sending()[0].total_bytes)
    return []


def wait_for_producer(m: Books, out: Outbound, tick: Tick) -> list[Action]:
    """A stream waits on its producer, not on the peer (the producer has its own lease)."""
    out.deadline = tick.now + m.limits.transfer_timeout
    return []


def pump(m: Books, out: Outbound) -> list[Action]:
    """What the window lets go now: chunk frames from pool memory, or the plane's writes."""
    if out.plane is not None:
        return post_writes(m, out)
    actions: list[Action] = []
    entry, window = out.sending()
    for seq in window.ready_to_send():
        offset, length = window.chunks[seq]
        pieces, hold = m.io.outbound(physical_segments(entry.extents, m.store.block_size, offset, length))
        chunk = p.Chunk(xfer=out.xfer, seq=seq, offset=offset, lengths=[len(x) for x in pieces],
                        digest=digest(m.limits.checksum, pieces), payload=pieces)
        actions.append(SendChunk(out, chunk, hold))
    return actions


def post_writes(m: Books, out: Outbound) -> list[Action]:
    """On a plane, each slice ready goes as one plane write; `placed`, with its digest, once it ended."""
    if out.regions is None:
        return []  # (not granted yet: a stream's bytes queue meanwhile)
    entry, window = out.sending()
    actions: list[Action] = []
    for seq in window.ready_to_send():
        offset, length = window.chunks[seq]
        local = physical_segments(entry.extents, m.store.block_size, offset, length)
        out.placed[seq] = p.Placed(xfer=out.xfer, seq=seq, offset=offset, length=length,
                                   digest=m.io.digest(local, m.limits.plane_checksum))
        out.ops += 1
        actions.append(PostOp(out, seq, "write", *paired(local, cut(out.regions, offset, length))))
    return actions
