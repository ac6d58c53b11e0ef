"""What a transfer between daemons is (daemon process): its states, the events that move it and
the actions it asks for, and the books the machine keeps of them (`Books`, what every handler is
handed). Plain data: `table.py` says which event does what in which state, and `machine.py`
walks that table.

A transfer object holds protocol state only (what the peer and we have said, the entry and the
bytes in flight); what the I/O layer keeps about a transfer (futures, callbacks, trackers) is
that layer's, keyed by transfer id (`transfers.py`).
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from kvd.errors import KvdError
from kvd.memory.io import PoolIO
from kvd.statetable import Fail
from kvd.wire import protocol as p

from ..store.entries import Entry, Store
from .channel import Channel, ChannelKey
from .limits import Limits
from .ranges import Ranges
from .window import ReceiveLedger, SendWindow


class SenderState(enum.Enum):
    WAITING = "waiting"  # a pull asked for an entry that is not here yet
    CONNECTING = "connecting"  # a push waits for its link's handshake; every byte is queued
    STREAM_CONNECTING = "stream connecting"  # ... a stream's, whose bytes queue up as they are written
    OFFERED = "offered"  # offer and the eager chunks sent; no accept yet
    STREAM_OFFERED = "stream offered"  # ... of a stream not yet committed: no seal said
    SENDING = "sending"  # accepted: the whole window flows
    STREAM_SENDING = "stream sending"  # ... of a stream not yet committed
    # on a link with a one-sided plane (PROTOCOL.md 2.2b)
    ASKED = "asked"  # offer sent for the plane; no grant yet
    STREAM_ASKED = "stream asked"  # ... of a stream not yet committed
    PLACING = "placing"  # granted: the plane writes slices into the receiver's ranges, each then said placed
    STREAM_PLACING = "stream placing"  # ... of a stream not yet committed
    LENT = "lent"  # a pull served on the plane: the puller's plane reads our blocks until its done
    DONE = "done"  # the receiver has verified every byte
    FAILED = "failed"


class ReceiverState(enum.Enum):
    PULLING = "pulling"  # we asked a holder for an entry; no offer yet
    RECEIVING = "receiving"  # a sealed offer accepted: each chunk acknowledged, done after the last
    RECEIVING_SMALL = "receiving small"  # a small sealed offer: every chunk comes unasked; no accept, no acks
    STREAMING = "streaming"  # an offer not sealed: chunks acknowledged, published only after the seal
    STREAMED = "streamed"  # every byte of an offer not sealed is in; waiting for its seal
    GRANTED = "granted"  # a sealed offer for the plane: our ranges granted, each placed slice verified
    STREAM_GRANTED = "stream granted"  # ... of an offer not sealed: published only after the seal
    READING = "reading"  # a pull answered on the plane: our plane reads the holder's slices
    DONE = "done"  # every byte verified and published
    FAILED = "failed"


class NoTransfer(enum.Enum):
    """The state a message is looked up in when no transfer has its id (yet), or it has none."""
    NONE = "no transfer"


class Kind(enum.Enum):
    """Who started a transfer, and which way its bytes go (fixed for its life)."""
    PUSH = "push"  # we send an entry a local put gave us
    SERVE = "served pull"  # we send an entry a peer pulled
    PUSHED = "pushed to us"  # a peer sends us an entry it chose to
    PULL = "pull"  # we asked a peer for an entry


S, R, NONE = SenderState, ReceiverState, NoTransfer.NONE
TERMINAL = frozenset({S.DONE, S.FAILED, R.DONE, R.FAILED})
STREAM_SENDER = frozenset({S.STREAM_CONNECTING, S.STREAM_OFFERED, S.STREAM_SENDING, S.STREAM_ASKED,
                           S.STREAM_PLACING})  # no seal said yet
# where the plane may still be at work on a transfer's memory: ours (our writes, our reads) or the
# peer's (its writes into what we granted, its reads of what we lent)
OUR_OPS = frozenset({S.PLACING, S.STREAM_PLACING, R.READING})
PEER_OPS = frozenset({S.LENT, R.GRANTED, R.STREAM_GRANTED})
# the states a transfer of each kind may be in, its terminal ones apart (Machine.validate checks them)
KIND_STATES = {
    Kind.PUSH: frozenset({S.CONNECTING, S.STREAM_CONNECTING, S.OFFERED, S.STREAM_OFFERED, S.SENDING,
                          S.STREAM_SENDING, S.ASKED, S.STREAM_ASKED, S.PLACING, S.STREAM_PLACING}),
    Kind.SERVE: frozenset({S.WAITING, S.OFFERED, S.STREAM_OFFERED, S.SENDING, S.STREAM_SENDING, S.LENT}),
    Kind.PUSHED: frozenset({R.RECEIVING, R.RECEIVING_SMALL, R.STREAMING, R.STREAMED, R.GRANTED,
                            R.STREAM_GRANTED}),
    Kind.PULL: frozenset({R.PULLING, R.RECEIVING, R.RECEIVING_SMALL, R.STREAMING, R.STREAMED, R.READING}),
}


@dataclass(eq=False)
class Outbound:
    """A transfer we send: a push, or a pull we serve."""

    xfer: int
    channel: Channel
    request_id: str
    kind: Kind  # PUSH or SERVE
    state: SenderState | NoTransfer
    entry: Entry | None = None  # None while WAITING
    lease_token: int = 0  # the lease on entry this transfer holds (its claim ends when it does)
    window: SendWindow | None = None  # None while WAITING
    pull: p.Pull | None = None  # the request, for a pull we serve
    deadline: float = 0.0  # no progress by then: it fails (not while WAITING or CONNECTING)
    started: float = 0.0  # by the machine's clock
    plane: str | None = None  # the one-sided plane its bytes ride (None: chunk frames)
    plane_min: int = 0  # entries smaller than this go as chunk frames even on a link with a plane
    regions: Ranges | None = None  # a push on a plane: the receiver's granted ranges, in the entry's order
    placed: dict[int, p.Placed] = field(default_factory=dict)  # seq -> the placed message to send once its write ended
    ops: int = 0  # plane operations of ours running

    def sending(self) -> tuple[Entry, SendWindow]:
        """Its entry and window, which it has in every state but WAITING (the table's rows see to it)."""
        if self.entry is None or self.window is None:
            raise AssertionError(f"transfer {self.xfer:x} is {self.state} without an entry")
        return self.entry, self.window


@dataclass(eq=False)
class Inbound:
    """A transfer we receive: pushed to us, or pulled by us."""

    xfer: int
    channel: Channel
    request_id: str
    kind: Kind  # PUSHED or PULL
    state: ReceiverState | NoTransfer
    entry: Entry | None = None  # None until the offer
    ledger: ReceiveLedger | None = None
    checksum: str = "none"
    deadline: float = 0.0
    started: float = 0.0  # by the machine's clock: a pull from its Pull, a pushed entry from its Offer
    plane: str | None = None  # the one-sided plane its bytes ride (None: chunk frames)
    regions: Ranges | None = None  # a pull on a plane: the holder's ranges, in the entry's order
    slices: list[tuple[int, int, int]] | None = None  # ... and its slices to read: (offset, length, digest) by seq
    reads: SendWindow | None = None  # ... which of them our plane reads now

    def receiving(self) -> tuple[Entry, ReceiveLedger]:
        """Its entry and ledger, which it has from its offer on (the table's rows see to it)."""
        if self.entry is None or self.ledger is None:
            raise AssertionError(f"transfer {self.xfer:x} is {self.state} without an entry")
        return self.entry, self.ledger

    def reading(self) -> tuple[Entry, SendWindow, Ranges, list[tuple[int, int, int]]]:
        """A pull on a plane's entry, reads, the holder's ranges and its slices (from its offer on)."""
        if self.entry is None or self.reads is None or self.regions is None or self.slices is None:
            raise AssertionError(f"transfer {self.xfer:x} is {self.state} without its reads")
        return self.entry, self.reads, self.regions, self.slices


Transfer = Outbound | Inbound


# --- events -------------------------------------------------------------------------------------

@dataclass
class Connected:
    """A push's link finished its handshake."""
    xfer: int


@dataclass
class ConnectFailed:
    xfer: int
    error: KvdError


@dataclass
class Written:
    """A push's producer wrote these byte ranges of the entry (each byte exactly once)."""
    xfer: int
    ranges: list[tuple[int, int]]


@dataclass
class Commit:
    """A streamed push's producer committed: the receiver may publish once every byte is in."""
    xfer: int


@dataclass
class EntryReady:
    """The entry a served pull waited for is here."""
    xfer: int
    entry: Entry


@dataclass
class EntryMissing:
    xfer: int
    error: KvdError


@dataclass
class Cancel:
    """End a transfer from our side (its entry was deleted, nobody waits for it, shutdown)."""
    xfer: int
    error: KvdError
    notify: bool = True


@dataclass
class ChannelLost:
    """The connection under a channel is gone (closed, peer restarted, silent past the heartbeat).
    Every transfer on it sees this event."""
    key: ChannelKey
    reason: str


@dataclass
class Tick:
    """Time passed. Every transfer sees this event."""
    now: float


@dataclass
class OpEnded:
    """A plane operation of ours ended: a write of slice seq (a push), or a read of it (a pull)."""
    xfer: int
    seq: int
    error: KvdError | None


LOCAL_EVENTS = (Connected, ConnectFailed, Written, Commit, EntryReady, EntryMissing, Cancel, ChannelLost, Tick,
                OpEnded)
Event = (p.Message | Connected | ConnectFailed | Written | Commit | EntryReady | EntryMissing | Cancel
         | ChannelLost | Tick | OpEnded)


# --- actions --------------------------------------------------------------------------------------

@dataclass
class Send:
    channel: Channel
    msg: p.Message


@dataclass
class SendChunk:
    """Send a chunk (or an offer carrying one) straight from pool memory: its frames are ZeroMQ's
    until its tracker is done."""
    transfer: Outbound
    msg: p.Chunk | p.Offer
    hold: object  # what PoolIO.outbound returned with the frames, for PoolIO.sent


@dataclass
class PostOp:
    """Start a plane operation: "write" our `local` pool ranges into the peer's `remote` ones (a push),
    or "read" its `remote` ones into our `local` (a pull); its end comes back as OpEnded(xfer, seq)."""
    transfer: Transfer
    seq: int
    op: str
    local: Ranges
    remote: Ranges


@dataclass
class Received:
    """nbytes of a chunk passed their check and are in the entry (counted, not yet published)."""
    transfer: Inbound
    nbytes: int


@dataclass
class WaitForEntry:
    transfer: Outbound
    deadline: float


@dataclass
class Progress:
    entry: Entry
    indices: list[int]


@dataclass
class Published:
    entry: Entry


@dataclass
class Dropped:
    entry: Entry
    error: KvdError


@dataclass
class Finished:
    """A transfer ended (error None: it succeeded); it is the last action about it, and comes once.
    An outbound's blocks stay pinned until ZeroMQ lets go of its frames: releasing them is the I/O
    layer's, by trackers."""
    transfer: Transfer
    error: KvdError | None


# (a row that fails returns Fail, which the machine turns into the abort, the drop and the Finished)
Action = Send | SendChunk | PostOp | Received | WaitForEntry | Progress | Published | Dropped | Finished | Fail


class Books:
    """What the transfer machine keeps, and what its handlers (`sending.py`, `receiving.py`, `onesided.py`,
    `failures.py`) read and change: the live transfers by id, the store's books, the pool's bytes
    through `io`, the limits and the clock. `Machine` is the one subclass: it adds walking the table."""

    def __init__(self, node_id: str, limits: Limits, store: Store, io: PoolIO, clock: Callable[[], float]) -> None:
        self.node_id = node_id
        self.limits = limits
        self.store = store
        self.io = io  # pool bytes <-> network buffers (direct for host pools, bounced for GPU pools)
        self.clock = clock
        self.transfers: dict[int, Transfer] = {}
