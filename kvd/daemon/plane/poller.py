"""A plane's operations run from the event loop (daemon process): posted, polled until they end,
each end reported once.

A plane tells of an operation's end only when asked (NIXL's `check_xfer_state`), so running ones
are polled: at once (a turn of the loop) while the youngest is under SPIN seconds old, since a small
write ends within ~100 µs; then every POLL seconds, which costs one call per operation and bounds
how late a long one is seen (a 16 MiB slice takes ~8 ms at 2 GB/s). No thread: NIXL's agent is not
thread-safe as kvd builds it, and every call into it is made from the loop.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

from kvd.errors import KvdError

from .base import DataPlane, OpState, PlaneError, Ranges

log = logging.getLogger(__name__)

SPIN = 0.0003  # seconds an operation is polled on every turn of the loop after it was posted
POLL = 0.001  # then every this long
# tests: each operation is posted this many seconds after it was asked for (a sender slowed enough that a
# fault lands mid-transfer for certain); read once at start, nothing of it runs otherwise
DELAY_ENV = "KVD_TEST_PLANE_POST_DELAY"

Done = Callable[[KvdError | None], None]


class PlaneOps:
    def __init__(self, plane: DataPlane, clock: Callable[[], float] = time.monotonic, delay: float = 0.0) -> None:
        self.plane = plane
        self.clock = clock
        self.delay = delay
        self._running: dict[object, tuple[Done, str]] = {}  # handle -> (its callback, its peer)
        self._last_post = 0.0
        self._timer: asyncio.TimerHandle | asyncio.Handle | None = None
        self._soon = False  # the pending poll is for the next turn of the loop

    def post(self, op: str, agent: str, local: Ranges, remote: Ranges, done: Done) -> None:
        """Start `op` ("write" or "read"); `done(None or the error)` is called once, from the loop, as
        it ends (never from inside this call)."""
        if self.delay:
            asyncio.get_running_loop().call_later(self.delay, self._start, op, agent, local, remote, done)
        else:
            self._start(op, agent, local, remote, done)

    def _start(self, op: str, agent: str, local: Ranges, remote: Ranges, done: Done) -> None:
        loop = asyncio.get_running_loop()
        try:
            handle = self.plane.post(op, agent, local, remote)
        except KvdError as exc:
            loop.call_soon(done, exc)
            return
        self._running[handle] = (done, agent)
        self._last_post = self.clock()
        self._schedule(loop, soon=True)

    @classmethod
    def from_env(cls, plane: DataPlane) -> PlaneOps:
        return cls(plane, delay=float(os.environ.get(DELAY_ENV, "0") or 0))

    def _schedule(self, loop: asyncio.AbstractEventLoop, soon: bool) -> None:
        """Poll on the next turn (soon) or in POLL seconds; a poll already due first stays."""
        if self._timer is not None:
            if self._soon or not soon:
                return
            self._timer.cancel()
        self._soon = soon
        self._timer = loop.call_soon(self._poll) if soon else loop.call_later(POLL, self._poll)

    def _poll(self) -> None:
        self._timer = None
        for handle, (done, agent) in list(self._running.items()):
            state = self.plane.state(handle)
            if state is OpState.RUNNING:
                continue
            del self._running[handle]
            self.plane.release(handle)
            error = None if state is OpState.DONE else PlaneError(f"the {self.plane.name} operation towards "
                                                                  f"{agent} failed")
            try:
                done(error)
            except Exception:  # one caller's failure must not keep the others from hearing
                log.exception("a plane operation's callback failed")
        if self._running:
            self._schedule(asyncio.get_running_loop(), soon=self.clock() - self._last_post < SPIN)

    @property
    def running(self) -> int:
        return len(self._running)

    def close(self) -> None:
        """Shutting down: no more polls; what still runs is the plane's to end as it closes."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._running.clear()
