"""Moving entries between daemons: push, pull, and the peer-facing ROUTER.

A transfer always has a sender and a receiver, whoever started it:
  push: sender --Offer--> receiver --Accept--> sender --Chunk*--> receiver --ChunkAck*/Done-->
  pull: puller --Pull--> holder, then the same exchange with the holder as sender.
Chunks are sent straight from pool memory (zero-copy, tracked) and copied once from the
ZeroMQ frame into the receiver's pool. A received entry stays invisible (RECEIVING) until
every chunk has arrived and matched its checksum; then it is published in one step.
"""
from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from dataclasses import dataclass, field
from typing import Protocol

import zmq

from kvd.errors import (
    BadRequest, ChecksumMismatch, KvdError, NotFound, PeerUnavailable, ProtocolError, error_from_code,
)
from kvd.memory.io import PoolIO
from kvd.wire import protocol as p
from kvd.wire.checksum import ALGORITHMS, digest
from kvd.wire.layout import TensorSpec, physical_segments

from ..config import Config
from ..metrics import Metrics
from ..store.entries import Entry, State, Store
from .auth import CurveKeys, make_server
from .links import Channel, PeerLink, tune_peer_socket
from .loopsocket import LoopSocket
from .peers import PeerSet
from .tcpconn import TcpConnection, foreign_user, foreign_user_refusal
from .window import ReceiveLedger, SendWindow

log = logging.getLogger(__name__)

# chunks every sender sends right after the offer, before the receiver accepts (wasted if it
# refuses); a receiver whose whole entry fits in them needs no accept (proto/PROTOCOL.md)
EAGER_CHUNKS = 2
MAX_PULL_WAIT = 3600.0  # seconds a holder waits for a pulled entry to appear (a local get's limit too)
# a finished send whose frames ZeroMQ still holds is checked again after this, doubling up to the
# housekeeping interval (its pyzmq trackers complete a few microseconds to milliseconds after done)
DEFERRED_FIRST, DEFERRED_MAX = 0.002, 0.2


class EntryEvents(Protocol):
    """What the exchange tells the rest of the daemon about entries arriving from peers."""

    async def wait_ready(self, request_id: str, deadline: float) -> Entry: ...
    def on_progress(self, entry: Entry, indices: list[int]) -> None: ...  # tensors completed
    def on_published(self, entry: Entry) -> None: ...
    def on_dropped(self, entry: Entry, error: KvdError) -> None: ...  # failed, removed


@dataclass(eq=False)
class Outbound:
    xfer: int
    entry: Entry
    lease_token: int
    channel: Channel
    window: SendWindow
    checksum: str
    done: asyncio.Future
    deadline: float
    sends: list = field(default_factory=list)  # chunk send futures; each resolves to a MessageTracker
    accepted: bool = False  # the receiver has reserved room: the full window may flow
    started: float = field(default_factory=time.monotonic)
    cut: bool = False  # its connection was cut to make ZeroMQ let go of its frames

    def zmq_released(self) -> bool:
        """True once ZeroMQ holds no reference to any frame of ours (safe to reuse the blocks)."""
        for sent in self.sends:
            if not sent.done():
                return False
            if not sent.cancelled() and sent.exception() is None and not sent.result().done:
                return False
        return True


@dataclass(eq=False)
class Inbound:
    xfer: int
    channel: Channel
    request_id: str
    done: asyncio.Future | None  # resolves to the published Entry (pulls wait on it)
    deadline: float
    entry: Entry | None = None  # None until the Offer arrives
    ledger: ReceiveLedger | None = None
    sealed: bool = True  # a stream is published only after the sender's seal
    checksum: str = "none"
    eager: bool = False  # every chunk came unasked (a small sealed entry): no accept, no acks, just done
    started: float = field(default_factory=time.monotonic)


def _flip_a_bit(piece) -> bytes:
    corrupted = bytearray(piece)
    corrupted[len(corrupted) // 2] ^= 0x10
    return bytes(corrupted)


class Exchange:
    def __init__(self, config: Config, store: Store, io: PoolIO, ctx: zmq.Context,
                 incarnation: int, metrics: Metrics) -> None:
        self.config = config
        self.store = store
        self.io = io  # pool bytes <-> network buffers (direct for host pools, bounced for GPU pools)
        self.ctx = ctx
        self.incarnation = incarnation
        self.metrics = metrics
        self.curve: CurveKeys | None = None  # set before start() when CURVE is configured
        # test hook (fault injection): flip one bit in every Nth chunk sent, after its checksum
        self._corrupt_every = int(os.environ.get("KVD_TEST_CORRUPT_EVERY_NTH_CHUNK", "0") or 0)
        self._chunks_sent = 0
        # told about arriving entries: wait_ready(), on_progress(), on_published(), on_dropped()
        self.events: EntryEvents | None = None
        self.peers = PeerSet(config, ctx, incarnation, self._on_link_message, self._fail_channel)
        self.transfers: dict[int, Outbound | Inbound] = {}
        # pulls we serve that still wait for their entry: xfer -> (channel key, the waiting task)
        self._serving: dict[int, tuple[tuple, asyncio.Task]] = {}
        self._deferred: list[Outbound] = []  # finished sends whose frames ZeroMQ may still hold
        self._deferred_check: asyncio.TimerHandle | None = None
        self._deferred_delay = DEFERRED_FIRST
        self._tasks: set[asyncio.Task] = set()
        self.counters = {"sent_bytes": 0, "received_bytes": 0, "pushes": 0, "pulls": 0, "failures": 0}
        self.router: LoopSocket | None = None
        self.bound_endpoint = ""

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        router = self.ctx.socket(zmq.ROUTER)
        tune_peer_socket(router)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished peer is an error, not silence
        if self.curve is not None:
            make_server(router, self.curve)
        router.bind(self.config.listen)
        self.bound_endpoint = router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.router = LoopSocket(router, self._on_router_frames, copy=False)
        self.peers.start(self.curve)

    async def close(self) -> None:
        if self._deferred_check is not None:
            self._deferred_check.cancel()
        for transfer in list(self.transfers.values()):
            self._fail(transfer, PeerUnavailable(f"daemon {self.config.node_id} is shutting down"), notify=True)
        await asyncio.sleep(0)  # let the Abort sends start
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.peers.close()
        if self.router is not None:
            self.router.close()

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- links (kept by the PeerSet) ---------------------------------------------------------

    @property
    def links(self) -> dict[str, PeerLink]:
        return self.peers.links

    def link_for(self, dest: str) -> PeerLink:
        return self.peers.link_for(dest)

    def peer_states(self) -> dict[str, dict]:
        return self.peers.states()

    def set_peers(self, peers: dict[str, str]) -> None:
        """Apply a reloaded peer list: new names are linked, removed ones closed."""
        self.peers.set_peers(peers)

    def heartbeat(self, now: float) -> None:
        """Ping every linked peer; a peer silent past heartbeat_timeout is lost and its transfers fail."""
        self.peers.heartbeat(now, {transfer.channel.key for transfer in self.transfers.values()})

    # --- push and pull, as the daemon's client handlers call them ------------------------------

    async def open_push(self, entry: Entry, lease_token: int, dest: str, sealed: bool = True) -> Outbound:
        """Start sending a leased entry to dest: the Offer goes now, bytes as `queue` adds them.

        The entry may still be being written (a streamed put: sealed=False, and `seal` once the
        producer commits, so that an abandoned stream is never published on the peer). Await
        `out.done` for the end: the peer has verified and published every byte. The exchange
        owns the lease from here."""
        try:
            link = self.link_for(dest)
            await link.ensure_ready(self.config.connect_timeout)
        except BaseException:
            self.store.release(lease_token, success=False)  # nothing was sent: hand the lease back
            raise
        window = SendWindow(entry.total_bytes, self.config.chunk_size, self.config.window)
        return self._start_outbound(self._new_xfer(), entry, lease_token, link.channel, window, sealed)

    def _new_xfer(self) -> int:
        while (xfer := random.getrandbits(63)) in self.transfers:
            pass
        return xfer

    def seal(self, out: Outbound) -> None:
        """The producer committed: the receiver may publish once every byte has arrived."""
        if self.transfers.get(out.xfer) is out:
            self._send(out.channel, p.Seal(xfer=out.xfer))

    def queue(self, out: Outbound, ranges: list[tuple[int, int]]) -> None:
        """Bytes of the entry that are ready to go (each byte exactly once over the transfer)."""
        if self.transfers.get(out.xfer) is not out:
            return  # already failed; its error reaches the caller through out.done
        for offset, length in ranges:
            out.window.add_range(offset, length)
        self._pump(out)

    async def push(self, entry: Entry, lease_token: int, dest: str) -> None:
        """Send a complete, leased entry to dest; returns once the peer has verified and published it."""
        out = await self.open_push(entry, lease_token, dest)
        self.queue(out, [(0, entry.total_bytes)])
        await out.done
        self.counters["pushes"] += 1

    async def pull(self, request_id: str, source: str, timeout: float, keep: bool) -> Entry:
        """Fetch request_id from source into our pool; returns the published entry."""
        link = self.link_for(source)
        await link.ensure_ready(self.config.connect_timeout)
        xfer = self._new_xfer()
        done = asyncio.get_running_loop().create_future()
        now = time.monotonic()
        self.transfers[xfer] = Inbound(xfer, link.channel, request_id, done,
                                       deadline=now + timeout + self.config.transfer_timeout)
        self._send(link.channel, p.Pull(xfer=xfer, request_id=request_id, timeout=timeout, keep=keep))
        try:
            entry = await done
        except asyncio.CancelledError:  # nobody waits for it any more: the holder keeps its copy
            inbound = self.transfers.get(xfer)
            if inbound is not None:
                self._fail(inbound, NotFound(f"no reader on {self.config.node_id} waits for {request_id!r} "
                                             "any more"), notify=True)
            raise
        self.counters["pulls"] += 1
        return entry

    # --- sending ----------------------------------------------------------------------------

    def _start_outbound(self, xfer: int, entry: Entry, lease_token: int, channel: Channel,
                        window: SendWindow, sealed: bool = True) -> Outbound | None:
        cfg = self.config
        if xfer in self.transfers:  # a peer reusing a transfer id it has in flight: never two under one id
            self.store.release(lease_token, success=False)
            self._send(channel, p.Abort(xfer=xfer, code=ProtocolError.code, message="transfer id in use"))
            return None
        out = Outbound(
            xfer, entry, lease_token, channel, window, cfg.checksum,
            asyncio.get_running_loop().create_future(), time.monotonic() + cfg.transfer_timeout,
        )
        # chunks follow the Offer without waiting for Accept (one round trip less per transfer),
        # but only EAGER_CHUNKS of them until the receiver has said it has room
        window.window = EAGER_CHUNKS
        self.transfers[xfer] = out
        self._send(channel, p.Offer(
            xfer=xfer, request_id=entry.request_id, tensors=[s.to_wire() for s in entry.specs],
            total_bytes=entry.total_bytes, chunk_size=cfg.chunk_size, checksum=cfg.checksum,
            # what is left of the ttl (never 0, which would mean "keep forever" to the receiver)
            ttl=None if entry.expires_at is None else max(0.001, entry.expires_at - time.monotonic()),
            meta=entry.meta, sealed=sealed,
        ))
        self._pump(out)
        return out

    def _pump(self, out: Outbound) -> None:
        for seq in out.window.ready_to_send():
            offset, length = out.window.chunks[seq]
            pieces, hold = self.io.outbound(
                physical_segments(out.entry.extents, self.store.block_size, offset, length))
            chunk = p.Chunk(xfer=out.xfer, seq=seq, offset=offset, lengths=[len(x) for x in pieces],
                            digest=digest(out.checksum, pieces), payload=pieces)
            if self._corrupt_every and self._chunks_sent % self._corrupt_every == self._corrupt_every - 1:
                chunk.payload = [_flip_a_bit(pieces[0]), *pieces[1:]]
            self._chunks_sent += 1
            sending = self._send(out.channel, chunk, track=True)
            self.io.sent(hold, sending)
            out.sends.append(sending)
            self.counters["sent_bytes"] += length
            self.metrics.bytes.labels(out.channel.peer_name, "sent").inc(length)

    def _finish_outbound(self, out: Outbound, error: KvdError | None) -> None:
        self.transfers.pop(out.xfer, None)
        self.metrics.transfer_done(out.channel.peer_name, "sent", "ok" if error is None else "failed",
                                   time.monotonic() - out.started)
        # the claim ends now (a push's entry is gone, a failed pull's holder has it back), but the
        # blocks stay pinned until ZeroMQ holds none of our frames: a receiver's `done` is its word,
        # not proof that our frames left, and a failed transfer's frames may still be queued
        try:
            self.store.end_claim(out.lease_token, success=error is None)
        except NotFound:
            pass
        self._unpin_when_sent(out)
        if error is None:
            if not out.done.done():
                out.done.set_result(None)
            log.debug("sent %s to %s (%d bytes)", out.entry.request_id, out.channel.peer_name, out.entry.total_bytes)
            return
        if not out.done.done():
            out.done.set_exception(error)
            out.done.exception()  # a failed pull-serve has no awaiter; mark the error as seen

    def _unpin_when_sent(self, out: Outbound) -> None:
        if out.zmq_released():
            self._unpin(out)
            return
        # ZeroMQ still reads from these blocks. A peer that stops reading can keep its frames
        # queued for ever (a stalled TCP window gives ZeroMQ's heartbeat no chance), so after
        # transfer_timeout its connection is cut, which makes ZeroMQ drop them; never a timer
        # that frees blocks it may still send from
        out.deadline = time.monotonic() + self.config.transfer_timeout
        self._deferred.append(out)
        self._schedule_deferred_check()

    def _unpin(self, out: Outbound) -> None:
        try:
            self.store.release(out.lease_token, success=False)
        except NotFound:
            pass

    def _schedule_deferred_check(self) -> None:
        if self._deferred_check is None:
            self._deferred_check = asyncio.get_running_loop().call_later(self._deferred_delay,
                                                                         self._release_deferred)
            self._deferred_delay = min(2 * self._deferred_delay, DEFERRED_MAX)

    def _release_deferred(self) -> None:
        self._deferred_check = None
        still = []
        now = time.monotonic()
        for out in self._deferred:
            if out.zmq_released():
                self._unpin(out)
                continue
            still.append(out)
            if now >= out.deadline and not out.cut:
                out.cut = True
                log.warning("peer %s has not taken the last frames of %s %.0fs after its transfer ended: "
                            "closing its connection so that the blocks can be reused", out.channel.peer_name,
                            out.entry.request_id, self.config.transfer_timeout)
                out.channel.cut()
        self._deferred = still
        if still:
            self._schedule_deferred_check()
        else:
            self._deferred_delay = DEFERRED_FIRST

    # --- receiving ----------------------------------------------------------------------------

    def _on_offer(self, channel: Channel, msg: p.Offer) -> None:
        existing = self.transfers.get(msg.xfer)
        if existing is not None and not (isinstance(existing, Inbound) and existing.entry is None
                                         and existing.channel.key == channel.key):
            self._send(channel, p.Abort(xfer=msg.xfer, code=ProtocolError.code, message="transfer id in use"))
            return
        inbound = existing or Inbound(msg.xfer, channel, msg.request_id, None, 0.0)
        try:
            if msg.checksum not in ALGORITHMS:
                raise BadRequest(f"unknown checksum {msg.checksum!r}")
            if not 0 < msg.chunk_size <= p.MAX_CHUNK_BYTES:
                raise BadRequest(f"chunk size {msg.chunk_size} outside 1..{p.MAX_CHUNK_BYTES}")
            if msg.request_id != inbound.request_id:
                raise ProtocolError(f"offer for {msg.request_id!r}, but {inbound.request_id!r} was pulled")
            specs = [TensorSpec.from_wire(t) for t in msg.tensors]
            entry = self.store.reserve(msg.request_id, specs, msg.ttl, msg.meta, State.RECEIVING, None)
            if entry.total_bytes != msg.total_bytes:
                self.store.remove(entry)
                raise ProtocolError(f"offer says {msg.total_bytes} bytes, its tensors need {entry.total_bytes}")
        except KvdError as exc:
            self._send(channel, p.Abort(xfer=msg.xfer, code=exc.code, message=exc.message))
            if existing is not None:
                self._fail(existing, exc, notify=False)
            return
        inbound.entry, inbound.checksum = entry, msg.checksum
        inbound.ledger = ReceiveLedger(entry.total_bytes, msg.chunk_size)
        inbound.sealed = msg.sealed
        self.events.on_progress(entry, entry.complete_tensors())  # a stream reader may be waiting for it
        inbound.deadline = time.monotonic() + self.config.transfer_timeout
        self.transfers[msg.xfer] = inbound
        # a small sealed entry's chunks are all on their way already: `done` alone will answer
        inbound.eager = msg.sealed and msg.total_bytes <= EAGER_CHUNKS * msg.chunk_size
        if not inbound.eager:
            self._send(channel, p.Accept(xfer=msg.xfer))
        if inbound.ledger.complete and inbound.sealed:  # an entry of zero bytes: nothing will follow
            self._complete_inbound(inbound)

    def _on_chunk(self, inbound: Inbound, msg: p.Chunk) -> None:
        entry, ledger = inbound.entry, inbound.ledger
        if entry is None or ledger is None:
            raise ProtocolError("chunk before offer")
        length = sum(msg.lengths)
        ledger.check(msg.seq, msg.offset, length)
        # stored first, checked after: these bytes are nobody's yet (each byte arrives once, and
        # none of them is marked as arrived until the check passes; a failure drops the entry)
        segments = physical_segments(entry.extents, self.store.block_size, msg.offset, length)
        if self.io.inbound(segments, msg.payload, inbound.checksum) != msg.digest:
            raise ChecksumMismatch(f"chunk {msg.seq} of {entry.request_id!r} failed its {inbound.checksum} check")
        ledger.mark(msg.seq, msg.offset, length)
        self.counters["received_bytes"] += length
        self.metrics.bytes.labels(inbound.channel.peer_name, "received").inc(length)
        completed = entry.mark_range(msg.offset, length)
        inbound.deadline = time.monotonic() + self.config.transfer_timeout
        if ledger.complete and inbound.sealed:
            self._complete_inbound(inbound)  # its `done` acknowledges this last chunk too
            return
        if not inbound.eager:
            self._send(inbound.channel, p.ChunkAck(xfer=inbound.xfer, seq=msg.seq))
        if completed:
            self.events.on_progress(entry, completed)

    def _complete_inbound(self, inbound: Inbound) -> None:
        self.transfers.pop(inbound.xfer, None)
        # a pull is timed from the Pull request; a pushed entry from its Offer
        self.metrics.transfer_done(inbound.channel.peer_name, "received", "ok", time.monotonic() - inbound.started)
        entry = inbound.entry
        self.store.publish(entry)
        self._send(inbound.channel, p.Done(xfer=inbound.xfer))
        log.debug("received %s from %s (%d bytes)", entry.request_id, inbound.channel.peer_name, entry.total_bytes)
        if inbound.done is not None and not inbound.done.done():
            inbound.done.set_result(entry)
        self.events.on_published(entry)

    # --- serving a pull -------------------------------------------------------------------------

    def _stop_serving(self, xfer: int, channel: Channel) -> None:
        """The puller gave up while we still wait for the entry: stop waiting, lease nothing."""
        key, task = self._serving[xfer]
        if key == channel.key:  # only the connection that asked can call it off
            del self._serving[xfer]
            task.cancel()

    async def _serve_pull(self, channel: Channel, msg: p.Pull) -> None:
        try:
            entry = await self.events.wait_ready(msg.request_id, time.monotonic() + msg.timeout)
            lease = self.store.lease(entry, consume=not msg.keep, deadline=None)
        except KvdError as exc:
            self._send(channel, p.Abort(xfer=msg.xfer, code=exc.code, message=exc.message))
            return
        window = SendWindow.whole(entry.total_bytes, self.config.chunk_size, self.config.window)
        self._start_outbound(msg.xfer, entry, lease.token, channel, window)

    # --- dispatch -----------------------------------------------------------------------------------

    def _on_link_message(self, link: PeerLink, msg: p.Message) -> None:
        self.handle(link.channel, msg)

    def handle(self, channel: Channel, msg: p.Message) -> None:
        """One peer message. Errors end the transfer they belong to, never the daemon."""
        xfer = getattr(msg, "xfer", None)
        transfer = self.transfers.get(xfer) if xfer is not None else None
        if transfer is not None and transfer.channel.key != channel.key:
            log.warning("message %s for transfer %x from the wrong connection; dropped", msg.TYPE, xfer)
            return
        try:
            match msg:
                case p.Offer():
                    self._on_offer(channel, msg)
                case p.Pull() if msg.xfer in self.transfers or msg.xfer in self._serving:
                    raise ProtocolError("transfer id in use")
                case p.Pull() if not 0 <= msg.timeout <= MAX_PULL_WAIT:  # (NaN fails this too)
                    raise BadRequest(f"pull timeout must be between 0 and {MAX_PULL_WAIT:g} seconds")
                case p.Pull():
                    task = self._spawn(self._serve_pull(channel, msg), f"pull-{msg.xfer:x}")
                    self._serving[msg.xfer] = (channel.key, task)
                    task.add_done_callback(lambda _, xfer=msg.xfer: self._serving.pop(xfer, None))
                case p.Ping():
                    self._send(channel, p.Pong(nonce=msg.nonce))
                case p.Pong():
                    pass
                case p.Abort() if transfer is None and xfer in self._serving:
                    self._stop_serving(xfer, channel)
                case _ if transfer is None:
                    log.debug("%s for unknown transfer %r from %s; dropped", msg.TYPE, xfer, channel.peer_name)
                case p.Abort():
                    self._fail(transfer, error_from_code(msg.code, msg.message, remote=channel.peer_name), notify=False)
                case p.Accept() if isinstance(transfer, Outbound):
                    transfer.accepted = True
                    transfer.window.window = self.config.window
                    transfer.deadline = time.monotonic() + self.config.transfer_timeout
                    self._pump(transfer)
                case p.ChunkAck() if isinstance(transfer, Outbound):
                    transfer.window.ack(msg.seq)
                    transfer.deadline = time.monotonic() + self.config.transfer_timeout
                    self._pump(transfer)
                case p.Done() if isinstance(transfer, Outbound):
                    if not transfer.window.all_sent:
                        raise ProtocolError("done before every chunk was sent")
                    self._finish_outbound(transfer, None)
                case p.Seal() if isinstance(transfer, Inbound) and transfer.ledger is not None:
                    transfer.sealed = True
                    if transfer.ledger.complete:
                        self._complete_inbound(transfer)
                case p.Chunk() if isinstance(transfer, Inbound):
                    self._on_chunk(transfer, msg)
                case _:
                    raise ProtocolError(f"unexpected {msg.TYPE} for this transfer")
        except KvdError as exc:
            log.warning("transfer %x with %s failed: %s", xfer or 0, channel.peer_name, exc)
            if transfer is not None:
                self._fail(transfer, exc, notify=True)
            elif xfer is not None:
                if xfer in self._serving:
                    self._stop_serving(xfer, channel)
                self._send(channel, p.Abort(xfer=xfer, code=exc.code, message=exc.message))

    def _fail(self, transfer: Outbound | Inbound, error: KvdError, notify: bool) -> None:
        if self.transfers.get(transfer.xfer) is not transfer:
            return
        self.counters["failures"] += 1
        if notify:
            self._send(transfer.channel, p.Abort(xfer=transfer.xfer, code=error.code, message=error.message))
        if isinstance(transfer, Outbound):
            self._finish_outbound(transfer, error)
            return
        self.transfers.pop(transfer.xfer, None)
        self.metrics.transfer_done(transfer.channel.peer_name, "received", "failed", None)
        if transfer.entry is not None:
            self.store.remove(transfer.entry)
            self.events.on_dropped(transfer.entry, error)
        if transfer.done is not None and not transfer.done.done():
            transfer.done.set_exception(error)

    def busy(self) -> bool:
        """Transfers are in flight (shutdown waits for them to finish)."""
        return bool(self.transfers)

    def _fail_channel(self, key: tuple, reason: str) -> None:
        for transfer in list(self.transfers.values()):
            if transfer.channel.key == key:
                # notify: a peer that only stalled drops its half of the transfer when it resumes
                self._fail(transfer, PeerUnavailable(reason), notify=True)
        for xfer, (channel_key, task) in list(self._serving.items()):
            if channel_key == key:  # nobody is left to send it to
                del self._serving[xfer]
                task.cancel()

    def abort(self, transfer: "Outbound | Inbound", error: KvdError) -> None:
        """End a transfer from our side (its entry was dropped); the peer is told."""
        self._fail(transfer, error, notify=True)

    def abort_entry(self, entry: Entry, error: KvdError) -> None:
        """End every transfer that carries this entry (it was deleted): pushes and pulls it is
        being sent by, the one it is arriving by; the peers are told."""
        for transfer in [t for t in self.transfers.values() if t.entry is entry]:
            self._fail(transfer, error, notify=True)

    def check_deadlines(self, now: float) -> None:
        """Called periodically: fail transfers without progress, free what ZeroMQ let go of."""
        for transfer in list(self.transfers.values()):
            if (isinstance(transfer, Outbound) and not transfer.window.in_flight
                    and transfer.window.queued_bytes < transfer.window.total_bytes):
                # a stream waiting on its producer, not on the peer (the producer has its own lease)
                transfer.deadline = now + self.config.transfer_timeout
            if transfer.deadline <= now:
                self._fail(transfer, PeerUnavailable(
                    f"no progress from peer {transfer.channel.peer_name} for {self.config.transfer_timeout:g}s"
                ), notify=True)

    # --- sockets ------------------------------------------------------------------------------------

    def _send(self, channel: Channel, msg: p.Message, track: bool = False) -> asyncio.Future:
        sent = channel.send(msg, track)
        sent.add_done_callback(self._log_send_failure)
        return sent

    @staticmethod
    def _log_send_failure(sent: asyncio.Future) -> None:
        if not sent.cancelled() and sent.exception() is not None:
            log.warning("send to peer failed: %s", sent.exception())

    def _router_channel(self, rid: bytes) -> Channel:
        name = self.peers.router_name(rid)
        return Channel(("router", rid), name, lambda frames, track: self.router.send(
            [rid, *frames], copy=False, track=track), lambda: self.peers.cut_router(rid))

    def _on_router_frames(self, frames: list) -> None:
        rid = frames[0].bytes
        self.peers.router_seen(rid)
        channel = self._router_channel(rid)
        try:
            msg = p.decode([f.buffer for f in frames[1:]])
        except KvdError as exc:
            log.warning("undecodable message from peer connection %s: %s", channel.peer_name, exc)
            self._send(channel, p.Abort(xfer=0, code=exc.code, message=exc.message))
            return
        if isinstance(msg, p.PeerHello):
            conn = TcpConnection.of_fd(frames[1].get(zmq.SRCFD))
            uid = None if self.curve is not None else foreign_user(conn)
            if uid is not None:
                refusal = foreign_user_refusal(uid, "this peer connection (on loopback)")
                log.warning("refused a peer connection from another user (%s) calling itself %s",
                            "unknown" if uid < 0 else f"uid {uid}", msg.node_id)
                self._send(channel, p.Abort(xfer=0, code=refusal.code, message=refusal.message))
                # (the abort may not leave before the cut: a peer that does not say hello is refused anyway)
                asyncio.get_running_loop().call_later(0.1, conn.cut)
                return
            self.peers.router_hello(rid, msg, conn)
            self._send(self._router_channel(rid),
                       p.PeerHelloOk(node_id=self.config.node_id, incarnation=self.incarnation))
            return
        if not self.peers.router_known(rid):
            self._send(channel, p.Abort(xfer=getattr(msg, "xfer", 0), code=ProtocolError.code,
                                        message="say peer_hello first"))
            return
        self.handle(channel, msg)
