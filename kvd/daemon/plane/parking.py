"""What a one-sided plane may still do to pool memory after the transfer that asked for it ended
(daemon process): pure bookkeeping, no sockets, no plane.

A one-sided operation cannot be called back. So when a transfer on a plane fails:
- where OUR plane was at work (a push's writes into the peer's ranges, a pull's reads into our
  entry), its blocks stay pinned until our operations of it have ended; then the pin goes and the
  peer is told `released`, so that it can let go of what it granted or lent us;
- where the PEER's plane was (its writes into ranges we granted, its reads of blocks we lent), they
  stay parked until the peer says `released`, or until that peer is gone for good (a new incarnation
  of it said hello: the old process, and whatever it had posted, is no more).
A parked block is never given to anyone else: a peer stalled mid-write keeps it (`kvd status` shows
how much and for whom) rather than write into someone else's entry when it wakes.

`Drain` and `Parked` say what to release; the I/O layer (`peer/transfers.py`) releases it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..store.entry import Entry


@dataclass(eq=False)
class Hold:
    """What pins a transfer's blocks for a plane: the entry's writer pin (a receiver's), or a
    sender's lease on its entry (`lease_token`)."""

    xfer: int
    agent: str  # the peer's agent on the plane
    request_id: str
    nbytes: int
    entry: Entry | None = None  # an entry whose writer pin to release
    lease_token: int = 0  # else a lease to release
    since: float = 0.0
    peer: str = ""  # the peer's name: our link to it carries what we say of the hold
    channel: object = None  # the transfer's channel, where a link to the peer is not up


@dataclass(eq=False)
class Drain(Hold):
    """Ours: release once our operations of xfer ended, then tell the peer `released`."""


@dataclass(eq=False)
class Parked(Hold):
    """The peer's: release when it says `released` (or `done`, a puller's word that it read all), or
    is gone. Asked again every so often: a `released` lost with a connection would park it for good."""

    asked: float = 0.0  # when we last asked the peer whether its plane is done with it


@dataclass
class PlaneLedger:
    running: dict[int, int] = field(default_factory=dict)  # xfer -> our operations of it still running
    draining: dict[int, Drain] = field(default_factory=dict)  # ended transfers waiting for their operations
    # (peer agent, xfer) -> what its plane may touch (more than one only if a peer reused an id)
    parked: dict[tuple[str, int], list[Parked]] = field(default_factory=dict)

    def posted(self, xfer: int) -> None:
        self.running[xfer] = self.running.get(xfer, 0) + 1

    def op_ended(self, xfer: int) -> Drain | None:
        """One of our operations ended: the drain it completes, if any."""
        left = self.running.get(xfer, 0) - 1
        if left > 0:
            self.running[xfer] = left
            return None
        self.running.pop(xfer, None)
        return self.draining.pop(xfer, None)

    def drain(self, hold: Drain) -> Drain | None:
        """A failed transfer of ours: returned at once if none of its operations runs, else kept until
        the last one ends (`op_ended`)."""
        if self.running.get(hold.xfer, 0) == 0:
            return hold
        self.draining[hold.xfer] = hold
        return None

    def park(self, hold: Parked) -> None:
        self.parked.setdefault((hold.agent, hold.xfer), []).append(hold)

    def released(self, agent: str, xfer: int) -> list[Parked]:
        """The peer's word that its plane is done with what we granted or lent for xfer."""
        return self.parked.pop((agent, xfer), [])

    def peer_gone(self, agent: str) -> list[Parked]:
        """That peer agent is gone for good (it restarted): everything parked for it."""
        gone = [key for key in self.parked if key[0] == agent]
        return [hold for key in gone for hold in self.parked.pop(key)]

    def idle(self, xfer: int) -> bool:
        """None of our operations of xfer runs, nor waits to: our plane is done with it."""
        return xfer not in self.running and xfer not in self.draining

    def to_ask(self, now: float, every: float) -> list[Parked]:
        """Holds parked for `every` seconds since they were parked or last asked about (marked asked)."""
        due = [hold for holds in self.parked.values() for hold in holds if max(hold.since, hold.asked) <= now - every]
        for hold in due:
            hold.asked = now
        return due

    def stuck(self, older_than: float) -> list[Drain]:
        """Drains still waiting on our operations since before `older_than` (a frozen peer's plane
        may never finish them: the I/O layer tears that peer down, which ends them)."""
        return [hold for hold in self.draining.values() if hold.since < older_than]

    def summary(self) -> dict[str, Any]:
        by_peer: dict[str, dict[str, Any]] = {}
        holds = [hold for each in self.parked.values() for hold in each]
        for hold in holds:
            peer = by_peer.setdefault(hold.agent, {"parked": 0, "parked_bytes": 0, "oldest": hold.since})
            peer["parked"] += 1
            peer["parked_bytes"] += hold.nbytes
            peer["oldest"] = min(peer["oldest"], hold.since)
        return {"ops_running": sum(self.running.values()), "draining": len(self.draining),
                "parked": len(holds), "parked_bytes": sum(h.nbytes for h in holds), "parked_by_peer": by_peer}
