"""Two transfer state machines driven against each other through in-memory channels, with no
sockets, no tasks and no subprocesses (h11's ConnectionPair idea): the harness of
test_transfers.py, test_plane_transfers.py and test_transfer_properties.py.

Each side has its own store and pool (a bytearray); a `Send` lands in the peer's inbox for its
connection, with its payload copied, as a wire would; time is a hand-moved clock. There are two
connections, as between two daemons: A's link to B (a DEALER to B's ROUTER) and B's link to A.
Each carries messages both ways, in order within a direction (ZeroMQ never reorders within a
connection); `deliver` may interleave directions and connections.

`pair(plane=True)` puts every connection on a one-sided plane, the harness's own (`MemoryPlane`):
an operation the machine posts copies bytes between the two pools for real, but only when the test
ends it (`Side.complete`), so that operations end in any order, late, after their transfer ended,
or fail (having landed part of their bytes, or none). What each side does about them is the
daemon's own plane I/O (`PlaneIO`, with its ledger of what a plane may still touch after a failed
transfer); an operation that lands in blocks its entry no longer owns fails the test at once.
"""
from __future__ import annotations

import collections
import random
from collections.abc import Callable
from dataclasses import dataclass

from kvd.daemon.metrics import Metrics
from kvd.daemon.peer.planeio import PlaneIO, on_plane
from kvd.daemon.store.allocator import BlockAllocator
from kvd.daemon.store.entries import State, Store
from kvd.daemon.transfer.channel import Channel
from kvd.daemon.transfer.machine import Limits, Machine
from kvd.daemon.transfer.states import (
    Connected,
    EntryReady,
    Finished,
    Outbound,
    PostOp,
    ReceiverState,
    Send,
    SendChunk,
    SenderState,
    WaitForEntry,
    Written,
)
from kvd.errors import KvdError
from kvd.memory.io import HostPoolIO
from kvd.wire import protocol as p
from kvd.wire.layout import TensorSpec, physical_segments

BLOCK = 4096
CHUNK = 8192
WINDOW = 4
TIMEOUT = 5.0
# on a plane (pair(plane=True)): entries of PLANE_MIN bytes and more ride it, in slices of SLICE bytes
# (not a multiple of a block: a slice starts and ends mid-block, on either side), IN_FLIGHT at once
PLANE = "mem"
PLANE_MIN = CHUNK
SLICE = 10_000
IN_FLIGHT = 2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass(eq=False)
class PlaneOp:
    """An operation `side`'s plane was asked for: write its `local` pool ranges into the peer's
    `remote` ones, or read the peer's `remote` into its `local`; `done(error)` as the plane's end of it."""

    side: Side
    op: str
    local: list
    remote: list
    done: Callable[[KvdError | None], None]
    transfer: object = None  # the transfer that posted it, and its slice
    seq: int = -1
    owners: list | None = None  # per piece: (entry owning its source, entry owning its target), when posted

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.local)


class MemoryPlane:
    """The harness's one-sided plane, with PlaneOps' `post`: an operation waits in `pending` until
    the test ends it (`Side.complete`)."""

    def __init__(self, side: Side) -> None:
        self.side = side
        self.pending: list[PlaneOp] = []

    def post(self, op: str, agent: str, local: list, remote: list, done: Callable) -> None:
        assert agent == self.side.peer.agent, f"{self.side.name} posted an operation towards {agent}"
        self.pending.append(PlaneOp(self.side, op, list(local), list(remote), done))


def owner(side: Side, offset: int):
    """The entry (live, or removed with its blocks parked) whose blocks hold this byte of side's pool."""
    block = offset // BLOCK
    for entry in [*side.store.entries.values(), *side.store._zombies]:  # (the store's parked entries)
        if any(first <= block < first + count for first, count in entry.extents):
            return entry
    return None


class Side:
    """One daemon's transfer machine with its own store, pool and inboxes (one per connection)."""

    def __init__(self, name: str, clock: Clock, blocks: int = 64, *, plane_min_bytes: int | None = None,
                 slice_bytes: int | None = None, plane_in_flight: int = IN_FLIGHT) -> None:
        self.name = name
        self.agent = f"agent-{name}"  # its agent on the plane
        self.store = Store(BlockAllocator(blocks), BLOCK, None)
        self.pool = bytearray(blocks * BLOCK)
        limits = Limits(CHUNK, WINDOW, "xxh3_64", TIMEOUT)
        if plane_min_bytes is not None:
            limits = Limits(CHUNK, WINDOW, "xxh3_64", TIMEOUT, plane_min_bytes=plane_min_bytes,
                            slice_bytes=slice_bytes or SLICE, plane_in_flight=plane_in_flight)
        self.machine = Machine(name, limits, self.store, HostPoolIO(memoryview(self.pool)), clock)
        self.ops = MemoryPlane(self)
        # `released` goes on our own link to the peer, as transfers.py sends it (set by pair())
        self.link: Channel | None = None
        self.plane = PlaneIO(self.ops, self.store, Metrics(), self.handle, self.send, lambda peer: self.link, TIMEOUT,
                             clock)
        self.inboxes: dict[tuple, collections.deque] = {}  # connection key -> what the peer sent on it
        self.events: list = []  # what the I/O layer would hand to the watch and the futures
        self.sent: list[p.Message] = []
        self.peer: Side | None = None
        self.channel: Channel | None = None  # how we reach the peer on its link's connection (B's view of A, ...)
        self.channels: dict[tuple, Channel] = {}  # our channels, by connection key
        self.unpin = True  # as the I/O layer does once ZeroMQ let go: release an ended sender's lease
        self.validating = False  # check the machine's invariants after every event (pair(validate=True))
        self.overwritten: list = []  # holds the plane's ledger dropped for another under the same key
        # a test handed us a message the peer never sent (a lie): the peer's plane is then an attacker's,
        # whose operations on our memory nothing bounds (docs/operations.md), and are not checked
        self.lied_to = False

    @property
    def inbox(self) -> collections.deque:
        """What the peer sent us on the first connection (A's link to B)."""
        return self.inboxes[FIRST]

    def entry(self, request_id: str, data: bytes, *, state: State = State.READY):
        entry = self.store.reserve(request_id, [TensorSpec("x", "uint8", (len(data),))], None, None, State.WRITING,
                                   None)
        self.write(entry, data)
        if state is State.READY:
            self.store.publish(entry)
        return entry

    def write(self, entry, data: bytes) -> None:
        pos = 0
        for segments in entry.segments(BLOCK):
            for offset, length in segments:
                self.pool[offset:offset + length] = data[pos:pos + length]
                pos += length

    def read(self, entry) -> bytes:
        return b"".join(bytes(self.pool[o:o + n]) for segments in entry.segments(BLOCK) for o, n in segments)

    def send(self, channel: Channel, msg: p.Message) -> None:
        if isinstance(msg, (p.Chunk, p.Offer)):  # the wire copies the frames out of our pool
            msg = p.decode([bytes(f) for f in p.encode(msg)])
        self.sent.append(msg)
        self.peer.inboxes[channel.key].append(msg)

    def run(self, actions: list) -> None:
        for action in actions:
            if isinstance(action, (Send, SendChunk)):
                self.send(action.channel if isinstance(action, Send) else action.transfer.channel, action.msg)
            elif isinstance(action, PostOp):
                self.events.append(action)
                posted = len(self.ops.pending)
                self.plane.post(action)
                if len(self.ops.pending) > posted:
                    op = self.ops.pending[-1]
                    op.transfer, op.seq = action.transfer, action.seq
                    op.owners = self._owners(op)
            else:
                self.events.append(action)
                if isinstance(action, Finished):
                    self._finished(action.transfer, action.error)
        if self.validating:
            self.machine.validate()

    def _finished(self, transfer, error) -> None:
        """As the I/O layer: a transfer on a plane that failed leaves its blocks to the plane's ledger
        (drained after our operations, parked until the peer's `released`), a receiver's as a sender's;
        an ended sender's lease is released once ZeroMQ let go of its frames (at once here, unless
        `unpin` is off)."""
        if error is not None and on_plane(transfer):
            self.plane.failed(transfer)
        elif self.unpin and isinstance(transfer, Outbound) and transfer.entry is not None:
            self.store.release(transfer.lease_token, success=False)

    def handle(self, event) -> None:
        self.run(self.machine.handle(event))

    def on_message(self, key: tuple, msg: p.Message) -> None:
        """A message from the peer on connection key, routed as the I/O layer routes it: `released`
        to the plane's ledger, the rest to the machine."""
        if not self.plane.on_message(self.channels[key], msg, self.machine.transfers):
            self.run(self.machine.handle(msg, self.channels[key]))

    def receive(self, key: tuple) -> p.Message:
        """Take the next message the peer sent on connection key, and handle it."""
        msg = self.inboxes[key].popleft()
        self.on_message(key, msg)
        return msg

    def finished(self) -> list[Finished]:
        return [e for e in self.events if isinstance(e, Finished)]

    # --- the plane ---------------------------------------------------------------------------------

    def _owners(self, op: PlaneOp) -> list:
        ours, theirs = (self, self.peer)
        return [(owner(ours, lo), owner(theirs, ro)) if op.op == "write" else (owner(theirs, ro), owner(ours, lo))
                for (lo, _), (ro, _) in zip(op.local, op.remote, strict=True)]

    def complete(self, op: PlaneOp | None = None, error: KvdError | None = None, landed: int | None = None) -> PlaneOp:
        """End one of our plane's operations (the oldest by default): its bytes are copied, then its end is
        told, as the plane's poll would. error: it failed, having landed its first `landed` pieces
        (none by default: a failed one-sided write may have landed part of its bytes, or all)."""
        op = op if op is not None else self.ops.pending[0]
        self.ops.pending.remove(op)
        pieces = len(op.local) if error is None else (landed or 0)
        for i, ((lo, n), (ro, m)) in enumerate(zip(op.local, op.remote, strict=True)):
            if i == pieces:
                break
            assert n == m, f"an operation whose pieces differ in length: {op.local} {op.remote}"
            # the bytes it touches still belong to the entries they belonged to when it was posted
            # (neither side's blocks were given to anyone else, or freed, meanwhile)
            source, target = op.owners[i]
            src_side, dst_side = (self, self.peer) if op.op == "write" else (self.peer, self)
            src_at, dst_at = (lo, ro) if op.op == "write" else (ro, lo)
            granted = target if op.op == "write" else source  # (the peer's entry, when posted)
            if self.peer.lied_to and (granted is None or owner(self.peer, ro) is not granted):
                continue  # (an attacker's access to memory that is no longer its grant: not modelled)
            assert source is not None and owner(src_side, src_at) is source, \
                f"{self.name}'s {op.op} of slice {op.seq} reads {src_side.name}'s blocks that its entry no longer owns"
            assert target is not None and owner(dst_side, dst_at) is target, \
                f"{self.name}'s {op.op} of slice {op.seq} lands in {dst_side.name}'s blocks that are someone else's"
            dst_side.pool[dst_at:dst_at + n] = src_side.pool[src_at:src_at + n]
        op.done(error)
        return op

    def complete_all(self) -> None:
        while self.ops.pending:
            self.complete()

    def restart(self) -> None:
        """This daemon died and came back (a new incarnation said hello): what its plane had posted
        will never land, and the peer lets go of everything it had parked for our old agent. (Our own
        machine is left as it was: a test of a restart looks at the peer.)"""
        self.ops.pending.clear()
        self.peer.plane.peer_gone(self.agent)


FIRST = ("dealer", "tcp://B")  # A's link to B: A's DEALER, B's ROUTER (routing id b"A")
SECOND = ("dealer", "tcp://A")  # B's link to A


def pair(features: tuple[str, ...] = (), *, plane: bool = False, validate: bool = False) -> tuple[Side, Side, Clock]:
    """Two sides; `features`: what each says it speaks at the handshake (none: a v1 peer); plane: every
    connection rides the harness's one-sided plane (entries of PLANE_MIN bytes and more use it);
    validate: both machines' invariants are checked after every event.

    A reaches B as `b.channel` on the first connection (its link); B answers A there as
    `a.channel`. On the second (B's link to A), B reaches A as `a.back` and A answers as `b.back`."""
    clock = Clock()
    sizes = {"plane_min_bytes": PLANE_MIN, "slice_bytes": SLICE} if plane else {}
    a, b = Side("A", clock, **sizes), Side("B", clock, **sizes)
    a.peer, b.peer = b, a
    a.validating = b.validating = validate
    a.channel = Channel(FIRST, "A", None, lambda: False)  # B's view of A on A's link
    b.channel = Channel(FIRST, "B", None, lambda: False)  # A's view of B on its link
    a.back = Channel(SECOND, "A", None, lambda: False)  # B's view of A on its own link
    b.back = Channel(SECOND, "B", None, lambda: False)  # A's view of B on B's link
    for side, channels in ((a, (a.channel, a.back)), (b, (b.channel, b.back))):
        for channel in channels:  # (the peer's view of side)
            channel.features = frozenset(features)
            if plane:
                channel.plane, channel.plane_agent = PLANE, side.agent
    a.link, b.link = b.channel, a.back  # each side's own link to the other
    a.channels = {FIRST: b.channel, SECOND: b.back}  # where A's messages from B come on, by connection
    b.channels = {FIRST: a.channel, SECOND: a.back}
    for side in (a, b):
        side.inboxes = {FIRST: collections.deque(), SECOND: collections.deque()}
    return a, b, clock


def deliver(*sides: Side, drop=lambda side, msg: False, limit: int = 10_000) -> None:
    """Deliver every queued message, in order on each connection, until both sides are quiet."""
    for _ in range(limit):
        busy = [(s, key) for s in sides for key, inbox in s.inboxes.items() if inbox]
        if not busy:
            return
        for side, key in busy:
            msg = side.inboxes[key].popleft()
            if not drop(side, msg):
                side.on_message(key, msg)
    raise AssertionError("the machines never went quiet")


def settle(*sides: Side, limit: int = 10_000) -> None:
    """Deliver every message and end every plane operation (oldest first), until nothing is left."""
    for _ in range(limit):
        deliver(*sides)
        pending = [s for s in sides if s.ops.pending]
        if not pending:
            return
        for side in pending:
            side.complete()
    raise AssertionError("the machines never went quiet")


def types(messages) -> list[str]:
    return [m.TYPE for m in messages]


def push(a: Side, b: Side, entry, *, sealed: bool = True, channel: Channel | None = None):
    lease = a.store.lease(entry, consume=True, deadline=None, incomplete=not sealed)
    out, actions = a.machine.start_push(entry, lease.token, channel or b.channel, sealed)
    a.run(actions)
    return out


def queue_all(a: Side, out, entry) -> None:
    """The producer wrote every byte (a sealed push has them queued from its start already)."""
    if out.window.queued_bytes < entry.total_bytes:
        a.handle(Written(out.xfer, [(0, entry.total_bytes)]))


def data_of(n: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(n)


# --- scenarios on a plane (test_plane_transfers.py, test_plane_failures.py) -----------------------

PLANE_SIZE = 3 * SLICE + 123  # four slices, two in flight at a time


def blocks(entry) -> int:
    return sum(n for _, n in entry.extents)


def raw(side, entry) -> bytes:
    """All of an entry's bytes in side's pool, the padding between its tensors included."""
    return b"".join(bytes(side.pool[o:o + n]) for o, n in physical_segments(entry.extents, BLOCK, 0, entry.total_bytes))


def granted_push(size: int = PLANE_SIZE):
    """A sealed push on the plane, granted: its first writes are posted, none has ended."""
    a, b, _clock = pair(plane=True, validate=True)
    entry = a.entry("r", data_of(size))
    out = push(a, b, entry)
    a.handle(Connected(out.xfer))
    deliver(a, b)
    assert out.state is SenderState.PLACING and len(a.ops.pending) == IN_FLIGHT
    return a, b, entry, out, b.store.entries["r"]


def lent_pull(size: int = PLANE_SIZE, keep: bool = False):
    """B pulls from A on the plane; A lent its entry and B reads: its first reads are posted."""
    a, b, _clock = pair(plane=True, validate=True)
    entry = a.entry("r", data_of(size))
    inbound, actions = b.machine.start_pull("r", a.channel, timeout=3.0, keep=keep)
    b.run(actions)
    deliver(a, b)
    wait = next(e for e in a.events if isinstance(e, WaitForEntry))
    a.handle(EntryReady(wait.transfer.xfer, entry))
    deliver(a, b)
    assert wait.transfer.state is SenderState.LENT and inbound.state is ReceiverState.READING
    return a, b, entry, wait.transfer, inbound


def quiet(*sides) -> bool:
    return not any(side.inboxes[key] for side in sides for key in side.inboxes)


def assert_nothing_held(*sides) -> None:
    """Every block is free or an entry's, no lease is left, the planes' ledgers are empty."""
    for side in sides:
        store = side.store
        assert store.parked_bytes == 0, f"blocks parked on {side.name}"
        assert all(not e.leases for e in store.entries.values()), f"a lease left on {side.name}"
        assert store.allocator.used_blocks == sum(blocks(e) for e in store.entries.values())
        summary = side.plane.summary()
        assert (summary["ops_running"], summary["draining"], summary["parked"]) == (0, 0, 0), summary
        assert not side.ops.pending
