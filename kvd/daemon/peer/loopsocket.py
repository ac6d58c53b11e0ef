"""A plain (synchronous) ZeroMQ socket driven by the asyncio loop: the daemon process's peer sockets.

zmq.asyncio wraps every receive and send in a Future, which costs tens of microseconds
per message; here the loop watches the socket's file descriptor and a callback drains
every queued message at once, handing each to `on_message` synchronously. Sends go out
immediately (non-blocking); one that cannot (no connected peer yet, for a DEALER with
IMMEDIATE) waits in a queue, in order, until the socket is writable.

ZeroMQ's descriptor is edge-triggered and any socket operation can consume the edge, so
after every send we ask the socket (EVENTS) whether input is waiting, and if so read it on the
next loop iteration.

ZeroMQ bounds what it queues for a connection by a count of messages (SNDHWM), whatever their
size; `owed.Backlog` counts the bytes instead (`on_taken` says what ZeroMQ took, on a socket
whose sends may wait here first).
"""
from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

import zmq

log = logging.getLogger(__name__)

MAX_BATCH = 256  # messages handled per wake-up before yielding to other work
# a send ZeroMQ cannot take yet (no connected peer) is retried, backing off: the descriptor
# fires when a connection comes up anyway, and an unreachable peer must not cost a busy loop
RETRY_FIRST, RETRY_MAX = 0.001, 0.5  # seconds
MAX_PENDING = 10_000  # sends waiting for a socket that takes none: past this they fail
# pyzmq's constants are enums; each `|` or lookup on them costs more than the socket call (and a
# receive that finds nothing raises zmq.Again, which costs more still): ask EVENTS, with ints
_NOBLOCK, _SNDMORE, _RCVMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE), int(zmq.RCVMORE)
# (get() is typed int | bytes for any option; EVENTS is an int one, and an int() per call would cost)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_NOBLOCK_MORE = _NOBLOCK | _SNDMORE
_send_frame = zmq.backend.Socket.send  # pyzmq's own, under the sugar layer's per-call checks


def send_parts(sock: zmq.Socket, frames: list, copy: bool, track: bool):
    """send_multipart(frames, NOBLOCK), without its per-part type checks and enum flag arithmetic
    (each costs more than the send itself for a small message). Frames are bytes or memoryviews.
    ZeroMQ takes the parts after the first without Again (a message is admitted whole or not at
    all); with track, the tracker returned is the last part's, as send_multipart's is (libzmq lets
    go of a message's parts in order)."""
    last = len(frames) - 1
    for i in range(last):
        _send_frame(sock, frames[i], _NOBLOCK_MORE, copy, track)
    return _send_frame(sock, frames[last], _NOBLOCK, copy, track)


class Sent:
    """What `send` returns for a message ZeroMQ took at once (the usual case): the part of an
    asyncio.Future's interface the callers use, without a loop callback per message."""

    __slots__ = ("_result",)

    def __init__(self, result) -> None:
        self._result = result  # a MessageTracker (track=True), else None

    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> bool:
        return False

    def exception(self) -> None:
        return None

    def result(self):
        return self._result

    def add_done_callback(self, callback) -> None:
        callback(self)  # done already: now (asyncio would call it on the next loop iteration)


class NotSent:
    """What a send returns for a message it dropped without handing it to ZeroMQ (the connection it
    was for has been cut): cancelled, as a queued send is when its socket closes."""

    __slots__ = ()

    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return True

    def cancel(self) -> bool:
        return False

    def exception(self):
        raise asyncio.CancelledError()

    def result(self):
        raise asyncio.CancelledError()

    def add_done_callback(self, callback) -> None:
        callback(self)


NOT_SENT = NotSent()

class LoopSocket:
    def __init__(self, sock: zmq.Socket, on_message: Callable[[list], None], copy: bool = True,
                 fail_when_full: bool = False, max_pending: int = MAX_PENDING,
                 on_taken: Callable[[list], None] | None = None) -> None:
        """fail_when_full: a send ZeroMQ cannot take fails at once (a ROUTER whose peer's queue is
        full: waiting would hold up every other peer behind it); else it waits its turn, up to
        max_pending sends (a link that is not up yet). on_taken: told of every message ZeroMQ takes
        (at once, or from the queue here), so that what it holds is counted."""
        self.sock = sock
        self._fail_when_full = fail_when_full
        self._max_pending = max_pending
        self._on_message = on_message
        self._copy = copy
        self._loop = asyncio.get_running_loop()
        self._pending: collections.deque = collections.deque()  # (frames, copy, track, future)
        self._check_scheduled = False
        self._retry_scheduled = False
        self._retry_delay = RETRY_FIRST
        self._closed = False
        self.on_taken = on_taken
        self._loop.add_reader(sock.FD, self._on_fd)
        self._schedule_check()

    # --- receiving --------------------------------------------------------------------------------

    def _on_fd(self) -> None:
        if self._closed:
            return
        self._flush_pending()
        sock, copy = self.sock, self._copy
        handled = 0
        while handled < MAX_BATCH:
            try:
                if not sock.get(_EVENTS) & _POLLIN:  # type: ignore[operator]  # (an int option; see _EVENTS)
                    return
                frames = [sock.recv(_NOBLOCK, copy=copy)]
                while sock.get(_RCVMORE):  # (a message's parts arrive together)
                    frames.append(sock.recv(_NOBLOCK, copy=copy))
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                if self._closed or exc.errno in (zmq.ENOTSOCK, zmq.ETERM):
                    return
                log.warning("receive failed: %s", exc)
                return
            handled += 1
            try:
                self._on_message(frames)
            except Exception:
                log.exception("message handler failed")
            if self._closed:
                return
        self._schedule_check()  # more may be queued: continue after others had a turn

    def _schedule_check(self) -> None:
        if not self._check_scheduled and not self._closed:
            self._check_scheduled = True
            self._loop.call_soon(self._check)

    def _check(self) -> None:
        self._check_scheduled = False
        if not self._closed:
            self._on_fd()

    # --- sending -----------------------------------------------------------------------------------

    def send(self, frames: list, copy: bool = True, track: bool = False) -> asyncio.Future | Sent:
        """Send now if possible; the future resolves (to a MessageTracker with track) once ZeroMQ
        has it: a `Sent`, done already, when it took the message at once."""
        if not self._pending and not self._closed:
            try:
                result = send_parts(self.sock, frames, copy, track)
            except zmq.ZMQError:
                pass  # (Again, or an error: the general path below says which)
            else:
                self._retry_delay = RETRY_FIRST
                self._check_input()
                if self.on_taken is not None:
                    self.on_taken(frames)
                return Sent(result)
        future = self._loop.create_future()
        if self._closed:
            future.set_exception(zmq.ZMQError(zmq.ENOTSOCK, "socket closed"))
            return future
        if len(self._pending) >= self._max_pending:
            future.set_exception(zmq.Again(zmq.EAGAIN, f"{len(self._pending)} sends already wait for this socket"))
        elif self._pending:
            self._pending.append((frames, copy, track, future))
        else:
            self._try_send(frames, copy, track, future)
        self._schedule_check()
        return future

    def _check_input(self) -> None:
        """A send may have taken the descriptor's edge for input that arrived meanwhile: look."""
        try:
            if self.sock.get(_EVENTS) & _POLLIN:  # type: ignore[operator]  # (an int option; see _EVENTS)
                self._schedule_check()
        except zmq.ZMQError:
            self._schedule_check()

    @property
    def backlog(self) -> int:
        """Messages waiting for the socket to accept them."""
        return len(self._pending)

    def send_now(self, frames: list) -> None:
        """Fire and forget (control replies): a message that cannot go now is queued the same way."""
        self.send(frames).add_done_callback(_ignore_result)

    def _try_send(self, frames: list, copy: bool, track: bool, future: asyncio.Future) -> bool:
        try:
            result = send_parts(self.sock, frames, copy, track)
        except zmq.Again as exc:
            if self._fail_when_full:
                future.set_exception(exc)
                return True
            self._pending.appendleft((frames, copy, track, future))
            if not self._retry_scheduled:
                self._retry_scheduled = True
                self._loop.call_later(self._retry_delay, self._retry)
                self._retry_delay = min(2 * self._retry_delay, RETRY_MAX)
            return False
        except zmq.ZMQError as exc:
            future.set_exception(exc)
            return True
        self._retry_delay = RETRY_FIRST
        if self.on_taken is not None:
            self.on_taken(frames)
        future.set_result(result)
        return True

    def _retry(self) -> None:
        self._retry_scheduled = False
        self._flush_pending()

    def _flush_pending(self) -> None:
        while self._pending and not self._closed:
            frames, copy, track, future = self._pending.popleft()
            if future.done():
                continue
            if not self._try_send(frames, copy, track, future):
                return

    def close(self, linger: int | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self.sock.FD)
        for _, _, _, future in self._pending:
            future.cancel()  # never sent; whoever waits on it sees CancelledError
        self._pending.clear()
        self.sock.close(linger)


def _ignore_result(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.debug("send failed: %s", future.exception())
