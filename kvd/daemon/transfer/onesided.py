"""The transfer machine's handlers for a one-sided plane (daemon process; PROTOCOL.md 2.2b), the rows
of `table.py` whose bytes a plane moves: a push offered for the plane, granted ranges, slices written
and said `placed`; a pull answered by lending our blocks, or by our plane reading the holder's.

Pure, as the rest of the machine: a plane operation is an action (`PostOp`) and its end an event
(`OpEnded`); what runs them is the I/O layer's (`transfers.py`, `kvd.daemon.plane`). `Machine`
inherits these; they use its store, pool I/O, limits and clock.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvd.errors import BadRequest, ChecksumMismatch, PeerUnavailable, ProtocolError
from kvd.memory.io import PoolIO
from kvd.wire import protocol as p
from kvd.wire.checksum import CRYPTOGRAPHIC
from kvd.wire.layout import physical_segments

from ..store.entries import Entry, Store
from .channel import Channel
from .limits import Limits
from .ranges import checked_ranges, checked_slices, cut, paired
from .states import Inbound, OpEnded, Outbound, PostOp, Progress, Received, Send, Transfer
from .window import SendWindow


class PlaneHandlers:
    # what `Machine` has, that these handlers use
    limits: Limits
    store: Store
    io: PoolIO
    clock: Callable[[], float]

    if TYPE_CHECKING:
        def _offer_message(self, out: Outbound, sealed: bool) -> p.Offer: ...
        def _pump(self, out: Outbound) -> list: ...
        def _take(self, target: Inbound | Channel, msg: p.Offer) -> tuple[Inbound, Entry]: ...
        def _publish(self, inbound: Inbound, event: object) -> list: ...
    def _ask(self, out: Outbound, event) -> list:
        return self._offer_for_plane(out, sealed=True)

    def _ask_stream(self, out: Outbound, event) -> list:
        return self._offer_for_plane(out, sealed=False)

    def _offer_for_plane(self, out: Outbound, sealed: bool) -> list:
        """Offer the entry's bytes by the link's plane: nothing follows until the receiver grants
        ranges to write them into; they go as slices, one plane write each."""
        entry, window = out.sending()
        out.plane = out.channel.plane
        out.window = window.recut(self.limits.slice_bytes, 0, coalesce=True)
        offer = self._offer_message(out, sealed)
        offer.chunk_size, offer.checksum, offer.plane = self.limits.slice_bytes, self.limits.plane_checksum, out.plane
        return [Send(out.channel, offer)]

    def _take_grant(self, out: Outbound, msg: p.Grant) -> list:
        entry, window = out.sending()
        out.regions = checked_ranges(msg.regions, entry.total_bytes, "grant")
        window.max_in_flight = self.limits.plane_in_flight
        out.deadline = self.clock() + self.limits.transfer_timeout
        return self._pump(out)

    def _post_writes(self, out: Outbound) -> list:
        """Each slice ready goes as one plane write; `placed`, with its digest, once it ended."""
        if out.regions is None:
            return []  # (not granted yet: a stream's bytes queue meanwhile)
        entry, window = out.sending()
        actions: list = []
        for seq in window.ready_to_send():
            offset, length = window.chunks[seq]
            local = physical_segments(entry.extents, self.store.block_size, offset, length)
            out.placed[seq] = p.Placed(xfer=out.xfer, seq=seq, offset=offset, length=length,
                                       digest=self.io.digest(local, self.limits.plane_checksum))
            out.ops += 1
            actions.append(PostOp(out, seq, "write", *paired(local, cut(out.regions, offset, length))))
        return actions

    def _say_placed(self, out: Outbound, ended: OpEnded) -> list:
        """A slice is in the receiver's ranges: say so, and write the next (the receiver granted every
        range up front, so nothing waits for its word: a bad slice is its abort, the end its done)."""
        out.ops -= 1
        out.sending()[1].ack(ended.seq)
        out.deadline = self.clock() + self.limits.transfer_timeout
        return [Send(out.channel, out.placed.pop(ended.seq)), *self._post_writes(out)]

    def _lend_entry(self, out: Outbound, ready) -> list:
        """A pull on the plane: the puller's plane reads our blocks, slice by slice, each checked
        against the digest this offer gives it; its done ends the lease."""
        entry = ready.entry
        keep = out.pull is not None and out.pull.keep  # (a served pull has its Pull)
        out.lease_token = self.store.lease(entry, consume=not keep, deadline=None).token
        out.entry, out.plane = entry, out.channel.plane
        out.window = window = SendWindow.whole(entry.total_bytes, self.limits.slice_bytes, 0)
        checksum, block_size = self.limits.plane_checksum, self.store.block_size
        offer = self._offer_message(out, sealed=True)
        offer.chunk_size, offer.checksum, offer.plane = self.limits.slice_bytes, checksum, out.plane
        offer.regions = [list(r) for r in physical_segments(entry.extents, block_size, 0, entry.total_bytes)]
        offer.slices = [[offset, length, self.io.digest(physical_segments(entry.extents, block_size, offset, length),
                                                        checksum)] for offset, length in window.chunks]
        # the puller reads without a word to us until its done: it has a transfer timeout a slice (its own
        # stall bound), so we wait that long for all of them
        out.deadline = self.clock() + self.limits.transfer_timeout * max(1, len(window.chunks))
        return [Send(out.channel, offer)]

    def _check_plane_offer(self, channel: Channel, msg: p.Offer) -> None:
        if channel.plane is None or msg.plane != channel.plane:
            raise ProtocolError(f"an offer for plane {msg.plane!r} on a link that agreed on {channel.plane or 'none'}")
        if msg.lengths is not None:
            raise ProtocolError("an offer for a plane carries no bytes")
        if self.limits.plane_checksum in CRYPTOGRAPHIC and msg.checksum not in CRYPTOGRAPHIC:
            raise BadRequest(f"a plane's bytes leave this host unencrypted here: their digest must be "
                             f"{self.limits.plane_checksum}, not {msg.checksum}")

    def _grant_offer(self, channel: Channel, msg: p.Offer) -> list:
        """Reserve the entry and grant its ranges to the sender's plane: its blocks are pinned for that
        writer until it is known to be done (every slice placed, or its word, or its end)."""
        self._check_plane_offer(channel, msg)
        inbound, entry = self._take(channel, msg)
        inbound.plane = msg.plane
        self.store.pin_writer(entry)
        regions = [list(r) for r in physical_segments(entry.extents, self.store.block_size, 0, entry.total_bytes)]
        return [Progress(entry, entry.complete_tensors()), Send(inbound.channel, p.Grant(xfer=msg.xfer,
                                                                                        regions=regions))]

    def _take_placed(self, inbound: Inbound, msg: p.Placed) -> list:
        entry, completed = self._check_placed(inbound, msg)
        return [Received(inbound, msg.length), Progress(entry, completed)] if completed else [Received(inbound,
                                                                                                    msg.length)]

    def _take_placed_and_publish(self, inbound: Inbound, msg: p.Placed) -> list:
        self._check_placed(inbound, msg)  # (its done acknowledges it)
        return [Received(inbound, msg.length), *self._publish(inbound, msg)]

    def _check_placed(self, inbound: Inbound, msg: p.Placed) -> tuple:
        """The sender says a slice is in our ranges: checked against its digest before a byte of it counts."""
        entry, ledger = inbound.receiving()
        ledger.check(msg.seq, msg.offset, msg.length)
        if self.io.digest(physical_segments(entry.extents, self.store.block_size, msg.offset, msg.length),
                          inbound.checksum) != msg.digest:
            raise ChecksumMismatch(f"slice {msg.seq} of {entry.request_id!r} failed its {inbound.checksum} check")
        ledger.mark(msg.seq, msg.offset, msg.length)
        inbound.deadline = self.clock() + self.limits.transfer_timeout
        return entry, entry.mark_range(msg.offset, msg.length)

    def _read_offer(self, inbound: Inbound, msg: p.Offer) -> list:
        """The holder lent its blocks: our plane reads them, slice by slice, into an entry pinned for
        those reads."""
        self._check_plane_offer(inbound.channel, msg)
        if not msg.sealed:
            raise ProtocolError("a pull on a plane reads sealed entries only")
        inbound, entry = self._take(inbound, msg)
        inbound.plane = msg.plane
        self.store.pin_writer(entry)
        inbound.regions = checked_ranges(msg.regions, entry.total_bytes, "offer")
        inbound.reads = reads = SendWindow.whole(entry.total_bytes, msg.chunk_size, self.limits.plane_in_flight)
        inbound.slices = checked_slices(msg.slices, reads.chunks)
        return [Progress(entry, entry.complete_tensors()), *self._post_reads(inbound)]

    def _post_reads(self, inbound: Inbound) -> list:
        entry, reads, regions, _ = inbound.reading()
        actions: list = []
        for seq in reads.ready_to_send():
            offset, length = reads.chunks[seq]
            local = physical_segments(entry.extents, self.store.block_size, offset, length)
            actions.append(PostOp(inbound, seq, "read", *paired(local, cut(regions, offset, length))))
        return actions

    def _take_read(self, inbound: Inbound, ended: OpEnded) -> list:
        entry, completed, length = self._check_read(inbound, ended)
        actions: list = [Received(inbound, length), *self._post_reads(inbound)]
        return [*actions, Progress(entry, completed)] if completed else actions

    def _take_read_and_publish(self, inbound: Inbound, ended: OpEnded) -> list:
        length = self._check_read(inbound, ended)[2]
        return [Received(inbound, length), *self._publish(inbound, ended)]

    def _check_read(self, inbound: Inbound, ended: OpEnded) -> tuple:
        entry, ledger = inbound.receiving()
        _, reads, _, slices = inbound.reading()
        offset, length, expected = slices[ended.seq]
        ledger.check(ended.seq, offset, length)
        if self.io.digest(physical_segments(entry.extents, self.store.block_size, offset, length),
                          inbound.checksum) != expected:
            raise ChecksumMismatch(f"slice {ended.seq} of {entry.request_id!r} read from "
                                   f"{inbound.channel.peer_name} failed its {inbound.checksum} check")
        ledger.mark(ended.seq, offset, length)
        reads.ack(ended.seq)
        inbound.deadline = self.clock() + self.limits.transfer_timeout
        return entry, entry.mark_range(offset, length), length

    def _fail_op(self, transfer: Transfer, ended: OpEnded) -> tuple:
        what = "write" if isinstance(transfer, Outbound) else "read"
        return PeerUnavailable(f"the {transfer.plane} {what} of slice {ended.seq} failed: {ended.error}"), True
