"""Two transfer state machines driven against each other through in-memory channels, with no
sockets, no tasks and no subprocesses (h11's ConnectionPair idea): the harness of
test_transfers.py and test_transfer_properties.py.

Each side has its own store and pool (a bytearray); a `Send` lands in the peer's inbox for its
connection, with its payload copied, as a wire would; time is a hand-moved clock. There are two
connections, as between two daemons: A's link to B (a DEALER to B's ROUTER) and B's link to A.
Each carries messages both ways, in order within a direction (ZeroMQ never reorders within a
connection); `deliver` may interleave directions and connections.
"""
from __future__ import annotations

import collections
import random

from kvd.daemon.peer.channel import Channel
from kvd.daemon.peer.machine import Limits, Machine
from kvd.daemon.peer.states import Finished, Outbound, Send, SendChunk, Written
from kvd.daemon.store.allocator import BlockAllocator
from kvd.daemon.store.entries import State, Store
from kvd.memory.io import HostPoolIO
from kvd.wire import protocol as p
from kvd.wire.layout import TensorSpec

BLOCK = 4096
CHUNK = 8192
WINDOW = 4
TIMEOUT = 5.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Side:
    """One daemon's transfer machine with its own store, pool and inboxes (one per connection)."""

    def __init__(self, name: str, clock: Clock, blocks: int = 64) -> None:
        self.name = name
        self.store = Store(BlockAllocator(blocks), BLOCK, None)
        self.pool = bytearray(blocks * BLOCK)
        self.machine = Machine(name, Limits(CHUNK, WINDOW, "xxh3_64", TIMEOUT), self.store,
                               HostPoolIO(memoryview(self.pool)), clock)
        self.inboxes: dict[tuple, collections.deque] = {}  # connection key -> what the peer sent on it
        self.events: list = []  # what the I/O layer would hand to the watch and the futures
        self.sent: list[p.Message] = []
        self.peer: Side | None = None
        self.channel: Channel | None = None  # how we reach the peer on its link's connection (B's view of A, ...)
        self.channels: dict[tuple, Channel] = {}  # our channels, by connection key
        self.unpin = True  # as the I/O layer does once ZeroMQ let go: release an ended sender's lease

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

    def run(self, actions: list) -> None:
        for action in actions:
            if isinstance(action, (Send, SendChunk)):
                msg = action.msg
                if isinstance(msg, (p.Chunk, p.Offer)):  # the wire copies the frames out of our pool
                    msg = p.decode([bytes(f) for f in p.encode(msg)])
                channel = action.channel if isinstance(action, Send) else action.transfer.channel
                self.sent.append(msg)
                self.peer.inboxes[channel.key].append(msg)
            else:
                self.events.append(action)
                if (self.unpin and isinstance(action, Finished) and isinstance(action.transfer, Outbound)
                        and action.transfer.entry is not None):
                    self.store.release(action.transfer.lease_token, success=False)

    def handle(self, event) -> None:
        self.run(self.machine.handle(event))

    def receive(self, key: tuple) -> p.Message:
        """Take the next message the peer sent on connection key, and handle it."""
        msg = self.inboxes[key].popleft()
        self.run(self.machine.handle(msg, self.channels[key]))
        return msg

    def finished(self) -> list[Finished]:
        return [e for e in self.events if isinstance(e, Finished)]


FIRST = ("dealer", "tcp://B")  # A's link to B: A's DEALER, B's ROUTER (routing id b"A")
SECOND = ("dealer", "tcp://A")  # B's link to A


def pair(features: tuple[str, ...] = ()) -> tuple[Side, Side, Clock]:
    """Two sides; `features`: what each says it speaks at the handshake (none: a v1 peer).

    A reaches B as `b.channel` on the first connection (its link); B answers A there as
    `a.channel`. On the second (B's link to A), B reaches A as `a.back` and A answers as `b.back`."""
    clock = Clock()
    a, b = Side("A", clock), Side("B", clock)
    a.peer, b.peer = b, a
    a.channel = Channel(FIRST, "A", None, lambda: False)  # B's view of A on A's link
    b.channel = Channel(FIRST, "B", None, lambda: False)  # A's view of B on its link
    a.back = Channel(SECOND, "A", None, lambda: False)  # B's view of A on its own link
    b.back = Channel(SECOND, "B", None, lambda: False)  # A's view of B on B's link
    for channel in (a.channel, b.channel, a.back, b.back):
        channel.features = frozenset(features)
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
                side.run(side.machine.handle(msg, side.channels[key]))
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
