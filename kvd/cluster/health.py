"""Registry health, pure (daemon process): the circuit breaker and the membership (session / resync)
state.

Runs in the daemon under member.py, and in routers (registry.py uses the breaker). No I/O: time comes
from an injectable clock, so the tests step it by hand.

- `Breaker`: after `threshold` consecutive failures the registry is known to be down and calls fail
  fast (design R5: a get must not spend its timeout discovering that again); every `retry_after`
  seconds one call goes through as a probe, and its success closes the breaker.
- `Backoff`: the doubling wait between attempts at something that keeps failing.
- `Membership`: whether this daemon is registered, and what it owes the registry. After a session
  loss (lease expired or revoked, server wiped) it must re-register *with the same incarnation* and
  re-publish a snapshot of its entries (R6); a name held by another live incarnation is never taken
  over (R7): it keeps trying quietly, and reports the conflict once the name has stayed taken for
  2 x TTL (a crashed predecessor's record lives at most that long).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]


class Breaker:
    def __init__(self, threshold: int = 3, retry_after: float = 2.0, clock: Clock = time.monotonic) -> None:
        self.threshold = threshold
        self.retry_after = retry_after
        self._clock = clock
        self.failures = 0  # consecutive
        self._next_probe = 0.0

    @property
    def state(self) -> str:
        if self.failures < self.threshold:
            return "closed"
        return "half_open" if self._clock() >= self._next_probe else "open"

    @property
    def up(self) -> bool:
        return self.failures < self.threshold

    def allow(self) -> bool:
        """May a call go to the registry now? While open, one probe per `retry_after`."""
        if self.failures < self.threshold:
            return True
        now = self._clock()
        if now >= self._next_probe:
            self._next_probe = now + self.retry_after
            return True
        return False

    def success(self) -> None:
        self.failures = 0

    def failure(self) -> None:
        self.failures += 1
        if self.failures == self.threshold:
            self._next_probe = self._clock() + self.retry_after


class Backoff:
    """A doubling wait: each failure pushes the next attempt out by twice the last delay, up to
    `maximum`; `reset` after a success starts over from `first`."""

    def __init__(self, first: float, maximum: float, clock: Clock = time.monotonic) -> None:
        self.first, self.maximum = first, maximum
        self.delay = first
        self._clock = clock
        self._next = 0.0

    def due(self) -> bool:
        return self._clock() >= self._next

    def failed(self) -> float:
        """Count a failure; returns how long to wait before the next attempt."""
        wait = self.delay
        self._next = self._clock() + wait
        self.delay = min(self.delay * 2, self.maximum)
        return wait

    def reset(self) -> None:
        self.delay = self.first
        self._next = 0.0


UNREGISTERED, REGISTERED, CONFLICT, CLOSED = "unregistered", "registered", "conflict", "closed"


@dataclass
class Membership:
    ttl: float
    clock: Clock = time.monotonic
    state: str = UNREGISTERED
    resync_needed: bool = False  # the registry lacks (or may lack) our records: re-publish a snapshot
    resyncs: int = 0  # completed re-publications, for kvd_registry_resyncs_total
    registrations: int = 0
    conflict_since: float | None = None
    conflict_reported: bool = False
    last_refresh: float = 0.0  # last time the server confirmed our session

    @property
    def registered(self) -> bool:
        return self.state == REGISTERED

    def on_registered(self) -> None:
        # a first registration also publishes: entries may predate the registry being reachable
        self.state = REGISTERED
        self.registrations += 1
        self.resync_needed = True
        self.conflict_since = None
        self.conflict_reported = False
        self.last_refresh = self.clock()

    def on_conflict(self) -> bool:
        """Another incarnation holds our node id. True once, when it has done so for 2 x TTL:
        the moment to log the error (it is a live duplicate, not our own crashed predecessor)."""
        now = self.clock()
        self.state = CONFLICT
        if self.conflict_since is None:
            self.conflict_since = now
        if not self.conflict_reported and now - self.conflict_since >= 2 * self.ttl:
            self.conflict_reported = True
            return True
        return False

    def on_refreshed(self) -> None:
        self.last_refresh = self.clock()

    def on_refresh_failed(self) -> bool:
        """The server did not answer a keepalive. True when the session must be presumed lost: no
        confirmation for a whole TTL means the lease has expired there (or will before we reach it)."""
        if self.state == REGISTERED and self.clock() - self.last_refresh >= self.ttl:
            self.on_session_lost()
            return True
        return False

    def on_session_lost(self) -> None:
        if self.state != CLOSED:
            self.state = UNREGISTERED

    def on_resynced(self) -> None:
        self.resync_needed = False
        self.resyncs += 1

    def close(self) -> None:
        self.state = CLOSED
