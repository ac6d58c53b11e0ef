"""Transfers between daemons as a state machine (daemon process): events in, actions out.

Every transfer is in one state (`states.py`), and `table.TABLE` decides what each event does in
each state and which state follows: `_advance` looks the row up, runs its handler and assigns
the state; handlers never do. The handlers are plain functions of the machine's books
(`sending.py`, `receiving.py`, a link's one-sided plane in `onesided.py`, the rows that fail in
`failures.py`); `Machine` is the only code that changes a transfer's state: `start_push`,
`start_pull` and `handle(event)` return the `Action`s to carry out (messages to send, chunks to
send from the pool, what ended and how), and `transfers.py` carries them out with sockets and
tasks, and counts them. It keeps the store's books and reads and writes pool bytes through the
PoolIO it is given (memory, not I/O), and reads time only from its clock, so two machines can be
run against each other through in-memory channels, deterministically; `validate()` checks what
must hold between any two events, and names a broken invariant with its transfer's `story`, the
machine's log of recent transitions (`kvd.statetable.Story`).
    push:  S: offer ────────▶ R            pull:  P: pull ───────▶ H  (H sends, as in a push)
           S: chunk 0, 1 ───▶ R   (eager: before accept; a small sealed entry needs nothing more)
           S ◀─────── accept :R
           S: chunk 2..W-1 ─▶ R ; S ◀── chunk_ack :R (each opens the window by one)
           S ◀───────── done :R   (every byte verified; the entry is published on R)
"""
from __future__ import annotations

import collections
import contextlib
import logging
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvd.errors import KvdError, NotFound, ProtocolError
from kvd.memory.io import PoolIO
from kvd.statetable import Fail, InvariantBroken, Story
from kvd.wire import protocol as p

from ..store.entries import Store
from ..store.entry import Entry
from .channel import Channel
from .invariants import check_machine
from .limits import Limits
from .receiving import peer_ttl
from .sending import EAGER_CHUNKS, MAX_PULL_WAIT
from .states import (
    NONE,
    TERMINAL,
    Action,
    Books,
    ChannelLost,
    Dropped,
    Event,
    Finished,
    Inbound,
    Kind,
    Outbound,
    R,
    S,
    Send,
    Tick,
    Transfer,
)
from .table import TABLE, Handler, TransferState
from .window import SendWindow

__all__ = ["EAGER_CHUNKS", "MAX_PULL_WAIT", "Limits", "Machine", "peer_ttl"]
RECENT_FAILURES = 8  # failed transfers whose stories `kvd status --debug` shows
log = logging.getLogger(__name__)

_NO_XFER = -1  # the id of no transfer (ids are 63 random bits): what an event without one is looked up by
_FAILED = frozenset({S.FAILED, R.FAILED})
# (state, event type) -> its rows' (guard's test, handler, next state), in order; the next state is a
# side's own (test_table holds each side to its states), which the engine's Enum does not say
_STEPS: Mapping[tuple[TransferState, object], tuple[tuple[Callable[[Any, Any], bool] | None, Handler, Any], ...]] = \
    TABLE.compile()


class Machine(Books):
    def __init__(self, node_id: str, limits: Limits, store: Store, io: PoolIO,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """clock: the time every deadline and duration is read from; the store's (time.monotonic),
        where entries have a ttl (an offer says what is left of it)."""
        super().__init__(node_id, limits, store, io, clock)
        # the recent transitions of every transfer, for a post-mortem (states, event type names, times: no payload)
        self.story = Story()
        self.failed: collections.deque[int] = collections.deque(maxlen=RECENT_FAILURES)  # ids, newest last

    # --- starting -------------------------------------------------------------------------------

    def start_push(self, entry: Entry, lease_token: int, channel: Channel,
                   sealed: bool) -> tuple[Outbound, list[Action]]:
        """Send a leased entry once the link is up (`Connected`). sealed: every byte is written, and
        all of it goes (an entry of one chunk inside its offer, where the peer takes that); else a
        stream still being written, whose bytes go as `Written` says they are in, then `Commit`.
        The transfer owns the lease."""
        make_window = SendWindow.whole if sealed else SendWindow
        out = Outbound(self._new_xfer(), channel, entry.request_id, Kind.PUSH,
                       S.CONNECTING if sealed else S.STREAM_CONNECTING, entry, lease_token,
                       make_window(entry.total_bytes, self.limits.chunk_size, self.limits.window),
                       started=self.clock(), plane_min=self.limits.plane_min_bytes)
        self.transfers[out.xfer] = out
        self.story.add((out.started, out.xfer, NONE, "start_push", out.state, ""))
        return out, []

    def start_pull(self, request_id: str, channel: Channel, timeout: float, keep: bool,
                   expect_gen: int | None = None) -> tuple[Inbound, list[Action]]:
        """Ask the holder on channel for request_id (expect_gen: only that generation of it)."""
        now = self.clock()
        inbound = Inbound(self._new_xfer(), channel, request_id, Kind.PULL, R.PULLING,
                          deadline=now + timeout + self.limits.transfer_timeout, started=now)
        self.transfers[inbound.xfer] = inbound
        self.story.add((now, inbound.xfer, NONE, "start_pull", R.PULLING, ""))
        return inbound, [Send(channel, p.Pull(xfer=inbound.xfer, request_id=request_id, timeout=timeout, keep=keep,
                                              expect_gen=expect_gen, plane=channel.plane))]

    def _new_xfer(self) -> int:
        while (xfer := random.getrandbits(63)) in self.transfers:
            pass
        return xfer

    # --- events -----------------------------------------------------------------------------------

    def handle(self, event: Event, channel: Channel | None = None) -> list[Action]:
        """One event: a message from a peer (with the channel it came on) or a local one. Tick and
        ChannelLost are seen by every transfer (on that channel)."""
        if type(event) is Tick or type(event) is ChannelLost:
            actions: list[Action] = []
            key = event.key if type(event) is ChannelLost else None
            for each in [t for t in self.transfers.values() if key is None or t.channel.key == key]:
                actions += self._advance(each, event, None)
            return actions
        transfer = self.transfers.get(getattr(event, "xfer", _NO_XFER))
        if channel is not None and transfer is not None and transfer.channel.key != channel.key:
            log.warning("message %s for transfer %x from the wrong connection; dropped",
                        getattr(event, "TYPE", event), transfer.xfer)
            return []
        return self._advance(transfer, event, channel)

    def _advance(self, transfer: Transfer | None, event: Event, channel: Channel | None) -> list[Action]:
        """The one place a transfer changes state: its row's handler runs, then the row's state is
        assigned. In `no transfer` the handler gets the channel for a transfer (and may start one);
        a row that fails returns its `Fail`."""
        state = NONE if transfer is None else transfer.state
        steps = _STEPS.get((state, type(event)))
        if steps is None:  # refused (table.py says why), or not the table's event at all
            return self._unexpected(transfer, event, channel)
        try:
            for test, does, next_state in steps:  # noqa: B007 (the row taken: used after the break)
                if test is None or test(transfer, event):
                    break
            actions = does(self, channel if transfer is None else transfer, event)
        except KvdError as exc:  # (an entry a served pull waited for, taken meanwhile; a broken chunk...)
            return self._broke(transfer, event, channel, exc)
        if transfer is None:
            transfer = self._started(event, next_state)
            if transfer is None:
                return actions
        elif next_state in _FAILED:  # (no row of `no transfer` fails)
            fail = actions[0]
            assert type(fail) is Fail and len(actions) == 1, f"a failing row's handler returned {actions}"
            return self._fail(transfer, fail, type(event).__name__)
        if next_state is not state or type(event) is not Tick:  # (a tick that changes nothing is no story)
            self.story.add((self.clock(), transfer.xfer, state, type(event).__name__, next_state, ""))
        transfer.state = next_state
        if next_state in TERMINAL:
            del self.transfers[transfer.xfer]
            actions.append(Finished(transfer, None))
        return actions

    def _started(self, event: Any, next_state: Any) -> Transfer | None:
        """The transfer a row of `no transfer` started; None: it started none (then what came for an
        id, for a transfer that ended or was refused, goes in the story)."""
        xfer = getattr(event, "xfer", _NO_XFER)
        if next_state is not NONE:
            return self.transfers[xfer]
        if xfer != _NO_XFER:
            self.story.add((self.clock(), xfer, NONE, type(event).__name__, NONE, ""))
        return None

    def _unexpected(self, transfer: Transfer | None, event: Any, channel: Channel | None) -> list[Action]:
        if transfer is None:
            log.debug("%s for no transfer (%r) from %s; dropped", getattr(event, "TYPE", event),
                      getattr(event, "xfer", None), channel.peer_name if channel else "here")
            return []
        return self._failed(transfer, ProtocolError(
            f"unexpected {getattr(event, 'TYPE', type(event).__name__)} for a transfer that is {transfer.state.value}"),
            event)

    def _broke(self, transfer: Transfer | None, event: Any, channel: Channel | None, exc: KvdError) -> list[Action]:
        """A row's handler raised: the transfer fails (one that this event started, too), its peer told."""
        if transfer is None:
            xfer = getattr(event, "xfer", _NO_XFER)  # (a row in `no transfer` is for a peer's message)
            transfer = self.transfers.get(xfer)  # (one this event started)
            if transfer is None:
                if channel is None:
                    raise exc
                log.warning("transfer %x with %s refused: %s", xfer, channel.peer_name, exc)
                self.story.add((self.clock(), xfer, NONE, type(event).__name__, NONE, _why(exc)))
                return [Send(channel, p.Abort(xfer=xfer, code=exc.code, message=exc.message))]
        return self._failed(transfer, exc, event)

    def _failed(self, transfer: Transfer, error: KvdError, event: Any) -> list[Action]:
        """A transfer failed by a fault (a protocol error, a broken chunk, a full pool...): logged, and
        at debug level with its story."""
        log.warning("transfer %x with %s failed: %s", transfer.xfer, transfer.channel.peer_name, error)
        actions = self._fail(transfer, Fail(error), type(event).__name__)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("the story of transfer %x:\n%s", transfer.xfer, self.story.show(transfer.xfer))
        return actions

    def _fail(self, transfer: Transfer, fail: Fail, event: str) -> list[Action]:
        """FAILED: the transfer's claim on its entry ends (a sender's blocks stay pinned until
        ZeroMQ lets go), an arriving entry is dropped."""
        if self.transfers.get(transfer.xfer) is not transfer:
            return []
        del self.transfers[transfer.xfer]
        error = fail.error
        actions: list[Action] = []
        if fail.notify:
            actions.append(Send(transfer.channel, p.Abort(xfer=transfer.xfer, code=error.code, message=error.message)))
        state = transfer.state
        if isinstance(transfer, Outbound):
            transfer.state = S.FAILED
            if transfer.entry is not None:
                with contextlib.suppress(NotFound):  # a failed pull's holder has its entry back at once
                    self.store.end_claim(transfer.lease_token, success=False)  # (the blocks stay pinned)
        else:
            transfer.state = R.FAILED
            if transfer.entry is not None:
                self.store.remove(transfer.entry)
                actions.append(Dropped(transfer.entry, error))
        self.story.add((self.clock(), transfer.xfer, state, event, transfer.state, _why(error)))
        self.failed.append(transfer.xfer)
        return [*actions, Finished(transfer, error)]

    # --- questions --------------------------------------------------------------------------------

    def recent_failures(self) -> list[dict[str, object]]:
        """The last failed transfers with their stories, newest last (`kvd status --debug`)."""
        return [{"xfer": f"{xfer:x}", "story": self.story.show(xfer).splitlines()} for xfer in self.failed]

    def carrying(self, entry: Entry) -> list[Transfer]:
        """The transfers that carry this entry (sending it, or receiving it)."""
        return [t for t in self.transfers.values() if t.entry is entry]

    def in_flight(self) -> dict[str, int]:
        counts = {"sent": 0, "received": 0}
        for transfer in self.transfers.values():
            counts["sent" if isinstance(transfer, Outbound) else "received"] += 1
        return counts

    def validate(self) -> None:
        """Raise AssertionError naming the first invariant that does not hold (`invariants.py`), with
        the story of the transfer it concerns, also logged. For tests: it walks every transfer,
        never on the daemon's hot path."""
        try:
            check_machine(self)
        except InvariantBroken as exc:
            story = self.story.show(exc.key)
            log.error("transfer machine of %s: %s; its story:\n%s", self.node_id, exc, story)
            raise InvariantBroken(exc.key, f"{exc}\nits story (oldest first):\n{story}") from exc


def _why(error: KvdError) -> str:
    """A failure's note in the story: its class and the start of its message (a short string, no more)."""
    return f"{type(error).__name__}: {error.message[:120]}"
