"""Transfers between daemons as a state machine (daemon process): events in, actions out.

Every transfer is in one state, `SenderState` or `ReceiverState`, and `TRANSITIONS` is the one
table of what may happen to it in each: a peer message or a local event the table does not
list for the transfer's state is a protocol error that fails the transfer, and any event may
fail it. `Machine` is the only code that changes a transfer: `start_push`, `start_pull` and
`handle(event)` return the `Action`s to carry out (messages to send, futures to resolve,
watchers to tell), and `transfers.py` carries them out with sockets and tasks. It keeps the
store's books and reads and writes pool bytes through the PoolIO it is given (memory, not
I/O), so two machines can be run against each other through in-memory channels.

    push:  S: offer ────────▶ R            pull:  P: pull ───────▶ H  (H sends, as in a push)
           S: chunk 0, 1 ───▶ R   (eager: before accept; a small sealed entry needs nothing more)
           S ◀─────── accept :R
           S: chunk 2..W-1 ─▶ R ; S ◀── chunk_ack :R (each opens the window by one)
           S ◀───────── done :R   (every byte verified; the entry is published on R)
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Callable

from kvd.errors import (
    BadRequest, ChecksumMismatch, KvdError, NotFound, PeerUnavailable, ProtocolError, error_from_code,
)
from kvd.memory.io import PoolIO
from kvd.wire import protocol as p
from kvd.wire.checksum import ALGORITHMS, digest
from kvd.wire.layout import TensorSpec, physical_segments

from ..metrics import Metrics
from ..store.entries import Entry, State, Store
from .channel import Channel
from .states import (
    R, S, TRANSITIONS, ChannelLost, Commit, ConnectFailed, Connected, Deadline, Dropped, EntryMissing, EntryReady,
    Event, Finished, Inbound, Outbound, Progress, Published, Send, SendChunk, Tick,
    Transfer, WaitForEntry, Written, Cancel,
)
from .window import ReceiveLedger, SendWindow

log = logging.getLogger(__name__)

# chunks every sender sends right after the offer, before the receiver accepts (wasted if it
# refuses); a receiver whose whole entry fits in them needs no accept (proto/PROTOCOL.md)
EAGER_CHUNKS = 2
MAX_PULL_WAIT = 3600.0  # seconds a holder waits for a pulled entry to appear (a local get's limit too)


@dataclass(frozen=True)
class Limits:
    chunk_size: int
    window: int
    checksum: str
    transfer_timeout: float


class Machine:
    def __init__(self, node_id: str, limits: Limits, store: Store, io: PoolIO, metrics: Metrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.node_id = node_id
        self.limits = limits
        self.store = store
        self.io = io  # pool bytes <-> network buffers (direct for host pools, bounced for GPU pools)
        self.metrics = metrics
        self.clock = clock
        self.transfers: dict[int, Transfer] = {}

    # --- starting -------------------------------------------------------------------------------

    def start_push(self, entry: Entry, lease_token: int, channel: Channel, sealed: bool) -> tuple[Outbound, list]:
        """Send a leased entry once the link is up (`Connected`). sealed: every byte is written, and
        all of it goes (an entry of one chunk inside its offer, where the peer takes that); else a
        stream still being written, whose bytes go as `Written` says they are in, then `Commit`.
        The transfer owns the lease."""
        make_window = SendWindow.whole if sealed else SendWindow
        out = Outbound(self._new_xfer(), channel, entry.request_id, S.CONNECTING, entry, lease_token,
                       make_window(entry.total_bytes, self.limits.chunk_size, self.limits.window), sealed)
        self.transfers[out.xfer] = out
        return out, []

    def start_pull(self, request_id: str, channel: Channel, timeout: float, keep: bool,
                   expect_gen: int | None = None) -> tuple[Inbound, list]:
        """Ask the holder on channel for request_id (expect_gen: only that generation of it)."""
        inbound = Inbound(self._new_xfer(), channel, request_id, R.PULLING, pulled=True,
                          deadline=self.clock() + timeout + self.limits.transfer_timeout)
        self.transfers[inbound.xfer] = inbound
        return inbound, [Send(channel, p.Pull(xfer=inbound.xfer, request_id=request_id, timeout=timeout, keep=keep,
                                              expect_gen=expect_gen))]

    def _new_xfer(self) -> int:
        while (xfer := random.getrandbits(63)) in self.transfers:
            pass
        return xfer

    # --- events -----------------------------------------------------------------------------------

    def handle(self, event: Event, channel: Channel | None = None) -> list:
        """One event: a message from a peer (with the channel it came on) or a local one."""
        if isinstance(event, Tick):
            return self._tick(event.now)
        if isinstance(event, ChannelLost):
            actions: list = []
            for transfer in [t for t in self.transfers.values() if t.channel.key == event.key]:
                actions += self._advance(transfer, event)
            return actions
        if isinstance(event, p.Message):
            return self._on_peer(channel, event)
        transfer = self.transfers.get(event.xfer)
        if transfer is None:
            return []  # it ended meanwhile (a pull's entry arrived after its puller gave up)
        try:
            return self._advance(transfer, event)
        except KvdError as exc:  # (the entry a served pull waited for was taken meanwhile, ...)
            log.warning("transfer %x with %s failed: %s", transfer.xfer, transfer.channel.peer_name, exc)
            return self._fail(transfer, exc, notify=True)

    def _on_peer(self, channel: Channel, msg: p.Message) -> list:
        xfer = getattr(msg, "xfer", None)
        transfer = self.transfers.get(xfer) if xfer is not None else None
        if transfer is not None and transfer.channel.key != channel.key:
            log.warning("message %s for transfer %x from the wrong connection; dropped", msg.TYPE, xfer)
            return []
        try:
            if isinstance(msg, p.Ping):
                return [Send(channel, p.Pong(nonce=msg.nonce))]
            if isinstance(msg, p.Pong):
                return []
            if transfer is not None:
                if isinstance(msg, p.Pull) or (isinstance(msg, p.Offer) and transfer.state is not R.PULLING):
                    raise ProtocolError("transfer id in use")  # never two transfers under one id
                return self._advance(transfer, msg)
            if isinstance(msg, p.Offer):
                return self._take_offer(Inbound(msg.xfer, channel, msg.request_id, R.RECEIVING), msg)
            if isinstance(msg, p.Pull):
                return self._serve(channel, msg)
            log.debug("%s for unknown transfer %r from %s; dropped", msg.TYPE, xfer, channel.peer_name)
            return []
        except KvdError as exc:
            log.warning("transfer %x with %s failed: %s", xfer or 0, channel.peer_name, exc)
            if transfer is not None:
                return self._fail(transfer, exc, notify=True)
            return [Send(channel, p.Abort(xfer=xfer or 0, code=exc.code, message=exc.message))]

    def _advance(self, transfer: Transfer, event: object) -> list:
        allowed = TRANSITIONS.get(transfer.state, {}).get(type(event))
        if allowed is None:
            raise ProtocolError(f"unexpected {getattr(event, 'TYPE', type(event).__name__)} for a transfer that "
                                f"is {transfer.state.value}")
        actions = _HANDLERS[type(event)](self, transfer, event)
        if transfer.state not in allowed and transfer.state not in (S.FAILED, R.FAILED):
            raise AssertionError(f"{type(event).__name__} moved a transfer to {transfer.state}")
        return actions

    # --- sending ----------------------------------------------------------------------------------

    def _serve(self, channel: Channel, msg: p.Pull) -> list:
        if not 0 <= msg.timeout <= MAX_PULL_WAIT:  # (NaN fails this too)
            raise BadRequest(f"pull timeout must be between 0 and {MAX_PULL_WAIT:g} seconds")
        out = Outbound(msg.xfer, channel, msg.request_id, S.WAITING, pull=msg)
        self.transfers[msg.xfer] = out
        return [WaitForEntry(out, self.clock() + msg.timeout)]

    def _entry_ready(self, out: Outbound, event: EntryReady) -> list:
        """The pulled entry is here: complete, or a local stream still being written, which the
        pull then follows (what is written goes now, the rest as it is written, and the seal at
        its commit), so that a pulled stream streams too."""
        entry = event.entry
        if out.pull.expect_gen is not None and entry.token != out.pull.expect_gen:
            raise NotFound(f"{entry.request_id!r} on {self.node_id} is not the generation asked for (a stale hint)")
        writing = entry.state is State.WRITING
        out.lease_token = self.store.lease(entry, consume=not out.pull.keep, deadline=None, incomplete=writing).token
        out.entry = entry
        if writing:
            out.window = SendWindow(entry.total_bytes, self.limits.chunk_size, self.limits.window)
            for lo, hi in entry.written.spans():
                out.window.add_range(lo, hi - lo)
            out.sealed = False
        else:
            out.window = SendWindow.whole(entry.total_bytes, self.limits.chunk_size, self.limits.window)
        return self._offer(out)

    def _entry_missing(self, out: Outbound, event: EntryMissing) -> list:
        return self._fail(out, event.error, notify=True)

    def _connected(self, out: Outbound, event: Connected) -> list:
        return self._offer(out)

    def _connect_failed(self, out: Outbound, event: ConnectFailed) -> list:
        return self._fail(out, event.error, notify=False)  # nothing was sent

    def _offer(self, out: Outbound) -> list:
        entry = out.entry
        # chunks follow the offer without waiting for accept (one round trip less per transfer),
        # but only EAGER_CHUNKS of them until the receiver has said it has room; a sealed offer that
        # small is answered without accept or acks, so all of it goes (a stream committed before its
        # link was up may be cut into more, smaller chunks: one per tensor written)
        small = out.sealed and entry.total_bytes <= EAGER_CHUNKS * self.limits.chunk_size
        out.window.window = max(EAGER_CHUNKS, len(out.window.chunks)) if small else EAGER_CHUNKS
        out.state = S.OFFERED
        out.deadline = self.clock() + self.limits.transfer_timeout
        offer = p.Offer(
            xfer=out.xfer, request_id=entry.request_id, tensors=[s.to_wire() for s in entry.specs],
            total_bytes=entry.total_bytes, chunk_size=self.limits.chunk_size, checksum=self.limits.checksum,
            # what is left of the ttl (never 0, which would mean "keep forever" to the receiver)
            ttl=None if entry.expires_at is None else max(0.001, entry.expires_at - time.monotonic()),
            meta=entry.meta, sealed=out.sealed,
        )
        chunks = self._pump(out)
        if (out.sealed and len(out.window.chunks) == 1 and chunks
                and p.INLINE_OFFER in out.channel.features):
            # the whole entry is one chunk, and the peer takes it inside the offer: one message
            # each way (offer, done) instead of two messages, two decodes and two sends
            chunk = chunks[0].msg
            offer.lengths, offer.digest, offer.payload = chunk.lengths, chunk.digest, chunk.payload
            return [SendChunk(out, offer, chunks[0].hold)]
        return [Send(out.channel, offer), *chunks]

    def _written(self, out: Outbound, event: Written) -> list:
        for offset, length in event.ranges:
            out.window.add_range(offset, length)
        return self._pump(out) if out.state in (S.OFFERED, S.SENDING) else []

    def _commit(self, out: Outbound, event: Commit) -> list:
        out.sealed = True  # (still connecting: the offer will say so)
        return [Send(out.channel, p.Seal(xfer=out.xfer))] if out.state in (S.OFFERED, S.SENDING) else []

    def _accept(self, out: Outbound, msg: p.Accept) -> list:
        out.state = S.SENDING
        out.window.window = self.limits.window
        out.deadline = self.clock() + self.limits.transfer_timeout
        return self._pump(out)

    def _chunk_ack(self, out: Outbound, msg: p.ChunkAck) -> list:
        out.window.ack(msg.seq)
        out.deadline = self.clock() + self.limits.transfer_timeout
        return self._pump(out)

    def _done(self, out: Outbound, msg: p.Done) -> list:
        if not out.window.all_sent:
            raise ProtocolError("done before every chunk was sent")
        del self.transfers[out.xfer]
        out.state = S.DONE
        self.metrics.transfer_done(out.channel.peer_name, "sent", "ok", self.clock() - out.started)
        if out.pull is None:
            self.metrics.tally["pushes"] += 1
        # the claim ends now (a push's entry is gone); the blocks stay until ZeroMQ lets go
        self.store.end_claim(out.lease_token, success=True)
        log.debug("sent %s to %s (%d bytes)", out.request_id, out.channel.peer_name, out.entry.total_bytes)
        return [Finished(out, None)]

    def _pump(self, out: Outbound) -> list:
        actions = []
        for seq in out.window.ready_to_send():
            offset, length = out.window.chunks[seq]
            pieces, hold = self.io.outbound(
                physical_segments(out.entry.extents, self.store.block_size, offset, length))
            chunk = p.Chunk(xfer=out.xfer, seq=seq, offset=offset, lengths=[len(x) for x in pieces],
                            digest=digest(self.limits.checksum, pieces), payload=pieces)
            actions.append(SendChunk(out, chunk, hold))
            self.metrics.tally["sent_bytes"] += length
            self.metrics.transfer_bytes(out.channel.peer_name, "sent", length)
        return actions

    # --- receiving --------------------------------------------------------------------------------

    def _take_offer(self, inbound: Inbound, msg: p.Offer) -> list:
        """An offer, pushed (a new transfer) or answering our pull; refused with an abort."""
        try:
            if msg.checksum not in ALGORITHMS:
                raise BadRequest(f"unknown checksum {msg.checksum!r}")
            if not 0 < msg.chunk_size <= p.MAX_CHUNK_BYTES:
                raise BadRequest(f"chunk size {msg.chunk_size} outside 1..{p.MAX_CHUNK_BYTES}")
            if msg.request_id != inbound.request_id:
                raise ProtocolError(f"offer for {msg.request_id!r}, but {inbound.request_id!r} was pulled")
            specs = [TensorSpec.from_wire(t) for t in msg.tensors]
            entry = self.store.reserve(msg.request_id, specs, peer_ttl(msg.ttl, self.store.default_ttl), msg.meta,
                                       State.RECEIVING, None)
            if entry.total_bytes != msg.total_bytes:
                self.store.remove(entry)
                raise ProtocolError(f"offer says {msg.total_bytes} bytes, its tensors need {entry.total_bytes}")
        except KvdError as exc:
            abort = Send(inbound.channel, p.Abort(xfer=msg.xfer, code=exc.code, message=exc.message))
            return [abort, *(self._fail(inbound, exc, notify=False) if inbound.xfer in self.transfers else [])]
        inbound.entry, inbound.checksum, inbound.sealed = entry, msg.checksum, msg.sealed
        inbound.ledger = ReceiveLedger(entry.total_bytes, msg.chunk_size)
        inbound.state = R.RECEIVING
        inbound.deadline = self.clock() + self.limits.transfer_timeout
        self.transfers[msg.xfer] = inbound
        # a small sealed entry's chunks are all on their way already: `done` alone will answer
        inbound.eager = msg.sealed and msg.total_bytes <= EAGER_CHUNKS * msg.chunk_size
        if msg.lengths is not None:  # it carries its only chunk: done (or abort) is the whole answer
            try:
                if not (msg.sealed and msg.total_bytes <= msg.chunk_size):
                    raise ProtocolError("an offer may carry its entry only when it is sealed and one chunk long")
                return self._chunk(inbound, p.Chunk(xfer=msg.xfer, seq=0, offset=0, lengths=msg.lengths,
                                                    digest=msg.digest or 0, payload=msg.payload))
            except KvdError as exc:
                log.warning("transfer %x with %s failed: %s", msg.xfer, inbound.channel.peer_name, exc)
                return self._fail(inbound, exc, notify=True)
        actions: list = [Progress(entry, entry.complete_tensors())]  # a stream reader may be waiting for it
        if not inbound.eager:
            actions.append(Send(inbound.channel, p.Accept(xfer=msg.xfer)))
        if inbound.ledger.complete and inbound.sealed:  # an entry of zero bytes: nothing will follow
            actions += self._complete(inbound)
        return actions

    def _pulled_offer(self, inbound: Inbound, msg: p.Offer) -> list:
        return self._take_offer(inbound, msg)

    def _chunk(self, inbound: Inbound, msg: p.Chunk) -> list:
        entry, ledger = inbound.entry, inbound.ledger
        length = sum(msg.lengths)
        ledger.check(msg.seq, msg.offset, length)
        # stored first, checked after: these bytes are nobody's yet (each byte arrives once, and
        # none of them is marked as arrived until the check passes; a failure drops the entry)
        segments = physical_segments(entry.extents, self.store.block_size, msg.offset, length)
        if self.io.inbound(segments, msg.payload, inbound.checksum) != msg.digest:
            raise ChecksumMismatch(f"chunk {msg.seq} of {entry.request_id!r} failed its {inbound.checksum} check")
        ledger.mark(msg.seq, msg.offset, length)
        self.metrics.tally["received_bytes"] += length
        self.metrics.transfer_bytes(inbound.channel.peer_name, "received", length)
        completed = entry.mark_range(msg.offset, length)
        inbound.deadline = self.clock() + self.limits.transfer_timeout
        if ledger.complete and inbound.sealed:
            return self._complete(inbound)  # its `done` acknowledges this last chunk too
        actions: list = [] if inbound.eager else [Send(inbound.channel, p.ChunkAck(xfer=inbound.xfer, seq=msg.seq))]
        if completed:
            actions.append(Progress(entry, completed))
        return actions

    def _seal(self, inbound: Inbound, msg: p.Seal) -> list:
        inbound.sealed = True
        return self._complete(inbound) if inbound.ledger.complete else []

    def _complete(self, inbound: Inbound) -> list:
        del self.transfers[inbound.xfer]
        inbound.state = R.DONE
        # a pull is timed from the Pull request; a pushed entry from its Offer
        self.metrics.transfer_done(inbound.channel.peer_name, "received", "ok", self.clock() - inbound.started)
        if inbound.pulled:
            self.metrics.tally["pulls"] += 1
        entry = inbound.entry
        self.store.publish(entry)
        log.debug("received %s from %s (%d bytes)", entry.request_id, inbound.channel.peer_name, entry.total_bytes)
        return [Send(inbound.channel, p.Done(xfer=inbound.xfer)), Published(entry), Finished(inbound, None)]

    # --- endings ----------------------------------------------------------------------------------

    def _peer_abort(self, transfer: Transfer, msg: p.Abort) -> list:
        return self._fail(transfer, error_from_code(msg.code, msg.message, remote=transfer.channel.peer_name),
                          notify=False)

    def _cancel(self, transfer: Transfer, event: Cancel) -> list:
        return self._fail(transfer, event.error, notify=event.notify)

    def _tick(self, now: float) -> list:
        actions = []
        for transfer in list(self.transfers.values()):
            if transfer.state in (S.WAITING, S.CONNECTING):
                continue  # they wait on their own timers (the pull's timeout, the handshake's)
            if (isinstance(transfer, Outbound) and not transfer.window.in_flight
                    and transfer.window.queued_bytes < transfer.window.total_bytes):
                # a stream waiting on its producer, not on the peer (the producer has its own lease)
                transfer.deadline = now + self.limits.transfer_timeout
            if transfer.deadline <= now:
                actions += self._advance(transfer, Deadline())
        return actions

    def _deadline(self, transfer: Transfer, event: Deadline) -> list:
        return self._fail(transfer, PeerUnavailable(
            f"no progress from peer {transfer.channel.peer_name} for {self.limits.transfer_timeout:g}s"), notify=True)

    def _channel_lost(self, transfer: Transfer, event: ChannelLost) -> list:
        if transfer.state is S.CONNECTING:
            return []  # it waits for its link's (next) handshake, which has its own deadline
        # notify: a peer that only stalled drops its half of the transfer when it resumes
        return self._fail(transfer, PeerUnavailable(event.reason), notify=True)

    def _fail(self, transfer: Transfer, error: KvdError, notify: bool) -> list:
        if self.transfers.get(transfer.xfer) is not transfer:
            return []
        del self.transfers[transfer.xfer]
        self.metrics.tally["failures"] += 1
        actions: list = []
        if notify:
            actions.append(Send(transfer.channel, p.Abort(xfer=transfer.xfer, code=error.code, message=error.message)))
        if isinstance(transfer, Outbound):
            transfer.state = S.FAILED
            if transfer.entry is not None:
                self.metrics.transfer_done(transfer.channel.peer_name, "sent", "failed", None)
                try:  # a failed pull's holder has its entry back at once; the blocks stay pinned
                    self.store.end_claim(transfer.lease_token, success=False)
                except NotFound:
                    pass
        else:
            transfer.state = R.FAILED
            self.metrics.transfer_done(transfer.channel.peer_name, "received", "failed", None)
            if transfer.entry is not None:
                self.store.remove(transfer.entry)
                actions.append(Dropped(transfer.entry, error))
        return [*actions, Finished(transfer, error)]

    # --- questions --------------------------------------------------------------------------------

    def carrying(self, entry: Entry) -> list[Transfer]:
        """The transfers that carry this entry (sending it, or receiving it)."""
        return [t for t in self.transfers.values() if t.entry is entry]

    def in_flight(self) -> dict[str, int]:
        counts = {"sent": 0, "received": 0}
        for transfer in self.transfers.values():
            counts["sent" if isinstance(transfer, Outbound) else "received"] += 1
        return counts


_HANDLERS: dict[type, Callable] = {
    EntryReady: Machine._entry_ready, EntryMissing: Machine._entry_missing, Connected: Machine._connected,
    ConnectFailed: Machine._connect_failed, Written: Machine._written, Commit: Machine._commit,
    p.Accept: Machine._accept, p.ChunkAck: Machine._chunk_ack, p.Done: Machine._done,
    p.Offer: Machine._pulled_offer, p.Chunk: Machine._chunk, p.Seal: Machine._seal,
    p.Abort: Machine._peer_abort, Cancel: Machine._cancel, ChannelLost: Machine._channel_lost,
    Deadline: Machine._deadline,
}


def peer_ttl(offered: float | None, limit: float | None) -> float | None:
    """A peer's ttl for an entry it sends us, held to ours: a peer may shorten an entry's life, never
    make it outlive our own default (0, "forever", included); without a default of ours, as offered."""
    if limit is None or offered is None:
        return offered
    return limit if offered == 0 else min(offered, limit)
