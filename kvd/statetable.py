"""One table engine for kvd's state machines (daemon process; pure: no sockets, no asyncio, no clock
of its own). The transfer machine (`daemon/transfer/table.py`), a peer link's handshake
(`daemon/peer/link_state.py`) and a local write's life (`daemon/local/reservation.py`) are each a
`Table` of rows, as h11's `_state.py` and Dask's `_transitions_table` are.

A row is (state, event, when, does, next): in `state`, `event` (an event class, or an enum member
where a machine's events are plain names) runs `does` and leaves the machine in `next`. Rows of one
state and event are tried in order; the first whose guard (`when`, a pure test of the machine and
the event) holds is taken, and the last of them has none. `does` is the handler itself, never its
name: a function the machine calls with what it has (or, where a row only names an outcome, that
outcome). A handler says a failure as an action (`Fail`) and otherwise returns the actions to carry
out: one return convention.

Every (state, event) pair a machine can meet is either handled by rows or refused, with the reason
(`refuse`); `coverage()` finds the pairs that are neither, and a test holds each machine to none.
What a machine does on a refused pair is its own (a protocol error, an internal one); the table
only knows that the pair was thought about.

`markdown()` prints a table as proto/PROTOCOL.md shows it. `Story` is a bounded log of recent
transitions (Dask's `story()`): it keeps states, event type names, keys and times only, never an
event, so it holds no payload alive.
"""
from __future__ import annotations

import collections
import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

from kvd.errors import KvdError

St = TypeVar("St", bound=enum.Enum)  # a machine's states (an enum, or a union of enums)
H = TypeVar("H")  # what a row does: a handler, or the outcome it names


@dataclass(frozen=True, slots=True)
class Guard:
    """A row's condition: what it `says` (for the printed table) and its `test` of (machine, event)."""

    says: str
    test: Callable[[Any, Any], bool]  # (machine or record, event): their types are the row's


class Row(NamedTuple, Generic[St, H]):
    state: St
    event: object  # an event class, or an enum member
    when: Guard | None
    does: H
    next: St


class Step(NamedTuple, Generic[St, H]):
    """A row as the hot path walks it: the guard's bare test, the handler, the next state."""

    test: Callable[[Any, Any], bool] | None
    does: H
    next: St


@dataclass(frozen=True, slots=True)
class Fail:
    """A failure, as an action: the machine's key ends with `error`; `notify`: the other side is told."""

    error: KvdError
    notify: bool = True


def same(state: St) -> St:
    """`next` for a row that keeps its state (a row's next may be a function of its state)."""
    return state


class Coverage(NamedTuple):
    handled: frozenset[tuple[enum.Enum, object]]
    refused: frozenset[tuple[enum.Enum, object]]
    uncovered: tuple[tuple[enum.Enum, object], ...]  # neither: a pair nobody thought about
    both: tuple[tuple[enum.Enum, object], ...]  # handled and refused: a contradiction


class Table(Generic[St, H]):
    """The rows and refusals of one machine over its `states` and `events` (every pair of them is
    either handled or refused, `coverage()` checks)."""

    def __init__(self, states: Iterable[St], events: Iterable[object]) -> None:
        self.states = tuple(states)
        self.events = tuple(events)
        self.rows: list[Row[St, H]] = []
        self.refusals: dict[tuple[St, object], str] = {}

    def add(self, states: Iterable[St], events: object | tuple[object, ...], does: H,
            next: St | Callable[[St], St] = same, when: Guard | None = None) -> None:
        """A row for each of `states` and `events`; `next` a state, or a function of the row's state."""
        for state in states:
            target = next(state) if callable(next) else next
            for event in events if isinstance(events, tuple) else (events,):
                self.rows.append(Row(state, event, when, does, target))

    def refuse(self, states: Iterable[St], events: object | tuple[object, ...], reason: str) -> None:
        """Say why the pairs of `states` and `events` that have no row have none (call it once the
        rows are in: a pair refused already keeps its first reason, one that has a row is skipped)."""
        handled = {(row.state, row.event) for row in self.rows}
        for state in states:
            for event in events if isinstance(events, tuple) else (events,):
                if (state, event) not in handled:
                    self.refusals.setdefault((state, event), reason)

    # --- reading it -------------------------------------------------------------------------------

    def compile(self) -> dict[tuple[St, object], tuple[Step[St, H], ...]]:
        """(state, event) -> its rows' steps, in the table's order: what a machine's hot path looks up."""
        steps: dict[tuple[St, object], list[Step[St, H]]] = {}
        for row in self.rows:
            test = row.when.test if row.when is not None else None
            steps.setdefault((row.state, row.event), []).append(Step(test, row.does, row.next))
        return {key: tuple(rows) for key, rows in steps.items()}

    def rows_of(self, state: St, event: object) -> list[Row[St, H]]:
        return [row for row in self.rows if row.state is state and row.event == event]

    def refusal(self, state: St, event: object) -> str | None:
        """Why the pair has no row (None: it has rows, or nobody said)."""
        return self.refusals.get((state, event))

    def coverage(self) -> Coverage:
        handled = frozenset((row.state, row.event) for row in self.rows)
        refused = frozenset(self.refusals)
        pairs = [(s, e) for s in self.states for e in self.events]
        return Coverage(handled, refused, tuple(p for p in pairs if p not in handled and p not in refused),
                        tuple(p for p in pairs if p in handled and p in refused))

    # --- the table as documentation ---------------------------------------------------------------

    def markdown(self, *, merge: bool = True, same_as: str | None = "same", code: bool = True,
                 event_name: Callable[[object], str] = lambda e: getattr(e, "__name__", str(e)),
                 states_name: Callable[[tuple[St, ...]], str] | None = None) -> str:
        """The table as markdown rows: | state | event | when | does | next |.

        merge: rows that differ only in their state, or then only in their event, share a line (a
        merged row keeps its place among the rows of each state and event: it carries its rank
        there, so the first row that holds is still the one taken); same_as: what `next` says for a
        row that keeps its state (None: the state's name); code: the handler's name in code font."""
        lines = ["| state | event | when | does | next |", "|---|---|---|---|---|"]
        show_states = states_name or (lambda states: ", ".join(str(s.value) for s in states))
        for states, events, when, does, next_state in self._lines(merge, same_as):
            name = handler_name(does)
            lines.append(f"| {show_states(states)} | {', '.join(map(event_name, events))} "
                         f"| {when.says if when else ''} | {f'`{name}`' if code else name} | {next_state} |")
        return "\n".join(lines) + "\n"

    def _lines(self, merge: bool, same_as: str | None) -> list[tuple[tuple[St, ...], list[object], Guard | None, H,
                                                                     str]]:
        def next_name(row: Row[St, H]) -> str:
            return same_as if same_as is not None and row.next is row.state else str(row.next.value)

        if not merge:
            return [((row.state,), [row.event], row.when, row.does, next_name(row)) for row in self.rows]
        by_state: dict[tuple[Any, ...], list[St]] = {}
        rank: dict[tuple[St, object], int] = {}
        for row in self.rows:
            place = rank[row.state, row.event] = rank.get((row.state, row.event), -1) + 1
            by_state.setdefault((row.event, row.when, row.does, next_name(row), place), []).append(row.state)
        by_event: dict[tuple[Any, ...], list[object]] = {}
        for (event, when, does, next_state, place), states in by_state.items():
            by_event.setdefault((tuple(states), when, does, next_state, place), []).append(event)
        return [(states, events, when, does, next_state)
                for (states, when, does, next_state, _), events in by_event.items()]


def handler_name(does: object) -> str:
    """What a row does, by name: a function's name (its leading underscore dropped), an enum's value."""
    if isinstance(does, enum.Enum):
        return str(does.value)
    return str(getattr(does, "__name__", does)).lstrip("_")


# --- story: recent transitions, for post-mortems ---------------------------------------------------

class Transition(NamedTuple):
    at: float  # by the machine's clock
    key: object  # what moved (a transfer id, ...)
    state: str  # the state it was in
    event: str  # the event's type name
    next: str  # the state it was left in
    note: str = ""  # why it failed, if it did


class Story:
    """A bounded log of a machine's recent transitions, every key together (Dask's `story()`): the
    oldest go first once `limit` are kept. It holds small values only, never an event or a record
    (a log of chunks must not keep their buffers alive): a time, a key, the states (enum members,
    named when told), the event's type name and a short note.

    `add((at, key, state, event, next, note))` is the hot path's call (one append of a plain tuple:
    a machine records every chunk); `of` and `show` read it back as `Transition`s."""

    def __init__(self, limit: int = 10_000) -> None:
        self.log: collections.deque[tuple[float, object, object, str, object, str]] = collections.deque(maxlen=limit)
        self.add = self.log.append

    def record(self, at: float, key: object, state: object, event: str, next: object, note: str = "") -> None:
        self.add((at, key, state, event, next, note))

    def of(self, key: object) -> list[Transition]:
        """The transitions of `key` still in the log, oldest first."""
        return [Transition(at, k, _named(state), event, _named(next), note)
                for at, k, state, event, next, note in self.log if k == key]

    def show(self, key: object, last: int = 30) -> str:
        """`key`'s last transitions, one a line, times relative to the first shown."""
        story = self.of(key)[-last:]
        if not story:
            return f"  (no transitions of {key!r} in the story)"
        start = story[0].at
        return "\n".join(f"  +{t.at - start:.6f}s {t.state} --{t.event}--> {t.next}"
                         + (f" ({t.note})" if t.note else "") for t in story)


def _named(state: object) -> str:
    return str(state.value) if isinstance(state, enum.Enum) else str(state)


class InvariantBroken(AssertionError):
    """An invariant of one key does not hold (a machine's `validate()` adds the key's story)."""

    def __init__(self, key: object, text: str) -> None:
        super().__init__(text)
        self.key = key
