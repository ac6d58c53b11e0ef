"""The I/O of transfers on a one-sided plane (daemon process): plane operations the machine asks
for are posted and their ends fed back to it; what a plane may still touch after a failed transfer
is drained or parked (`kvd.daemon.plane.parking`) and let go of when that is over; `released` from a
peer, a peer gone for good, and our own operations stuck behind a frozen peer are handled here.
`transfers.Transfers` owns one and hands it the plane's actions, messages and ticks.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Container
from typing import Any

from kvd.errors import KvdError, NotFound, PeerUnavailable
from kvd.wire import protocol as p

from ..metrics import Metrics
from ..plane.parking import Drain, Hold, Parked, PlaneLedger
from ..plane.poller import PlaneOps
from ..store.entries import Store
from ..transfer.channel import Channel
from ..transfer.states import Event, Inbound, Kind, OpEnded, Outbound, PostOp, Transfer

log = logging.getLogger(__name__)

MAX_UNSAID = 4096  # `released` words kept per peer until its link is back


class PlaneIO:
    def __init__(self, ops: PlaneOps | None, store: Store, metrics: Metrics, handle: Callable[[Event], None],
                 send: Callable[[Channel, p.Message], object], link_up: Callable[[str], Channel | None],
                 transfer_timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ops = ops
        self.store = store
        self.metrics = metrics
        self._handle = handle  # feeds an event to the machine and carries out its actions
        self._send = send
        # our link to a peer, if its handshake is up (where a `released` reaches the peer's ledger: a
        # connection it forgot after a silence would drop it); None while it is not
        self._link_up = link_up
        self.transfer_timeout = transfer_timeout
        self.clock = clock
        self.ledger = PlaneLedger()
        self._unsaid: dict[str, set[int]] = {}  # peer -> the transfers whose `released` it has yet to hear

    def post(self, action: PostOp) -> None:
        transfer, seq = action.transfer, action.seq
        nbytes = sum(n for _, n in action.local)
        self.ledger.posted(transfer.xfer)

        def ended(error: KvdError | None) -> None:
            if error is None and isinstance(transfer, Outbound):
                self.metrics.tally["sent_bytes"] += nbytes
                self.metrics.transfer_bytes(transfer.channel.peer_name, "sent", nbytes)
            self._handle(OpEnded(transfer.xfer, seq, error))  # (a transfer that ended meanwhile ignores it)
            drained = self.ledger.op_ended(transfer.xfer)
            if drained is not None:
                self._let_go(drained)

        if self.ops is None or transfer.channel.plane_agent is None:  # (never: no plane, no plane transfers)
            from ..plane.base import PlaneError
            ended(PlaneError("this daemon has no plane"))
            return
        self.ops.post(action.op, transfer.channel.plane_agent, action.local, action.remote, ended)

    def failed(self, transfer: Transfer) -> None:
        """A transfer on a plane failed: what its memory may still be touched by waits for that to end."""
        agent = transfer.channel.plane_agent or ""
        entry = transfer.entry
        nbytes = entry.total_bytes if entry is not None else 0
        now = self.clock()
        xfer, request_id, channel = transfer.xfer, transfer.request_id, transfer.channel
        peer = channel.peer_name
        if isinstance(transfer, Outbound):
            if transfer.kind is Kind.PUSH:  # our writes from its blocks
                self._drain(Drain(xfer, agent, request_id, nbytes, lease_token=transfer.lease_token, since=now,
                                  peer=peer, channel=channel))
            elif entry is not None:  # a pull we lent to: the puller's reads of its blocks
                self.ledger.park(Parked(xfer, agent, request_id, nbytes, lease_token=transfer.lease_token, since=now,
                                        peer=peer, channel=channel))
            return
        if transfer.kind is Kind.PULL:  # our reads into its entry (or none yet): then say released
            self._drain(Drain(xfer, agent, request_id, nbytes, entry=entry, since=now, peer=peer, channel=channel))
        elif entry is not None:  # granted to the pusher: its writes into the entry
            self.ledger.park(Parked(xfer, agent, request_id, nbytes, entry=entry, since=now, peer=peer,
                                    channel=channel))

    def _drain(self, hold: Drain) -> None:
        ready = self.ledger.drain(hold)
        if ready is not None:
            self._let_go(ready)

    def on_message(self, channel: Channel, msg: p.Message, live: Container[int]) -> bool:
        """The plane's part of a peer message (`live`: the transfers running): True if it is the plane's
        alone. `released`, or a puller's `done` for a lent pull we ended meanwhile (it read every slice),
        let go of what we parked for it; an `abort` for a transfer we ended asks whether our plane is
        done with it: `released` answers when it is (else it comes once our operations end)."""
        if type(msg) is p.Released:
            self.released(channel, msg.xfer)
            return True
        xfer = getattr(msg, "xfer", 0)
        if channel.plane_agent is None or not xfer or xfer in live:
            return False
        if type(msg) is p.Done:
            self.released(channel, xfer)
        elif type(msg) is p.Abort and self.ledger.idle(xfer):
            self._send(channel, p.Released(xfer=xfer))
        return False

    def released(self, channel: Channel, xfer: int) -> None:
        """The peer's plane is done with what we granted or lent it for xfer."""
        if channel.plane_agent is None:
            return
        for parked in self.ledger.released(channel.plane_agent, xfer):
            self._let_go(parked)

    def peer_gone(self, agent: str) -> None:
        """A peer agent that is no more (its daemon restarted): nothing of it can touch our memory."""
        for parked in self.ledger.peer_gone(agent):
            self._let_go(parked)

    def tick(self, now: float, tear_down: Callable[[str], None]) -> None:
        """Say `released` to peers whose links are back; our operations of failed transfers still
        running a transfer timeout later (a frozen peer's plane may never end them): that peer is
        torn down, which ends them (then the link dials anew)."""
        for peer in list(self._unsaid):
            self._say_released(peer)
        for hold in self.ledger.to_ask(now, self.transfer_timeout):  # (its `released` may have been lost)
            channel = self._link_up(hold.peer) or hold.channel
            if isinstance(channel, Channel):
                self._send(channel, p.Abort(xfer=hold.xfer, code=PeerUnavailable.code,
                                            message="ended here: say released once your plane is done with it"))
        for agent in {hold.agent for hold in self.ledger.stuck(now - self.transfer_timeout)}:
            log.warning("plane operations towards %s still run %.0fs after their transfers failed: tearing its "
                        "connection down so that their blocks can be reused", agent, self.transfer_timeout)
            tear_down(agent)

    def _let_go(self, hold: Hold) -> None:
        if hold.entry is not None:
            self.store.release_writer(hold.entry)
        if hold.lease_token:
            with contextlib.suppress(NotFound):
                self.store.release(hold.lease_token, success=False)
        if isinstance(hold, Drain) and hold.peer:
            unsaid = self._unsaid.setdefault(hold.peer, set())
            if len(unsaid) < MAX_UNSAID:  # (a peer gone for good would never take them)
                unsaid.add(hold.xfer)
            self._say_released(hold.peer)

    def _say_released(self, peer: str) -> None:
        """On our link to the peer, once its handshake is up (each tick until then)."""
        channel = self._link_up(peer)
        if channel is None:
            return
        for xfer in self._unsaid.pop(peer, ()):
            self._send(channel, p.Released(xfer=xfer))

    def summary(self) -> dict[str, Any]:
        return self.ledger.summary()


def on_plane(transfer: Transfer) -> bool:
    """The transfer's bytes ride (or were to ride) a plane."""
    return transfer.plane is not None or (isinstance(transfer, Inbound) and transfer.kind is Kind.PULL
                                          and transfer.channel.plane is not None)
