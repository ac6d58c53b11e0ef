"""The transfer machine's handlers for a one-sided plane (daemon process; PROTOCOL.md 2.2b), the rows
of `table.py` whose bytes a plane moves: a push offered for the plane, granted ranges, slices written
and said `placed`; a pull answered by lending our blocks, or by our plane reading the holder's.

Pure, as the rest of the machine: a plane operation is an action (`PostOp`) and its end an event
(`OpEnded`); what runs them is the I/O layer's (`transfers.py`, `kvd.daemon.plane`). Like
`sending.py` and `receiving.py` (whose `offer_message`, `post_writes`, `take` and `publish` they
use), each handler is called with the machine's books, the transfer (or the channel) and the event.
"""
from __future__ import annotations

from kvd.errors import BadRequest, ChecksumMismatch, PeerUnavailable, ProtocolError
from kvd.statetable import Fail
from kvd.wire import protocol as p
from kvd.wire.checksum import CRYPTOGRAPHIC
from kvd.wire.layout import physical_segments

from ..store.entry import Entry
from .channel import Channel
from .ranges import checked_ranges, checked_slices, cut, paired
from .receiving import publish, take
from .sending import offer_message, post_writes
from .states import Action, Books, EntryReady, Inbound, OpEnded, Outbound, PostOp, Progress, Received, Send, Transfer
from .window import SendWindow


def ask(m: Books, out: Outbound, event: object) -> list[Action]:
    return _offer_for_plane(m, out, sealed=True)


def ask_stream(m: Books, out: Outbound, event: object) -> list[Action]:
    return _offer_for_plane(m, out, sealed=False)


def _offer_for_plane(m: Books, out: Outbound, sealed: bool) -> list[Action]:
    """Offer the entry's bytes by the link's plane: nothing follows until the receiver grants
    ranges to write them into; they go as slices, one plane write each."""
    window = out.sending()[1]
    out.plane = out.channel.plane
    out.window = window.recut(m.limits.slice_bytes, 0, coalesce=True)
    offer = offer_message(m, out, sealed)
    offer.chunk_size, offer.checksum, offer.plane = m.limits.slice_bytes, m.limits.plane_checksum, out.plane
    return [Send(out.channel, offer)]


def take_grant(m: Books, out: Outbound, msg: p.Grant) -> list[Action]:
    entry, window = out.sending()
    out.regions = checked_ranges(msg.regions, entry.total_bytes, "grant")
    window.max_in_flight = m.limits.plane_in_flight
    out.deadline = m.clock() + m.limits.transfer_timeout
    return post_writes(m, out)


def say_placed(m: Books, out: Outbound, ended: OpEnded) -> list[Action]:
    """A slice is in the receiver's ranges: say so, and write the next (the receiver granted every
    range up front, so nothing waits for its word: a bad slice is its abort, the end its done)."""
    out.ops -= 1
    out.sending()[1].ack(ended.seq)
    out.deadline = m.clock() + m.limits.transfer_timeout
    return [Send(out.channel, out.placed.pop(ended.seq)), *post_writes(m, out)]


def lend_entry(m: Books, out: Outbound, ready: EntryReady) -> list[Action]:
    """A pull on the plane: the puller's plane reads our blocks, slice by slice, each checked
    against the digest this offer gives it; its done ends the lease."""
    entry = ready.entry
    keep = out.pull is not None and out.pull.keep  # (a served pull has its Pull)
    out.lease_token = m.store.lease(entry, consume=not keep, deadline=None).token
    out.entry, out.plane = entry, out.channel.plane
    out.window = window = SendWindow.whole(entry.total_bytes, m.limits.slice_bytes, 0)
    checksum, block_size = m.limits.plane_checksum, m.store.block_size
    offer = offer_message(m, out, sealed=True)
    offer.chunk_size, offer.checksum, offer.plane = m.limits.slice_bytes, checksum, out.plane
    offer.regions = [list(r) for r in physical_segments(entry.extents, block_size, 0, entry.total_bytes)]
    offer.slices = [[offset, length, m.io.digest(physical_segments(entry.extents, block_size, offset, length),
                                                 checksum)] for offset, length in window.chunks]
    # the puller reads without a word to us until its done: it has a transfer timeout a slice (its own
    # stall bound), so we wait that long for all of them
    out.deadline = m.clock() + m.limits.transfer_timeout * max(1, len(window.chunks))
    return [Send(out.channel, offer)]


def _check_plane_offer(m: Books, channel: Channel, msg: p.Offer) -> None:
    if channel.plane is None or msg.plane != channel.plane:
        raise ProtocolError(f"an offer for plane {msg.plane!r} on a link that agreed on {channel.plane or 'none'}")
    if msg.lengths is not None:
        raise ProtocolError("an offer for a plane carries no bytes")
    if m.limits.plane_checksum in CRYPTOGRAPHIC and msg.checksum not in CRYPTOGRAPHIC:
        raise BadRequest(f"a plane's bytes leave this host unencrypted here: their digest must be "
                         f"{m.limits.plane_checksum}, not {msg.checksum}")


def grant_offer(m: Books, channel: Channel, msg: p.Offer) -> list[Action]:
    """Reserve the entry and grant its ranges to the sender's plane: its blocks are pinned for that
    writer until it is known to be done (every slice placed, or its word, or its end)."""
    _check_plane_offer(m, channel, msg)
    inbound, entry = take(m, channel, msg)
    inbound.plane = msg.plane
    m.store.pin_writer(entry)
    regions = [list(r) for r in physical_segments(entry.extents, m.store.block_size, 0, entry.total_bytes)]
    return [Progress(entry, entry.complete_tensors()), Send(inbound.channel, p.Grant(xfer=msg.xfer, regions=regions))]


def take_placed(m: Books, inbound: Inbound, msg: p.Placed) -> list[Action]:
    entry, completed = _check_placed(m, inbound, msg)
    if completed:
        return [Received(inbound, msg.length), Progress(entry, completed)]
    return [Received(inbound, msg.length)]


def take_placed_and_publish(m: Books, inbound: Inbound, msg: p.Placed) -> list[Action]:
    _check_placed(m, inbound, msg)  # (its done acknowledges it)
    return [Received(inbound, msg.length), *publish(m, inbound, msg)]


def _check_placed(m: Books, inbound: Inbound, msg: p.Placed) -> tuple[Entry, list[int]]:
    """The sender says a slice is in our ranges: checked against its digest before a byte of it counts."""
    entry, ledger = inbound.receiving()
    ledger.check(msg.seq, msg.offset, msg.length)
    if m.io.digest(physical_segments(entry.extents, m.store.block_size, msg.offset, msg.length),
                   inbound.checksum) != msg.digest:
        raise ChecksumMismatch(f"slice {msg.seq} of {entry.request_id!r} failed its {inbound.checksum} check")
    ledger.mark(msg.seq, msg.offset, msg.length)
    inbound.deadline = m.clock() + m.limits.transfer_timeout
    return entry, entry.mark_range(msg.offset, msg.length)


def read_offer(m: Books, inbound: Inbound, msg: p.Offer) -> list[Action]:
    """The holder lent its blocks: our plane reads them, slice by slice, into an entry pinned for
    those reads."""
    _check_plane_offer(m, inbound.channel, msg)
    if not msg.sealed:
        raise ProtocolError("a pull on a plane reads sealed entries only")
    inbound, entry = take(m, inbound, msg)
    inbound.plane = msg.plane
    m.store.pin_writer(entry)
    inbound.regions = checked_ranges(msg.regions, entry.total_bytes, "offer")
    inbound.reads = reads = SendWindow.whole(entry.total_bytes, msg.chunk_size, m.limits.plane_in_flight)
    inbound.slices = checked_slices(msg.slices, reads.chunks)
    return [Progress(entry, entry.complete_tensors()), *_post_reads(m, inbound)]


def _post_reads(m: Books, inbound: Inbound) -> list[Action]:
    entry, reads, regions, _ = inbound.reading()
    actions: list[Action] = []
    for seq in reads.ready_to_send():
        offset, length = reads.chunks[seq]
        local = physical_segments(entry.extents, m.store.block_size, offset, length)
        actions.append(PostOp(inbound, seq, "read", *paired(local, cut(regions, offset, length))))
    return actions


def take_read(m: Books, inbound: Inbound, ended: OpEnded) -> list[Action]:
    entry, completed, length = _check_read(m, inbound, ended)
    actions: list[Action] = [Received(inbound, length), *_post_reads(m, inbound)]
    return [*actions, Progress(entry, completed)] if completed else actions


def take_read_and_publish(m: Books, inbound: Inbound, ended: OpEnded) -> list[Action]:
    length = _check_read(m, inbound, ended)[2]
    return [Received(inbound, length), *publish(m, inbound, ended)]


def _check_read(m: Books, inbound: Inbound, ended: OpEnded) -> tuple[Entry, list[int], int]:
    entry, ledger = inbound.receiving()
    _, reads, _, slices = inbound.reading()
    offset, length, expected = slices[ended.seq]
    ledger.check(ended.seq, offset, length)
    if m.io.digest(physical_segments(entry.extents, m.store.block_size, offset, length),
                   inbound.checksum) != expected:
        raise ChecksumMismatch(f"slice {ended.seq} of {entry.request_id!r} read from "
                               f"{inbound.channel.peer_name} failed its {inbound.checksum} check")
    ledger.mark(ended.seq, offset, length)
    reads.ack(ended.seq)
    inbound.deadline = m.clock() + m.limits.transfer_timeout
    return entry, entry.mark_range(offset, length), length


def fail_op(m: Books, transfer: Transfer, ended: OpEnded) -> list[Action]:
    what = "write" if isinstance(transfer, Outbound) else "read"
    return [Fail(PeerUnavailable(f"the {transfer.plane} {what} of slice {ended.seq} failed: {ended.error}"))]
