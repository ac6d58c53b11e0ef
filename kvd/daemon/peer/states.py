"""What a transfer between daemons is (daemon process): its states, the events that move it, the
actions it asks for, and `TRANSITIONS`, the one table of legal moves. Plain data: the logic that
walks the table is `machine.py`."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Union

from kvd.errors import KvdError
from kvd.wire import protocol as p

from ..store.entries import Entry
from .channel import Channel
from .window import ReceiveLedger, SendWindow


class SenderState(enum.Enum):
    WAITING = "waiting"  # a pull asked for an entry that is not here yet
    CONNECTING = "connecting"  # a push waits for its link's handshake; bytes written meanwhile queue up
    OFFERED = "offered"  # offer and the eager chunks sent; no accept yet
    SENDING = "sending"  # accepted: the whole window flows
    DONE = "done"  # the receiver has verified every byte
    FAILED = "failed"


class ReceiverState(enum.Enum):
    PULLING = "pulling"  # we asked a holder for an entry; no offer yet
    RECEIVING = "receiving"  # room reserved; chunks arriving
    DONE = "done"  # every byte verified and published
    FAILED = "failed"


@dataclass(eq=False)
class Outbound:
    """A transfer we send: a push, or a pull we serve."""

    xfer: int
    channel: Channel
    request_id: str
    state: SenderState
    entry: Entry | None = None  # None while WAITING
    lease_token: int = 0  # the lease on entry this transfer holds (its claim ends when it does)
    window: SendWindow | None = None
    sealed: bool = True  # a stream's receiver publishes only once this is set and said (seal)
    pull: p.Pull | None = None  # the request, for a pull we serve
    deadline: float = 0.0
    started: float = field(default_factory=time.monotonic)
    sends: list = field(default_factory=list)  # (transfers.py) chunk send futures, for their trackers
    cut: bool = False  # (transfers.py) its connection was cut to make ZeroMQ let go of its frames
    outcome: object = None  # (transfers.py) a push's future: resolves when it ends
    on_end: list = field(default_factory=list)  # (transfers.py) called with its error (or None) as it ends

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
    """A transfer we receive: pushed to us, or pulled by us."""

    xfer: int
    channel: Channel
    request_id: str
    state: ReceiverState
    pulled: bool = False  # we asked for it: a get waits for the outcome
    entry: Entry | None = None  # None until the offer
    ledger: ReceiveLedger | None = None
    sealed: bool = True
    checksum: str = "none"
    eager: bool = False  # every chunk came unasked (a small sealed entry): no accept, no acks, just done
    deadline: float = 0.0
    started: float = field(default_factory=time.monotonic)
    outcome: object = None  # (transfers.py) a pull's future: resolves to the published entry


Transfer = Union[Outbound, Inbound]


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
    """The connection under a channel is gone (closed, peer restarted, silent past the heartbeat)."""
    key: tuple
    reason: str


@dataclass
class Tick:
    """Time passed: fail transfers without progress for transfer_timeout."""
    now: float


@dataclass
class Deadline:
    """(A transfer's own no-progress deadline passed; Tick raises it.)"""


Event = Union[p.Message, Connected, ConnectFailed, Written, Commit, EntryReady, EntryMissing, Cancel,
              ChannelLost, Tick]


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
    """A transfer ended (error None: it succeeded). An outbound's blocks stay pinned until
    ZeroMQ lets go of its frames: releasing them is the I/O layer's, by trackers."""
    transfer: Transfer
    error: KvdError | None


Action = Union[Send, SendChunk, WaitForEntry, Progress, Published, Dropped, Finished]

# --- the table ----------------------------------------------------------------------------------

S, R = SenderState, ReceiverState
_ENDINGS = {p.Abort: {S.FAILED, R.FAILED}, Cancel: {S.FAILED, R.FAILED}, ChannelLost: {S.FAILED, R.FAILED},
            Deadline: {S.FAILED, R.FAILED}}
# state -> {event: the states it may lead to}; FAILED is always possible (any event may fail a transfer)
TRANSITIONS: dict[enum.Enum, dict[type, set[enum.Enum]]] = {
    S.WAITING: {EntryReady: {S.OFFERED}, EntryMissing: {S.FAILED}, **_ENDINGS},
    S.CONNECTING: {Connected: {S.OFFERED}, ConnectFailed: {S.FAILED}, Written: {S.CONNECTING},
                   Commit: {S.CONNECTING}, Cancel: {S.FAILED}, ChannelLost: {S.CONNECTING}},
    S.OFFERED: {p.Accept: {S.SENDING}, p.Done: {S.DONE}, Written: {S.OFFERED}, Commit: {S.OFFERED}, **_ENDINGS},
    S.SENDING: {p.ChunkAck: {S.SENDING}, p.Done: {S.DONE}, Written: {S.SENDING}, Commit: {S.SENDING},
                **_ENDINGS},
    R.PULLING: {p.Offer: {R.RECEIVING, R.DONE}, **_ENDINGS},
    R.RECEIVING: {p.Chunk: {R.RECEIVING, R.DONE}, p.Seal: {R.RECEIVING, R.DONE}, **_ENDINGS},
}
TERMINAL = {S.DONE, S.FAILED, R.DONE, R.FAILED}
