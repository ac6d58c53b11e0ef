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
from typing import TYPE_CHECKING

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


@dataclass(eq=False)
class Drain(Hold):
    """Ours: release once our operations of xfer ended, then tell the peer `released`."""

    peer: str = ""  # the peer's name, whose link the word goes on


@dataclass(eq=False)
class Parked(Hold):
    """The peer's: release when it says `released`, or is gone."""


@dataclass
class PlaneLedger:
    running: dict[int, int] = field(default_factory=dict)  # xfer -> our operations of it still running
    draining: dict[int, Drain] = field(default_factory=dict)  # ended transfers waiting for their operations
    parked: dict[tuple[str, int], Parked] = field(default_factory=dict)  # (peer agent, xfer) -> what it may touch

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
        self.parked[(hold.agent, hold.xfer)] = hold

    def released(self, agent: str, xfer: int) -> Parked | None:
        """The peer's word that its plane is done with what we granted or lent for xfer."""
        return self.parked.pop((agent, xfer), None)

    def peer_gone(self, agent: str) -> list[Parked]:
        """That peer agent is gone for good (it restarted): everything parked for it."""
        gone = [key for key in self.parked if key[0] == agent]
        return [self.parked.pop(key) for key in gone]

    def stuck(self, older_than: float) -> list[Drain]:
        """Drains still waiting on our operations since before `older_than` (a frozen peer's plane
        may never finish them: the I/O layer tears that peer down, which ends them)."""
        return [hold for hold in self.draining.values() if hold.since < older_than]

    def summary(self) -> dict:
        by_peer: dict[str, dict] = {}
        for hold in self.parked.values():
            peer = by_peer.setdefault(hold.agent, {"parked": 0, "parked_bytes": 0, "oldest": hold.since})
            peer["parked"] += 1
            peer["parked_bytes"] += hold.nbytes
            peer["oldest"] = min(peer["oldest"], hold.since)
        return {"ops_running": sum(self.running.values()), "draining": len(self.draining),
                "parked": len(self.parked), "parked_bytes": sum(h.nbytes for h in self.parked.values()),
                "parked_by_peer": by_peer}
