"""Which KV tier pages came and went, per namespace, for the clients that follow it (daemon process;
pure bookkeeping, no I/O).

A client that follows a namespace (a vLLM connector announcing to KV-aware routers the blocks kvd
holds for its engine) asks `cache_events(namespace, epoch, since)` now and then, and is answered
with the pages stored and removed (evicted, cleared, dropped) since its last answer: one request
per poll, never one per page. A log is kept only for a namespace somebody followed within the
last IDLE seconds, at most MAX_FOLLOWED of them, and holds its last CAPACITY events: a follower
that fell further behind, or whose epoch is not the log's (the daemon restarted, or the log was
dropped while nobody read it), is told `lost` and must assume any page it knew of may be gone.
"""
from __future__ import annotations

import collections
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvd.errors import BadRequest

STORED, REMOVED = "stored", "removed"
CAPACITY = 8192  # events kept per followed namespace
MAX_FOLLOWED = 32  # namespaces with a log; the one read least recently goes first
MAX_REPLY = 2048  # events per answer (a key is at most 256 characters: the reply stays under 1 MiB)
IDLE = 120.0  # seconds without a read after which a namespace's log is dropped


@dataclass
class _Log:
    epoch: int  # this log's identity: a follower of another log has lost its place
    first: int  # the sequence number of events[0]
    read_at: float
    events: collections.deque[tuple[str, str]] = field(default_factory=collections.deque)  # (kind, key), oldest first

    @property
    def next(self) -> int:
        return self.first + len(self.events)


class TierEvents:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._logs: dict[str, _Log] = {}

    def note(self, namespace: str, kind: str, key: str) -> None:
        """A page of `namespace` was stored (visible) or removed (no longer served)."""
        log = self._logs.get(namespace)
        if log is None:
            return
        log.events.append((kind, key))
        if len(log.events) > CAPACITY:
            log.events.popleft()
            log.first += 1

    def read(self, namespace: str, epoch: object, since: object) -> dict[str, Any]:
        """What was noted since `since` in the follower's log `epoch` (0: a new follower, which is
        told where the log stands now); follows the namespace from now on."""
        if type(epoch) is not int or type(since) is not int or epoch < 0 or since < 0:
            raise BadRequest(f"cache_events: epoch and since are non-negative ints, got {epoch!r}, {since!r}")
        now = self._clock()
        for name in [n for n, log in self._logs.items() if now - log.read_at > IDLE]:
            del self._logs[name]
        log = self._logs.get(namespace)
        if log is None:
            if len(self._logs) >= MAX_FOLLOWED:
                del self._logs[min(self._logs, key=lambda n: self._logs[n].read_at)]
            log = self._logs[namespace] = _Log(random.getrandbits(48) | 1, 0, now)
        log.read_at = now
        if epoch == 0 or epoch != log.epoch or since > log.next:
            # a new follower starts where the log stands; one of another log, or ahead of this one
            # (a log dropped and made anew), has lost its place and starts there too
            return {"epoch": log.epoch, "next": log.next, "events": [], "lost": epoch != 0}
        lost = since < log.first  # fell behind: what was noted before log.first is gone
        start = max(since, log.first) - log.first
        events = [list(e) for e in itertools.islice(log.events, start, start + MAX_REPLY)]
        return {"epoch": log.epoch, "next": log.first + start + len(events), "events": events, "lost": lost}

    def followed(self) -> int:
        return len(self._logs)

