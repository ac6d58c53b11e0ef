"""Moving entries between daemons (daemon process): the I/O around the transfer state machine.

`machine.py` decides (which chunk goes next, when an entry is published, when a transfer has
failed); this module carries its actions out: messages go out on channels, chunk frames leave
zero-copy from the pool with a tracker each, served pulls wait for their entry, a push waits
for its link, outcomes resolve futures, and what happens to arriving entries is told to the
`EntryEvents` (the entry watch). A push and a pull are each one transfer object and no task of
their own; only a served pull waiting for its entry is a task.

A sender's blocks are reused only once ZeroMQ lets go of every frame sent from them (`frameholds.py`);
on a link with a one-sided plane, only once the plane can no longer touch them (`planeio.py`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvd.errors import BadRequest, KvdError, NotFound, PeerUnavailable
from kvd.memory.io import PoolIO
from kvd.wire import protocol as p
from kvd.wire.endpoints import is_loopback_endpoint

from ..config import Config
from ..metrics import Metrics
from ..plane.poller import PlaneOps
from ..store.entries import Entry, Store
from ..transfer.channel import Channel, Sending
from ..transfer.limits import Limits
from ..transfer.machine import Machine
from ..transfer.states import (
    Action,
    Cancel,
    ChannelLost,
    Commit,
    Connected,
    ConnectFailed,
    Dropped,
    EntryMissing,
    EntryReady,
    Event,
    Finished,
    Inbound,
    Kind,
    Outbound,
    PostOp,
    Progress,
    Published,
    Received,
    Send,
    SendChunk,
    Tick,
    Transfer,
    WaitForEntry,
    Written,
)
from .frameholds import FrameHolds
from .links import PeerLink
from .peers import ChannelKey, PeerSet
from .planeio import PlaneIO, on_plane

log = logging.getLogger(__name__)


# seconds a pull's handshake may take at least, whatever its get's timeout: a get with timeout 0
# of an entry complete on a peer still has time to say hello on a link not up yet
MIN_HANDSHAKE = 0.5


@dataclass(frozen=True)
class Expectation:
    """What a registry record says a holder is: the pull checks it (identity, then generation)."""

    node_id: str
    incarnation: int
    gen: int


@dataclass(eq=False)
class Push:
    """What a local put holds of its push: its transfer, and how it hears the end of it."""

    transfer: Outbound
    outcome: asyncio.Future[None]  # resolves (None, or the error) when the push ends
    # called with its error (or None) as it ends
    on_end: list[Callable[[KvdError | None], None]] = field(default_factory=list)


class EntryEvents(Protocol):
    """What the transfers tell the rest of the daemon about entries, and wait on (the entry watch)."""

    async def wait_ready(self, request_id: str, deadline: float) -> Entry: ...
    async def wait_pullable(self, request_id: str, deadline: float) -> Entry: ...  # complete, or written here
    def on_progress(self, entry: Entry, indices: list[int]) -> None: ...  # tensors completed
    def on_published(self, entry: Entry) -> None: ...
    def on_dropped(self, entry: Entry, error: KvdError) -> None: ...  # failed, removed
    def on_departed(self, entry: Entry, peer: str, pushed: bool) -> None: ...  # sent to peer, and gone from here
    def on_push_failed(self, entry: Entry, peer: str, error: KvdError) -> None: ...  # dropped here too
    def on_returned(self, entry: Entry) -> None: ...  # a failed transfer's claim given back: readable here again


# bench knobs (`python -m bench --plane-cutover`): a daemon started with any of these in its environment
# uses that plane limit instead of limits.py's (a whole number of bytes, or of operations); read once, at
# start; nothing of them runs otherwise
PLANE_KNOBS = {"plane_min_bytes": "KVD_TEST_PLANE_MIN_BYTES", "slice_bytes": "KVD_TEST_PLANE_SLICE_BYTES",
               "plane_in_flight": "KVD_TEST_PLANE_IN_FLIGHT"}


def _plane_knobs(limits: Limits, env: dict[str, str]) -> Limits:
    knobs: dict[str, int] = {}
    for name, var in PLANE_KNOBS.items():
        knobs[name] = getattr(limits, name)
        if env.get(var):
            most = p.MAX_CHUNK_BYTES if name == "slice_bytes" else 1 << 40
            knobs[name] = int(env[var]) if env[var].isdigit() else 0
            if not 0 < knobs[name] <= most:
                raise BadRequest(f"{var}={env[var]!r}: a whole number from 1 to {most}")
    return dataclasses.replace(limits, plane_min_bytes=knobs["plane_min_bytes"], slice_bytes=knobs["slice_bytes"],
                               plane_in_flight=knobs["plane_in_flight"])


@dataclass(frozen=True, slots=True)
class TransferSettings:
    """What the transfers read of the daemon's configuration."""

    node_id: str
    limits: Limits
    connect_timeout: float

    @property
    def transfer_timeout(self) -> float:
        return self.limits.transfer_timeout

    @classmethod
    def of(cls, config: Config) -> TransferSettings:
        # a plane's bytes beyond loopback cross a fabric kvd does not encrypt: their digest is cryptographic
        plane_checksum = config.checksum if is_loopback_endpoint(config.listen) else "blake3_64"
        limits = Limits(config.chunk_size, config.window, config.checksum, config.transfer_timeout,
                        plane_checksum=plane_checksum)
        return cls(config.node_id, _plane_knobs(limits, dict(os.environ)), config.connect_timeout)


class Transfers:
    def __init__(self, settings: TransferSettings, store: Store, io: PoolIO, metrics: Metrics, events: EntryEvents,
                 peers: PeerSet, clock: Callable[[], float] = time.monotonic,
                 plane_ops: PlaneOps | None = None) -> None:
        self.settings = settings
        self.store = store
        self.io = io
        self.metrics = metrics
        self.events = events
        self.peers = peers
        self.clock = clock  # the machine's too: one time for every deadline
        self.machine = Machine(settings.node_id, settings.limits, store, io, clock)
        # what this layer keeps of a live transfer, by its id (dropped as it ends)
        self._pushes: dict[int, Push] = {}  # pushes a local put waits on
        self._pulls: dict[int, asyncio.Future[Entry]] = {}  # pulls a local get waits on
        self._sends: dict[int, list[Sending]] = {}  # the chunk sends of a sender, for their trackers
        self._waiting: dict[int, asyncio.Task[None]] = {}  # served pulls waiting for their entry
        self.frames = FrameHolds(store, settings.transfer_timeout, clock)  # ended sends ZeroMQ may still hold
        self.plane = PlaneIO(plane_ops, store, metrics, self._handle, self._send, self._link_up,
                             settings.transfer_timeout, clock)

    # --- pushes and pulls, as the local handlers start them -----------------------------------------

    def push(self, entry: Entry, lease_token: int, dest: str, sealed: bool = True) -> Push:
        """Send a leased entry to dest: the offer goes once the link is up, bytes as `written`
        says they are in (a stream: sealed=False, then `commit`, so that an abandoned stream is
        never published on the peer). `outcome(push)` resolves once the peer has verified and
        published every byte. The transfer owns the lease from here."""
        try:
            link = self.peers.link_for(dest)
        except BaseException:
            self.store.release(lease_token, success=False)  # nothing was sent: hand the lease back
            raise
        out, actions = self.machine.start_push(entry, lease_token, link.channel, sealed)
        push = self._pushes[out.xfer] = Push(out, asyncio.get_running_loop().create_future())
        self._run(actions)
        ready = link.ready(self.settings.connect_timeout)
        if ready.done():  # the usual case: the offer goes now, not one loop iteration later
            self._on_link(out, ready)
        else:
            ready.add_done_callback(lambda ready: self._on_link(out, ready))
        return push

    def _on_link(self, out: Outbound, ready: asyncio.Future[None]) -> None:
        error = _kvd_error(ready.exception())
        self._run(self.machine.handle(ConnectFailed(out.xfer, error) if error else Connected(out.xfer)))

    def entry_written(self, entry: Entry, ranges: list[tuple[int, int]]) -> None:
        """A local producer wrote these bytes of an entry: they go to every transfer sending it
        while it is written (its push, pulls following the stream), each byte once per transfer."""
        if ranges:
            for out in self._sending(entry):
                self._run(self.machine.handle(Written(out.xfer, ranges)))

    def entry_committed(self, entry: Entry) -> None:
        """The producer committed: each receiver may publish once every byte is in."""
        for out in self._sending(entry):
            self._run(self.machine.handle(Commit(out.xfer)))

    def pushing(self, entry: Entry) -> str | None:
        """The peer a push is taking entry to, once the push claims it (a failed push drops the
        entry too: it is not readable here again)."""
        for transfer in self._sending(entry):
            if transfer.kind is Kind.PUSH:
                lease = self.store.lease_of(transfer.lease_token)
                if lease is not None and lease.claiming:
                    return transfer.channel.peer_name
        return None

    def _sending(self, entry: Entry) -> list[Outbound]:
        return [t for t in self.machine.carrying(entry) if isinstance(t, Outbound)]

    def outcome(self, push: Push) -> asyncio.Future[None]:
        """Resolves (to None, or fails with the error) when the push has ended."""
        return push.outcome

    def when_ended(self, push: Push, callback: Callable[[KvdError | None], None]) -> None:
        """callback(error, or None on success) as the push ends, in the same turn of the loop (a
        done callback of `outcome` runs a turn later: a small push's reply would wait for it); at
        once if it has ended already (a streamed push the peer refused before its writer commits)."""
        outcome = push.outcome
        if outcome.done():
            callback(PeerUnavailable(f"daemon {self.settings.node_id} is shutting down") if outcome.cancelled()
                     else _kvd_error(outcome.exception()))
            return
        push.on_end.append(callback)

    def pull(self, request_id: str, source: str, timeout: float, keep: bool,
             expect: Expectation | None = None, connect_within: float | None = None) -> asyncio.Future[Entry]:
        """Fetch request_id from source into our pool; the future resolves to the published entry.
        Cancelling it (nobody waits any more) calls the pull off: the holder keeps its copy.
        With `expect` (a registry's hint), only that node incarnation's entry of that generation
        will do: anything else fails with NotFound before a byte moves. `connect_within` bounds the
        link's handshake (a get's remaining time, when less than connect_timeout)."""
        link = self.peers.link_for(source)
        result: asyncio.Future[Entry] = asyncio.get_running_loop().create_future()
        started: list[Inbound] = []

        def linked(ready: asyncio.Future[None]) -> None:
            if result.done():
                return  # called off while connecting
            if (error := ready.exception()) is not None:
                result.set_exception(error)
                return
            if expect is not None and (link.remote_node_id, link.remote_incarnation) != (expect.node_id,
                                                                                       expect.incarnation):
                result.set_exception(NotFound(
                    f"stale hint: {source} at {link.endpoint} is node {link.remote_node_id} incarnation "
                    f"{link.remote_incarnation or 0:x}, not {expect.node_id} incarnation {expect.incarnation:x}"))
                return
            inbound, actions = self.machine.start_pull(request_id, link.channel, timeout, keep,
                                                       expect.gen if expect is not None else None)
            self._pulls[inbound.xfer] = result
            started.append(inbound)
            self._run(actions)

        def called_off(done: asyncio.Future[Entry]) -> None:
            if done.cancelled() and started:
                self.abort(started[0], NotFound(f"no reader on {self.settings.node_id} waits for {request_id!r} "
                                                "any more"))

        handshake = self.settings.connect_timeout if connect_within is None else min(self.settings.connect_timeout,
                                                                                   max(MIN_HANDSHAKE, connect_within))
        link.ready(handshake).add_done_callback(linked)
        result.add_done_callback(called_off)
        return result

    def abort(self, transfer: Transfer, error: KvdError) -> None:
        """End a transfer from our side (its entry was dropped); the peer is told."""
        self._run(self.machine.handle(Cancel(transfer.xfer, error)))

    def abort_entry(self, entry: Entry, error: KvdError) -> None:
        """End every transfer that carries this entry (it was deleted): pushes and pulls it is
        being sent by, the one it is arriving by; the peers are told."""
        for transfer in self.machine.carrying(entry):
            self.abort(transfer, error)

    # --- what the sockets and the clock bring -------------------------------------------------------

    def on_message(self, channel: Channel, msg: p.Message) -> None:
        """A message from a peer, on the channel it came on (ROUTER or link)."""
        if self.plane.on_message(channel, msg, self.machine.transfers):  # (what a plane may still do to memory)
            return
        self._run(self.machine.handle(msg, channel))

    def _handle(self, event: Event) -> None:
        self._run(self.machine.handle(event))

    def _link_up(self, peer: str) -> Channel | None:
        """Our link to the peer, if its handshake is up."""
        link = self.peers.links.get(peer)
        return link.channel if link is not None and link.connected else None

    def on_link_message(self, link: PeerLink, msg: p.Message) -> None:
        self.on_message(link.channel, msg)

    def on_lost(self, key: ChannelKey, reason: str) -> None:
        """A connection closed or went silent: fail what ran on it."""
        self._run(self.machine.handle(ChannelLost(key, reason)))

    def tick(self, now: float) -> None:
        """Called periodically: fail transfers without progress."""
        self._run(self.machine.handle(Tick(now)))
        self.plane.tick(now, self.peers.tear_down_plane)

    def busy(self) -> bool:
        """Transfers are in flight or connecting (a drain waits for them)."""
        return bool(self.machine.transfers)

    def busy_channels(self) -> set[ChannelKey]:
        return {transfer.channel.key for transfer in self.machine.transfers.values()}

    def in_flight(self) -> dict[str, int]:
        return self.machine.in_flight()

    async def close(self) -> None:
        for transfer in list(self.machine.transfers.values()):
            self.abort(transfer, PeerUnavailable(f"daemon {self.settings.node_id} is shutting down"))
        await asyncio.sleep(0)  # let the Abort sends start
        self.frames.close()
        if self.plane.ops is not None:
            self.plane.ops.close()
        for task in list(self._waiting.values()):
            task.cancel()
        await asyncio.gather(*self._waiting.values(), return_exceptions=True)

    # --- carrying out the machine's actions -----------------------------------------------------------

    def _run(self, actions: list[Action]) -> None:
        for action in actions:
            match action:
                case SendChunk(transfer=out, msg=chunk, hold=hold):
                    sending = self._send(out.channel, chunk, track=True)
                    self.io.sent(hold, sending)
                    self._sends.setdefault(out.xfer, []).append(sending)
                    nbytes = sum(chunk.lengths or ())  # (an offer that carries a chunk has them)
                    self.metrics.tally["sent_bytes"] += nbytes
                    self.metrics.transfer_bytes(out.channel.peer_name, "sent", nbytes)
                case Send(channel=channel, msg=msg):
                    self._send(channel, msg)
                case Received(transfer=inbound, nbytes=nbytes):
                    self.metrics.tally["received_bytes"] += nbytes
                    self.metrics.transfer_bytes(inbound.channel.peer_name, "received", nbytes)
                case Progress(entry=entry, indices=indices):
                    self.events.on_progress(entry, indices)
                case Published(entry=entry):
                    self.events.on_published(entry)
                case Dropped(entry=entry, error=error):
                    self.events.on_dropped(entry, error)
                case PostOp():
                    self.plane.post(action)
                case WaitForEntry(transfer=out, deadline=deadline):
                    task = asyncio.get_running_loop().create_task(self._wait_for_entry(out, deadline),
                                                                  name=f"pull-{out.xfer:x}")
                    self._waiting[out.xfer] = task
                case Finished(transfer=transfer, error=error):
                    self._finished(transfer, error)

    async def _wait_for_entry(self, out: Outbound, deadline: float) -> None:
        try:
            entry = await self.events.wait_pullable(out.request_id, deadline)
        except KvdError as exc:
            self._waiting.pop(out.xfer, None)
            self._run(self.machine.handle(EntryMissing(out.xfer, exc)))
            return
        self._waiting.pop(out.xfer, None)
        self._run(self.machine.handle(EntryReady(out.xfer, entry)))

    def _finished(self, transfer: Transfer, error: KvdError | None) -> None:
        """A transfer ended: count it, let go of what this layer kept of it, tell who waits."""
        self._count(transfer, error)
        waiting = self._waiting.pop(transfer.xfer, None)
        if waiting is not None:
            waiting.cancel()  # a served pull whose puller gave up while we waited for the entry
        if error is not None and on_plane(transfer):
            self.plane.failed(transfer)  # (its blocks wait for what a plane may still do to them)
        if isinstance(transfer, Inbound):
            self._pull_ended(transfer, error)
        else:
            self._send_ended(transfer, error)

    def _pull_ended(self, transfer: Inbound, error: KvdError | None) -> None:
        """Tell the local get waiting on this pull, if it still waits."""
        result = self._pulls.pop(transfer.xfer, None)
        if result is not None and not result.done():
            if error is not None:
                result.set_exception(error)
                result.exception()  # retrieved: a pull nobody waits for any more must not warn
            else:
                assert transfer.entry is not None  # (a pull that ended well published its entry)
                result.set_result(transfer.entry)

    def _send_ended(self, transfer: Outbound, error: KvdError | None) -> None:
        """Let the entry's blocks go once ZeroMQ has, say where the entry went, tell the put of a push."""
        sends = self._sends.pop(transfer.xfer, [])
        if transfer.entry is not None:
            if error is None or not on_plane(transfer):
                self.frames.unpin_when_sent(transfer, sends)
            if error is None and transfer.entry.removed:  # (its lease consumed it: a push, a pull without keep)
                self.events.on_departed(transfer.entry, transfer.channel.peer_name, transfer.kind is Kind.PUSH)
            elif error is not None and transfer.kind is Kind.PUSH:  # (its put fails, and drops the entry)
                self.events.on_push_failed(transfer.entry, transfer.channel.peer_name, error)
            elif error is not None and not transfer.entry.removed:  # (gets parked behind its claim wait on)
                self.events.on_returned(transfer.entry)
        push = self._pushes.pop(transfer.xfer, None)
        if push is None:
            return
        callbacks, push.on_end = push.on_end, []  # (told once)
        for callback in callbacks:
            try:
                callback(error)
            except Exception:  # one party's failure must not keep the others from hearing
                log.exception("a callback at the end of transfer %x failed", transfer.xfer)
        if not push.outcome.done():
            if error is not None:
                push.outcome.set_exception(error)
                push.outcome.exception()  # retrieved: a push nobody waits for any more must not warn
            else:
                push.outcome.set_result(None)

    def _count(self, transfer: Transfer, error: KvdError | None) -> None:
        """The metrics of an ended transfer, from the machine's word on it."""
        direction = "sent" if isinstance(transfer, Outbound) else "received"
        peer = transfer.channel.peer_name
        if error is None:
            self.metrics.transfer_done(peer, direction, "ok", self.clock() - transfer.started)
            if transfer.kind is Kind.PUSH:
                self.metrics.tally["pushes"] += 1
            elif transfer.kind is Kind.PULL:
                self.metrics.tally["pulls"] += 1
            return
        self.metrics.tally["failures"] += 1
        if direction == "received" or transfer.entry is not None:  # (a pull we served that never began: not)
            self.metrics.transfer_done(peer, direction, "failed", None)

    def _send(self, channel: Channel, msg: p.Message, track: bool = False) -> Sending:
        sent = channel.send(msg, track)
        sent.add_done_callback(_log_send_failure)
        return sent



def _kvd_error(exc: BaseException | None) -> KvdError | None:
    """A future's exception as a kvd error (links and pushes fail with nothing else; anything else
    would be a bug, reported as the peer being unavailable rather than crashing the caller)."""
    if exc is None or isinstance(exc, KvdError):
        return exc
    return PeerUnavailable(f"{type(exc).__name__}: {exc}")


def _log_send_failure(sent: Sending) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        log.warning("send to peer failed: %s", sent.exception())
