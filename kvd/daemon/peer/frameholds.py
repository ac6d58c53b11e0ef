"""Blocks ZeroMQ may still send from (daemon process): a sender's blocks are reused only once
ZeroMQ lets go of every frame sent from them, whatever ended the transfer: a receiver's `done` is its
word, not proof that our frames left. A peer that leaves frames queued past transfer_timeout has its
TCP connection cut, which makes ZeroMQ drop them; no timer ever frees blocks ZeroMQ may still send from.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvd.errors import NotFound

from ..store.entries import Store
from ..transfer.channel import Channel, Sending
from ..transfer.states import Outbound

log = logging.getLogger(__name__)

# a finished send whose frames ZeroMQ still holds is checked again after this, doubling up to the
# housekeeping interval (its pyzmq trackers complete a few microseconds to milliseconds after done)
DEFERRED_FIRST, DEFERRED_MAX = 0.002, 0.2


@dataclass(eq=False)
class _Sent:
    """An ended send whose frames ZeroMQ may still hold: its blocks stay pinned until it lets go."""

    lease_token: int
    channel: Channel
    request_id: str
    sends: list[Sending]  # the chunk send futures (resolving to MessageTrackers)
    cut_at: float  # its connection is cut if ZeroMQ still holds them then
    cut: bool = False


def zmq_released(sends: list[Sending]) -> bool:
    """True once ZeroMQ holds no reference to any frame of these sends (safe to reuse the blocks)."""
    for sent in sends:
        if not sent.done():
            return False
        if not sent.cancelled() and sent.exception() is None and not sent.result().done:
            return False
    return True


class FrameHolds:
    def __init__(self, store: Store, transfer_timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.transfer_timeout = transfer_timeout
        self.clock = clock
        self._deferred: list[_Sent] = []  # ended sends whose frames ZeroMQ may still hold
        self._deferred_check: asyncio.TimerHandle | None = None
        self._deferred_delay = DEFERRED_FIRST

    def close(self) -> None:
        if self._deferred_check is not None:
            self._deferred_check.cancel()
    def unpin_when_sent(self, out: Outbound, sends: list[Sending]) -> None:
        if zmq_released(sends):
            self._unpin(out.lease_token)
            return
        # its connection is cut if ZeroMQ still holds the frames a transfer timeout from now
        self._deferred.append(_Sent(out.lease_token, out.channel, out.request_id, sends,
                                    self.clock() + self.transfer_timeout))
        self._schedule_deferred_check()

    def _unpin(self, lease_token: int) -> None:
        with contextlib.suppress(NotFound):
            self.store.release(lease_token, success=False)

    def _schedule_deferred_check(self) -> None:
        if self._deferred_check is None:
            self._deferred_check = asyncio.get_running_loop().call_later(self._deferred_delay,
                                                                         self._release_deferred)
            self._deferred_delay = min(2 * self._deferred_delay, DEFERRED_MAX)

    def _release_deferred(self) -> None:
        self._deferred_check = None
        still = []
        now = self.clock()
        for sent in self._deferred:
            if zmq_released(sent.sends):
                self._unpin(sent.lease_token)
                continue
            still.append(sent)
            if now >= sent.cut_at and not sent.cut:
                sent.cut = True
                log.warning("peer %s has not taken the last frames of %s %.0fs after its transfer ended: "
                            "closing its connection so that the blocks can be reused", sent.channel.peer_name,
                            sent.request_id, self.transfer_timeout)
                sent.channel.cut()
        self._deferred = still
        if still:
            self._schedule_deferred_check()
        else:
            self._deferred_delay = DEFERRED_FIRST
