"""Transfers between daemons as a state machine (daemon process): events in, actions out.

Every transfer is in one state (`states.py`), and `table.TABLE` decides what each event does in
each state and which state follows: `_advance` looks the row up, runs its handler and assigns
the state; handlers never do. `Machine` is the only code that changes a transfer: `start_push`,
`start_pull` and `handle(event)` return the `Action`s to carry out (messages to send, chunks to
send from the pool, what ended and how), and `transfers.py` carries them out with sockets and
tasks, and counts them. It keeps the store's books and reads and writes pool bytes through the
PoolIO it is given (memory, not I/O), and reads time only from its clock, so two machines can be
run against each other through in-memory channels, deterministically; `validate()` checks what
must hold between any two events. A link's one-sided plane has its own handlers (`onesided.py`).
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
from collections.abc import Callable

from kvd.errors import BadRequest, ChecksumMismatch, KvdError, NotFound, PeerUnavailable, ProtocolError, error_from_code
from kvd.memory.io import PoolIO
from kvd.wire import protocol as p
from kvd.wire.checksum import ALGORITHMS, digest
from kvd.wire.layout import TensorSpec, physical_segments

from ..store.entries import Entry, State, Store
from .channel import Channel
from .invariants import check_machine
from .limits import Limits
from .onesided import PlaneHandlers
from .states import (
    NONE,
    TERMINAL,
    ChannelLost,
    Dropped,
    Event,
    Finished,
    Inbound,
    Kind,
    Outbound,
    Progress,
    Published,
    R,
    Received,
    S,
    Send,
    SendChunk,
    Tick,
    Transfer,
    WaitForEntry,
)
from .table import EAGER_CHUNKS, compile_rows
from .window import ReceiveLedger, SendWindow

log = logging.getLogger(__name__)

MAX_PULL_WAIT = 3600.0  # seconds a holder waits for a pulled entry to appear (a local get's limit too)
_NO_XFER = -1  # the id of no transfer (ids are 63 random bits): what an event without one is looked up by
_FAILED = frozenset({S.FAILED, R.FAILED})


class Machine(PlaneHandlers):
    def __init__(self, node_id: str, limits: Limits, store: Store, io: PoolIO,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """clock: the time every deadline and duration is read from; the store's (time.monotonic),
        where entries have a ttl (an offer says what is left of it)."""
        self.node_id = node_id
        self.limits = limits
        self.store = store
        self.io = io  # pool bytes <-> network buffers (direct for host pools, bounced for GPU pools)
        self.clock = clock
        self.transfers: dict[int, Transfer] = {}

    # --- starting -------------------------------------------------------------------------------

    def start_push(self, entry: Entry, lease_token: int, channel: Channel, sealed: bool) -> tuple[Outbound, list]:
        """Send a leased entry once the link is up (`Connected`). sealed: every byte is written, and
        all of it goes (an entry of one chunk inside its offer, where the peer takes that); else a
        stream still being written, whose bytes go as `Written` says they are in, then `Commit`.
        The transfer owns the lease."""
        make_window = SendWindow.whole if sealed else SendWindow
        out = Outbound(self._new_xfer(), channel, entry.request_id, Kind.PUSH,
                       S.CONNECTING if sealed else S.STREAM_CONNECTING, entry, lease_token,
                       make_window(entry.total_bytes, self.limits.chunk_size, self.limits.window),
                       started=self.clock(), plane_min=self.limits.plane_min_bytes)
        self.transfers[out.xfer] = out
        return out, []

    def start_pull(self, request_id: str, channel: Channel, timeout: float, keep: bool,
                   expect_gen: int | None = None) -> tuple[Inbound, list]:
        """Ask the holder on channel for request_id (expect_gen: only that generation of it)."""
        now = self.clock()
        inbound = Inbound(self._new_xfer(), channel, request_id, Kind.PULL, R.PULLING,
                          deadline=now + timeout + self.limits.transfer_timeout, started=now)
        self.transfers[inbound.xfer] = inbound
        return inbound, [Send(channel, p.Pull(xfer=inbound.xfer, request_id=request_id, timeout=timeout, keep=keep,
                                              expect_gen=expect_gen, plane=channel.plane))]

    def _new_xfer(self) -> int:
        while (xfer := random.getrandbits(63)) in self.transfers:
            pass
        return xfer

    # --- events -----------------------------------------------------------------------------------

    def handle(self, event: Event, channel: Channel | None = None) -> list:
        """One event: a message from a peer (with the channel it came on) or a local one. Tick and
        ChannelLost are seen by every transfer (on that channel)."""
        if type(event) is Tick or type(event) is ChannelLost:
            actions: list = []
            key = event.key if type(event) is ChannelLost else None
            for each in [t for t in self.transfers.values() if key is None or t.channel.key == key]:
                actions += self._advance(each, event, None)
            return actions
        transfer = self.transfers.get(getattr(event, "xfer", _NO_XFER))
        if channel is not None and transfer is not None and transfer.channel.key != channel.key:
            log.warning("message %s for transfer %x from the wrong connection; dropped",
                        getattr(event, "TYPE", event), transfer.xfer)
            return []
        return self._advance(transfer, event, channel)

    def _advance(self, transfer: Transfer | None, event: Event, channel: Channel | None) -> list:
        """The one place a transfer changes state: its row's handler runs, then the row's state is
        assigned. A handler of a row that fails returns (error, peer told?); any other returns
        actions; in `no transfer` it gets the channel for a transfer (and may start one)."""
        state = NONE if transfer is None else transfer.state
        rows = _ROWS.get((state, type(event)))
        if rows is None:
            if transfer is None:
                log.debug("%s for no transfer (%r) from %s; dropped", getattr(event, "TYPE", event),
                          getattr(event, "xfer", None), channel.peer_name if channel else "here")
                return []
            return self._failed(transfer, ProtocolError(
                f"unexpected {getattr(event, 'TYPE', type(event).__name__)} for a transfer that is {state.value}"))
        try:
            for when, does, next_state in rows:  # noqa: B007 (the row taken: used after the break)
                if when is None or when(transfer, event):
                    break
            if transfer is not None and next_state in _FAILED:  # (no row of `no transfer` fails)
                error, notify = does(self, transfer, event)
                return self._fail(transfer, error, notify)
            actions = does(self, channel if transfer is None else transfer, event)
        except KvdError as exc:  # (an entry a served pull waited for, taken meanwhile; a broken chunk...)
            if transfer is None:
                xfer = getattr(event, "xfer", _NO_XFER)  # (a row in `no transfer` is for a peer's message)
                transfer = self.transfers.get(xfer)  # (one this event started)
                if transfer is None:
                    if channel is None:
                        raise
                    log.warning("transfer %x with %s refused: %s", xfer, channel.peer_name, exc)
                    return [Send(channel, p.Abort(xfer=xfer, code=exc.code, message=exc.message))]
            return self._failed(transfer, exc)
        if transfer is None:
            if next_state is NONE:
                return actions
            transfer = self.transfers[getattr(event, "xfer", _NO_XFER)]
        transfer.state = next_state
        if next_state in TERMINAL:
            del self.transfers[transfer.xfer]
            actions.append(Finished(transfer, None))
        return actions

    def _failed(self, transfer: Transfer, error: KvdError) -> list:
        log.warning("transfer %x with %s failed: %s", transfer.xfer, transfer.channel.peer_name, error)
        return self._fail(transfer, error, notify=True)

    def _fail(self, transfer: Transfer, error: KvdError, notify: bool) -> list:
        """FAILED: the transfer's claim on its entry ends (a sender's blocks stay pinned until
        ZeroMQ lets go), an arriving entry is dropped."""
        if self.transfers.get(transfer.xfer) is not transfer:
            return []
        del self.transfers[transfer.xfer]
        actions: list = []
        if notify:
            actions.append(Send(transfer.channel, p.Abort(xfer=transfer.xfer, code=error.code, message=error.message)))
        if isinstance(transfer, Outbound):
            transfer.state = S.FAILED
            if transfer.entry is not None:
                try:  # a failed pull's holder has its entry back at once; the blocks stay pinned
                    self.store.end_claim(transfer.lease_token, success=False)
                except NotFound:
                    pass
        else:
            transfer.state = R.FAILED
            if transfer.entry is not None:
                self.store.remove(transfer.entry)
                actions.append(Dropped(transfer.entry, error))
        return [*actions, Finished(transfer, error)]

    # --- handlers: starting -----------------------------------------------------------------------

    def _ignore(self, transfer, event) -> list:
        return []

    def _pong(self, channel: Channel, msg: p.Ping) -> list:
        return [Send(channel, p.Pong(nonce=msg.nonce))]

    def _serve(self, channel: Channel, msg: p.Pull) -> list:
        if not 0 <= msg.timeout <= MAX_PULL_WAIT:  # (NaN fails this too)
            raise BadRequest(f"pull timeout must be between 0 and {MAX_PULL_WAIT:g} seconds")
        now = self.clock()
        out = Outbound(msg.xfer, channel, msg.request_id, Kind.SERVE, NONE, pull=msg, started=now,
                       plane_min=self.limits.plane_min_bytes)
        self.transfers[msg.xfer] = out
        return [WaitForEntry(out, now + msg.timeout)]

    def _take(self, target: Inbound | Channel, msg: p.Offer) -> tuple[Inbound, Entry]:
        """Reserve room for an offer, pushed (target: its channel) or answering our pull."""
        if msg.checksum not in ALGORITHMS:
            raise BadRequest(f"unknown checksum {msg.checksum!r}")
        if not 0 < msg.chunk_size <= p.MAX_CHUNK_BYTES:
            raise BadRequest(f"chunk size {msg.chunk_size} outside 1..{p.MAX_CHUNK_BYTES}")
        if isinstance(target, Inbound) and msg.request_id != target.request_id:
            raise ProtocolError(f"offer for {msg.request_id!r}, but {target.request_id!r} was pulled")
        specs = [TensorSpec.from_wire(t) for t in msg.tensors]
        entry = self.store.reserve(msg.request_id, specs, peer_ttl(msg.ttl, self.store.default_ttl), msg.meta,
                                   State.RECEIVING, None)
        if entry.total_bytes != msg.total_bytes:
            self.store.remove(entry)
            raise ProtocolError(f"offer says {msg.total_bytes} bytes, its tensors need {entry.total_bytes}")
        now = self.clock()
        inbound = target if isinstance(target, Inbound) else Inbound(msg.xfer, target, msg.request_id, Kind.PUSHED,
                                                                     NONE, started=now)
        inbound.entry, inbound.checksum = entry, msg.checksum
        inbound.ledger = ReceiveLedger(entry.total_bytes, msg.chunk_size)
        inbound.deadline = now + self.limits.transfer_timeout
        self.transfers[msg.xfer] = inbound
        return inbound, entry

    def _take_offer(self, target, msg: p.Offer) -> list:
        """Take an offer without a word back (a small sealed one: its chunks are all on their way
        already; `done` alone will answer)."""
        entry = self._take(target, msg)[1]
        return [Progress(entry, entry.complete_tensors())]  # a stream reader may be waiting for it

    def _accept_offer(self, target, msg: p.Offer) -> list:
        return [*self._take_offer(target, msg), Send(self.transfers[msg.xfer].channel, p.Accept(xfer=msg.xfer))]

    def _take_offer_and_publish(self, target, msg: p.Offer) -> list:
        """A sealed offer of zero bytes: nothing will follow."""
        inbound, entry = self._take(target, msg)
        return [Progress(entry, entry.complete_tensors()), *self._publish(inbound, msg)]

    def _take_offer_with_chunk(self, target, msg: p.Offer) -> list:
        """An offer that carries its only chunk: done (or abort) is the whole answer."""
        return self._store(self._take(target, msg)[0], _inline_chunk(msg))

    def _take_offer_with_entry(self, target, msg: p.Offer) -> list:
        return self._store_and_publish(self._take(target, msg)[0], _inline_chunk(msg))

    # --- handlers: sending ------------------------------------------------------------------------

    def _offer_entry(self, out: Outbound, event) -> list:
        return self._serve_entry(out, event.entry, sealed=True)

    def _offer_stream_entry(self, out: Outbound, event) -> list:
        """The pulled entry is a local stream still being written: what is written goes now, the
        rest as it is written, and the seal at its commit, so that a pulled stream streams too."""
        return self._serve_entry(out, event.entry, sealed=False)

    def _serve_entry(self, out: Outbound, entry: Entry, sealed: bool) -> list:
        keep = out.pull is not None and out.pull.keep  # (a served pull has its Pull)
        out.lease_token = self.store.lease(entry, consume=not keep, deadline=None, incomplete=not sealed).token
        out.entry = entry
        out.window = window = (SendWindow.whole if sealed else SendWindow)(entry.total_bytes, self.limits.chunk_size,
                                                                           self.limits.window)
        for lo, hi in [] if sealed else entry.written.spans():
            window.add_range(lo, hi - lo)
        return self._send_offer(out, sealed)

    def _offer(self, out: Outbound, event) -> list:
        return self._send_offer(out, sealed=True)

    def _offer_stream(self, out: Outbound, event) -> list:
        return self._send_offer(out, sealed=False)

    def _offer_message(self, out: Outbound, sealed: bool) -> p.Offer:
        entry = out.sending()[0]
        now = self.clock()
        out.deadline = now + self.limits.transfer_timeout
        return p.Offer(
            xfer=out.xfer, request_id=entry.request_id, tensors=[s.to_wire() for s in entry.specs],
            total_bytes=entry.total_bytes, chunk_size=self.limits.chunk_size, checksum=self.limits.checksum,
            # what is left of the ttl (never 0, which would mean "keep forever" to the receiver)
            ttl=None if entry.expires_at is None else max(0.001, entry.expires_at - now),
            meta=entry.meta, sealed=sealed,
        )

    def _send_offer(self, out: Outbound, sealed: bool) -> list:
        entry, window = out.sending()
        # chunks follow the offer without waiting for accept (one round trip less per transfer),
        # but only EAGER_CHUNKS of them until the receiver has said it has room; a sealed offer that
        # small is answered without accept or acks, so all of it goes (a stream committed before its
        # link was up may be cut into more, smaller chunks: one per tensor written)
        small = sealed and entry.total_bytes <= EAGER_CHUNKS * self.limits.chunk_size
        window.max_in_flight = max(EAGER_CHUNKS, len(window.chunks)) if small else EAGER_CHUNKS
        offer = self._offer_message(out, sealed)
        chunks = self._pump(out)
        if sealed and len(window.chunks) == 1 and chunks and p.INLINE_OFFER in out.channel.features:
            # the whole entry is one chunk, and the peer takes it inside the offer: one message
            # each way (offer, done) instead of two messages, two decodes and two sends
            chunk = chunks[0].msg
            offer.lengths, offer.digest, offer.payload = chunk.lengths, chunk.digest, chunk.payload
            return [SendChunk(out, offer, chunks[0].hold)]
        return [Send(out.channel, offer), *chunks]

    def _queue(self, out: Outbound, event) -> list:
        window = out.sending()[1]
        for offset, length in event.ranges:
            window.add_range(offset, length)
        return []

    def _queue_and_send(self, out: Outbound, event) -> list:
        return self._queue(out, event) + self._pump(out)

    def _seal(self, out: Outbound, event) -> list:
        return [Send(out.channel, p.Seal(xfer=out.xfer))]

    def _open_window(self, out: Outbound, msg: p.Accept) -> list:
        out.sending()[1].max_in_flight = self.limits.window
        out.deadline = self.clock() + self.limits.transfer_timeout
        return self._pump(out)

    def _ack_and_send(self, out: Outbound, msg: p.ChunkAck) -> list:
        out.sending()[1].ack(msg.seq)
        out.deadline = self.clock() + self.limits.transfer_timeout
        return self._pump(out)

    def _finish_sending(self, out: Outbound, msg: p.Done) -> list:
        # the claim ends now (a push's entry is gone); the blocks stay until ZeroMQ lets go
        self.store.end_claim(out.lease_token, success=True)
        log.debug("sent %s to %s (%d bytes)", out.request_id, out.channel.peer_name, out.sending()[0].total_bytes)
        return []

    def _wait_for_producer(self, out: Outbound, tick: Tick) -> list:
        """A stream waits on its producer, not on the peer (the producer has its own lease)."""
        out.deadline = tick.now + self.limits.transfer_timeout
        return []

    def _pump(self, out: Outbound) -> list:
        if out.plane is not None:
            return self._post_writes(out)
        actions = []
        entry, window = out.sending()
        for seq in window.ready_to_send():
            offset, length = window.chunks[seq]
            pieces, hold = self.io.outbound(physical_segments(entry.extents, self.store.block_size, offset, length))
            chunk = p.Chunk(xfer=out.xfer, seq=seq, offset=offset, lengths=[len(x) for x in pieces],
                            digest=digest(self.limits.checksum, pieces), payload=pieces)
            actions.append(SendChunk(out, chunk, hold))
        return actions

    # --- handlers: receiving ----------------------------------------------------------------------

    def _store(self, inbound: Inbound, msg: p.Chunk) -> list:
        entry, length, completed = self._check_and_mark(inbound, msg)
        if completed:
            return [Received(inbound, length), Progress(entry, completed)]
        return [Received(inbound, length)]

    def _store_and_ack(self, inbound: Inbound, msg: p.Chunk) -> list:
        entry, length, completed = self._check_and_mark(inbound, msg)
        ack = Send(inbound.channel, p.ChunkAck(xfer=inbound.xfer, seq=msg.seq))
        if completed:
            return [Received(inbound, length), ack, Progress(entry, completed)]
        return [Received(inbound, length), ack]

    def _store_and_publish(self, inbound: Inbound, msg: p.Chunk) -> list:
        # no ack, no progress: its done acknowledges the chunk, and the entry is published
        return [Received(inbound, self._check_and_mark(inbound, msg)[1]), *self._publish(inbound, msg)]

    def _check_and_mark(self, inbound: Inbound, msg: p.Chunk) -> tuple[Entry, int, list[int]]:
        """Store a chunk's bytes and mark them arrived: (the entry, its length, the tensors it completed)."""
        entry, ledger = inbound.receiving()
        length = sum(msg.lengths)
        ledger.check(msg.seq, msg.offset, length)
        # stored first, checked after: these bytes are nobody's yet (each byte arrives once, and
        # none of them is marked as arrived until the check passes; a failure drops the entry)
        segments = physical_segments(entry.extents, self.store.block_size, msg.offset, length)
        if self.io.inbound(segments, msg.payload, inbound.checksum) != msg.digest:
            raise ChecksumMismatch(f"chunk {msg.seq} of {entry.request_id!r} failed its {inbound.checksum} check")
        ledger.mark(msg.seq, msg.offset, length)
        inbound.deadline = self.clock() + self.limits.transfer_timeout
        return entry, length, entry.mark_range(msg.offset, length)

    def _publish(self, inbound: Inbound, event) -> list:
        entry = inbound.receiving()[0]
        self.store.publish(entry)
        log.debug("received %s from %s (%d bytes)", entry.request_id, inbound.channel.peer_name, entry.total_bytes)
        return [Send(inbound.channel, p.Done(xfer=inbound.xfer)), Published(entry)]

    # --- handlers of the rows that fail: (the error, whether the peer is told) --------------------


    def _fail_missing(self, out: Outbound, event) -> tuple:
        return event.error, True

    def _fail_unconnected(self, out: Outbound, event) -> tuple:
        return event.error, False  # nothing was sent

    def _fail_cancelled(self, transfer: Transfer, event) -> tuple:
        return event.error, event.notify

    def _fail_by_peer(self, transfer: Transfer, msg: p.Abort) -> tuple:
        return error_from_code(msg.code, msg.message, remote=transfer.channel.peer_name), False

    def _fail_lost(self, transfer: Transfer, event: ChannelLost) -> tuple:
        # told: a peer that only stalled drops its half of the transfer when it resumes
        return PeerUnavailable(event.reason), True

    def _fail_stalled(self, transfer: Transfer, tick: Tick) -> tuple:
        return PeerUnavailable(f"no progress from peer {transfer.channel.peer_name} for "
                               f"{self.limits.transfer_timeout:g}s"), True

    def _refuse_generation(self, out: Outbound, event) -> tuple:
        return NotFound(f"{event.entry.request_id!r} on {self.node_id} is not the generation asked for "
                        f"(a stale hint)"), True

    def _refuse_early_done(self, out: Outbound, msg: p.Done) -> tuple:
        return ProtocolError("done before every chunk was sent"), True

    def _refuse_unsealed_done(self, out: Outbound, msg: p.Done) -> tuple:
        # (taken as the end, it would consume an entry its writer has not committed)
        return ProtocolError("done before the seal"), True

    def _refuse_id_in_use(self, transfer: Transfer, msg) -> tuple:
        return ProtocolError("transfer id in use"), True  # never two transfers under one id

    # --- questions --------------------------------------------------------------------------------

    def carrying(self, entry: Entry) -> list[Transfer]:
        """The transfers that carry this entry (sending it, or receiving it)."""
        return [t for t in self.transfers.values() if t.entry is entry]

    def in_flight(self) -> dict[str, int]:
        counts = {"sent": 0, "received": 0}
        for transfer in self.transfers.values():
            counts["sent" if isinstance(transfer, Outbound) else "received"] += 1
        return counts

    def validate(self) -> None:
        """Raise AssertionError naming the first invariant that does not hold (`invariants.py`).
        For tests: it walks every transfer, never on the daemon's hot path."""
        check_machine(self)


_ROWS = compile_rows(lambda name: getattr(Machine, "_" + name))


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
