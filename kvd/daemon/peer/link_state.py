"""The handshake of one outgoing peer link, as a machine (daemon process): events in, actions out.

It never touches a socket, a loop or the wall clock (its clock is injected). `links.PeerLink`
feeds it what its sockets, its timers and the heartbeat saw, and carries out the actions: send a
hello or a ping, dial again, start a waiter's timer, resolve or fail a waiter, report the link
lost. Who decides is the table (`TABLE`, on `kvd.statetable`'s engine, as for transfers): in each
state, for each event, the first row whose guard holds holds the handler and the state it leaves
the link in. Every state has a row for every event (nothing is refused).

A link is "known down" once it was up and lost its connection (or went silent), or a handshake
went unanswered (a waiter's whole budget, or a heartbeat's hello still queued a heartbeat later:
no connection to send it on). A wait on a known-down or refused link gets DOWN_GRACE at most,
not its whole budget: the link is found again by itself (ZeroMQ redials every RECONNECT_IVL_MAX,
the heartbeat says hello), and a caller should not pay the connect timeout to learn it is down.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvd.errors import KvdError, PeerUnavailable
from kvd.statetable import Guard, Table

DOWN_GRACE = 1.0  # seconds: twice ZeroMQ's longest redial interval (0.5 s), for a peer just back
REDIAL_INTERVAL = 2.0  # seconds between new attempts on a link whose handshake the peer refused


class State(enum.Enum):
    DIALLING = "dialling"  # linked; no hello said yet
    HELLO_SENT = "hello sent"  # a hello is out, unanswered; nothing known against the peer
    UP = "up"  # the peer answered our hello: transfers may run on the link
    DOWN = "down"  # known down: lost, or a handshake went unanswered; hellos go on
    REFUSED = "refused"  # the peer, or ZeroMQ's handshake with it, said no (`refusal` says why)


# --- events -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Wait:
    waiter: int  # the shell's id for one caller that needs the link up
    budget: float  # seconds it may wait for the handshake


@dataclass(frozen=True)
class Expired:
    waiter: int  # its timer went off


@dataclass(frozen=True)
class Answered:
    node_id: str  # the peer's PeerHelloOk (that passed the shell's checks)
    incarnation: int


@dataclass(frozen=True)
class Refused:
    error: KvdError  # what a put or get to the peer reports
    redial: bool  # ZeroMQ dropped the connection for good: the link must dial again itself


@dataclass(frozen=True)
class Retrying:
    error: KvdError  # ZeroMQ's handshake failed without detail; it retries by itself (it may pass)


@dataclass(frozen=True)
class Closed:
    """The TCP connection closed (the peer stopped or restarted, or the network failed)."""


@dataclass(frozen=True)
class Silent:
    """The heartbeat heard nothing from the peer for heartbeat_timeout (it reports the loss)."""


@dataclass(frozen=True)
class Forgotten:
    message: str  # an abort with xfer 0: the peer does not know us (it restarted on our address)


@dataclass(frozen=True)
class Heartbeat:
    backlog: bool  # the last message sent on the link has not left yet


Event = Wait | Expired | Answered | Refused | Retrying | Closed | Silent | Forgotten | Heartbeat


# --- actions ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SendHello:
    waiter: int | None = None  # whose hello (a waiter's is called back if it gives up), None: the heartbeat's


@dataclass(frozen=True)
class SendPing:
    pass


@dataclass(frozen=True)
class Redial:
    pass


@dataclass(frozen=True)
class StartTimer:
    waiter: int
    after: float  # seconds


@dataclass(frozen=True)
class Resolve:
    waiter: int


@dataclass(frozen=True)
class Fail:
    waiter: int
    error: KvdError


@dataclass(frozen=True)
class Lost:
    reason: str  # whatever ran on the link is gone: its transfers fail with this


@dataclass(frozen=True)
class Forward:
    """Not the handshake's: the message goes to the transfers."""


@dataclass(frozen=True)
class Log:
    warning: bool  # else info
    text: str


Action = SendHello | SendPing | Redial | StartTimer | Resolve | Fail | Lost | Forward | Log


class Handshake:
    """The state of one link's handshake: `handle(event) -> actions` is the only way it moves."""

    state: State
    needs_redial: bool
    dialled_at: float
    clock: Callable[[], float]
    waiters: dict[int, float]

    def __init__(self, name: str, endpoint: str, clock: Callable[[], float]) -> None:
        self.name, self.endpoint, self.clock = name, endpoint, clock
        self.state = State.DIALLING
        self.refusal: KvdError | None = None  # why the last handshake failed, until one succeeds
        self.needs_redial = False  # ZeroMQ will not dial this peer again by itself (it refused us)
        self.dialled_at = clock()
        self.down_since = 0.0
        self.down_why = ""
        self.node_id: str | None = None  # who answered our last hello
        self.incarnation: int | None = None
        self.waiters: dict[int, float] = {}  # waiter -> the budget it was given

    @property
    def where(self) -> str:
        return f"peer {self.name} ({self.endpoint})"

    def handle(self, event: Event) -> list[Action]:
        steps = _STEPS[self.state, type(event)]  # (every state has a row for every event: a test checks)
        for test, does, next_state in steps:  # noqa: B007 (the row taken: used after the break)
            if test is None or test(self, event):
                break
        actions = does(self, event)
        if next_state is State.DOWN and self.state is not State.DOWN:
            self.down_since = self.clock()
        self.state = next_state
        return actions

    # --- handlers: what the row does; none assigns the state ----------------------------------------

    def _nothing(self, event: Event) -> list[Action]:
        return []

    def _forward(self, event: Event) -> list[Action]:
        return [Forward()]

    def _resolve(self, event: Wait) -> list[Action]:
        return [Resolve(event.waiter)]

    def _wait(self, event: Wait, budget: float | None = None) -> list[Action]:
        self.waiters[event.waiter] = budget = event.budget if budget is None else budget
        return [SendHello(event.waiter), StartTimer(event.waiter, budget)]

    def _wait_briefly(self, event: Wait) -> list[Action]:
        actions = self._redial(None, hello=False) if self.needs_redial else []
        return actions + self._wait(event, min(event.budget, DOWN_GRACE))

    def _expire(self, event: Expired) -> list[Action]:
        budget = self.waiters.pop(event.waiter)
        if self.state is State.HELLO_SENT or self.state is State.DIALLING:
            self.down_why = "a handshake went unanswered"
        if self.refusal is not None:  # the reason ZeroMQ saw, if any, says more than "no answer"
            return [Fail(event.waiter, type(self.refusal)(self.refusal.message))]
        if self.state is State.DOWN:
            ago = self.clock() - self.down_since
            text = (f"{self.where} is not connected ({self.down_why} {ago:.1f}s ago) and did not answer "
                    f"within {budget:g}s")
        else:
            text = f"{self.where} did not answer within {budget:g}s"
        return [Fail(event.waiter, PeerUnavailable(text))]

    def _up(self, event: Answered) -> list[Action]:
        restarted = self.incarnation is not None and self.incarnation != event.incarnation
        self.node_id, self.incarnation = event.node_id, event.incarnation
        self.refusal = None
        actions: list[Action] = []
        if self.state is not State.UP:
            actions.append(Log(False, f"peer {self.name} connected: node {event.node_id} at {self.endpoint}"))
        if restarted:
            actions += [Log(True, f"peer {self.name} answered with a new incarnation: it restarted"),
                        Lost(f"peer {self.name} restarted")]
        actions += [Resolve(w) for w in self.waiters]
        self.waiters.clear()
        return actions

    def _refuse(self, event: Refused) -> list[Action]:
        self.refusal = event.error
        self.needs_redial = self.needs_redial or event.redial
        error = event.error
        actions: list[Action] = [Fail(w, type(error)(error.message)) for w in self.waiters]
        self.waiters.clear()
        return actions

    def _note(self, event: Retrying) -> list[Action]:
        self.refusal = event.error  # kept for the timeout's message
        return []

    def _close(self, event: Closed) -> list[Action]:
        self.down_why = "its connection closed"
        return [Log(True, f"peer {self.name}: connection closed; reconnecting"),
                Lost(f"connection to peer {self.name} closed")]

    def _go_silent(self, event: Silent) -> list[Action]:
        self.down_why = "it went silent"
        return []

    def _hello_again(self, event: Forgotten) -> list[Action]:
        return [Log(True, f"peer {self.name} no longer knows us ({event.message}); handshaking again"), SendHello()]

    def _ping(self, event: Heartbeat) -> list[Action]:
        return [SendPing()]

    def _hello(self, event: Heartbeat) -> list[Action]:
        return [SendHello()]

    def _unreachable(self, event: Heartbeat) -> list[Action]:
        self.down_why = "no connection to it"
        return []

    def _redial(self, event: Heartbeat | None, hello: bool = True) -> list[Action]:
        self.needs_redial = False
        self.dialled_at = self.clock()
        return [Redial(), *([SendHello()] if hello and event is not None and not event.backlog else [])]


# --- the table ------------------------------------------------------------------------------------

D, H, U, DN, RF = State.DIALLING, State.HELLO_SENT, State.UP, State.DOWN, State.REFUSED
NOT_UP = (D, H, DN, RF)
PENDING = Guard("the waiter still waits", lambda hs, e: e.waiter in hs.waiters)
BACKLOG = Guard("the last message has not left", lambda hs, e: e.backlog)
REDIAL_DUE = Guard(f"ZeroMQ gave up, {REDIAL_INTERVAL:g}s ago or more",
                   lambda hs, e: hs.needs_redial and hs.clock() - hs.dialled_at >= REDIAL_INTERVAL)
Handler = Callable[[Handshake, Any], list[Action]]  # a Handshake method: (the link, the event) -> actions
EVENTS = (Wait, Expired, Answered, Refused, Retrying, Closed, Silent, Forgotten, Heartbeat)


def _rows(table: Table[State, Handler]) -> Table[State, Handler]:
    add, hs = table.add, Handshake
    add([U], Wait, hs._resolve, U)
    add([D], Wait, hs._wait, H)
    add([H], Wait, hs._wait, H)
    add([DN], Wait, hs._wait_briefly, DN)
    add([RF], Wait, hs._wait_briefly, RF)
    add((D, H, DN), Expired, hs._expire, DN, PENDING)
    add([RF], Expired, hs._expire, RF, PENDING)
    add((*NOT_UP, U), Expired, hs._nothing)
    add((*NOT_UP, U), Answered, hs._up, U)
    add((*NOT_UP, U), Refused, hs._refuse, RF)
    add((*NOT_UP, U), Retrying, hs._note)
    add([U], Closed, hs._close, DN)
    add(NOT_UP, Closed, hs._nothing)
    add([U], Silent, hs._go_silent, DN)
    add(NOT_UP, Silent, hs._nothing)
    add([U], Forgotten, hs._hello_again, H)
    add(NOT_UP, Forgotten, hs._forward)
    add([U], Heartbeat, hs._nothing, U, BACKLOG)
    add([U], Heartbeat, hs._ping, U)
    add([D], Heartbeat, hs._unreachable, DN, BACKLOG)
    add([D], Heartbeat, hs._hello, H)
    add([H], Heartbeat, hs._unreachable, DN, BACKLOG)
    add([H], Heartbeat, hs._hello, H)
    add([DN], Heartbeat, hs._nothing, DN, BACKLOG)
    add([DN], Heartbeat, hs._hello, DN)
    add([RF], Heartbeat, hs._redial, RF, REDIAL_DUE)
    add([RF], Heartbeat, hs._nothing, RF, BACKLOG)
    add([RF], Heartbeat, hs._hello, RF)
    return table


TABLE: Table[State, Handler] = _rows(Table(State, EVENTS))
_STEPS = TABLE.compile()


def markdown() -> str:
    """The table as PROTOCOL.md shows it: a line per row (for a reader; nothing generates code from it)."""
    return TABLE.markdown(merge=False, same_as=None, code=False)


if __name__ == "__main__":
    print(markdown(), end="")
