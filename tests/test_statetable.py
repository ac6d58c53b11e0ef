"""kvd.statetable: the one table engine, on a small machine of its own (a door), without the
daemon's machines (their tables have their own tests: tests/daemon/peer/test_table.py,
test_handshake.py, tests/daemon/test_writes.py)."""
from __future__ import annotations

import enum
import gc
import weakref
from dataclasses import dataclass

import pytest

from kvd.errors import NotFound
from kvd.statetable import Fail, Guard, InvariantBroken, Story, Table, handler_name, same


class Door(enum.Enum):
    OPEN = "open"
    SHUT = "shut"
    LOCKED = "locked"


@dataclass
class Push:
    force: int = 0


@dataclass
class Turn:
    key: str = ""


@dataclass
class Knock:
    pass


@dataclass
class House:
    key: str = "brass"


def close(house: House, event: Push) -> list[str]:
    return ["bang"]


def open_(house: House, event: Push) -> list[str]:
    return ["creak"]


def lock(house: House, event: Turn) -> list[str]:
    return ["click"]


def jam(house: House, event: Push) -> list[object]:
    return [Fail(NotFound("the door is jammed"), notify=False)]


STRONG = Guard("pushed hard", lambda house, e: e.force > 5)
RIGHT_KEY = Guard("the right key", lambda house, e: e.key == house.key)


def door() -> Table[Door, object]:
    table: Table[Door, object] = Table(Door, (Push, Turn, Knock))
    table.add([Door.OPEN], Push, close, Door.SHUT)
    table.add([Door.SHUT], Push, jam, Door.SHUT, STRONG)
    table.add([Door.SHUT], Push, open_, Door.OPEN)
    table.add([Door.SHUT], Turn, lock, Door.LOCKED, RIGHT_KEY)
    table.add([Door.SHUT, Door.LOCKED], Turn, lock)  # (the wrong key: it stays as it is)
    table.add([Door.LOCKED], Turn, lock, Door.SHUT, RIGHT_KEY)  # (after a row that always holds: never taken)
    table.refuse([Door.LOCKED], Push, "a locked door does not move")
    table.refuse([Door.OPEN], Turn, "an open door has no lock to turn")
    return table


def step(table: Table[Door, object], state: Door, house: House, event: object) -> tuple[Door, list[object]]:
    """How a machine walks a compiled table: the first row whose guard holds."""
    for test, does, next_state in table.compile()[state, type(event)]:
        if test is None or test(house, event):
            return next_state, does(house, event)  # type: ignore[operator]
    raise AssertionError("no row held")


def test_rows_hold_their_handlers_and_the_first_whose_guard_holds_is_taken():
    table, house = door(), House()
    assert step(table, Door.OPEN, house, Push()) == (Door.SHUT, ["bang"])
    assert step(table, Door.SHUT, house, Push(force=1)) == (Door.OPEN, ["creak"])
    assert step(table, Door.SHUT, house, Turn("brass")) == (Door.LOCKED, ["click"])
    assert step(table, Door.SHUT, house, Turn("iron")) == (Door.SHUT, ["click"])  # `same` kept its state
    assert [row.does for row in table.rows_of(Door.SHUT, Push)] == [jam, open_]  # the functions, not names


def test_a_failure_is_an_action():
    next_state, actions = step(door(), Door.SHUT, House(), Push(force=9))
    (fail,) = actions
    assert next_state is Door.SHUT and type(fail) is Fail
    assert fail.error.message == "the door is jammed" and not fail.notify


def test_a_next_state_may_be_a_function_of_the_row_s_state():
    table: Table[Door, object] = Table(Door, (Knock,))
    table.add(Door, Knock, close, same)
    table.add([Door.OPEN], Push, close, lambda state: Door.LOCKED if state is Door.OPEN else state)
    assert [row.next for row in table.rows] == [Door.OPEN, Door.SHUT, Door.LOCKED, Door.LOCKED]


def test_coverage_finds_the_pairs_nobody_thought_about():
    table = door()
    coverage = table.coverage()
    assert set(coverage.uncovered) == {(Door.OPEN, Knock), (Door.SHUT, Knock), (Door.LOCKED, Knock)}
    assert len(coverage.handled) == 4 and len(coverage.refused) == 2 and coverage.both == ()
    table.refuse(Door, Knock, "nobody is home")
    coverage = table.coverage()
    assert coverage.uncovered == () and len(coverage.refused) == 5
    assert table.refusal(Door.LOCKED, Push) == "a locked door does not move"  # the first reason stays
    assert table.refusal(Door.OPEN, Push) is None  # handled: never refused, whatever a broad refuse says


def test_a_row_added_after_its_pair_was_refused_is_a_contradiction():
    table = door()
    table.add([Door.LOCKED], Push, close, Door.OPEN)
    assert table.coverage().both == ((Door.LOCKED, Push),)


def test_markdown_merges_rows_that_differ_in_their_state_or_event_and_keeps_each_row_s_rank():
    assert door().markdown() == (
        "| state | event | when | does | next |\n"
        "|---|---|---|---|---|\n"
        "| open | Push |  | `close` | shut |\n"
        "| shut | Push | pushed hard | `jam` | same |\n"
        "| shut | Push |  | `open_` | open |\n"
        "| shut | Turn | the right key | `lock` | locked |\n"
        "| shut | Turn |  | `lock` | same |\n"  # (rank 1 for shut; locked's rank 0 row is another line)
        "| locked | Turn |  | `lock` | same |\n"
        "| locked | Turn | the right key | `lock` | shut |\n")


def test_markdown_one_line_a_row():
    text = door().markdown(merge=False, same_as=None, code=False)
    lines = text.splitlines()
    assert len(lines) == 2 + len(door().rows) and text.endswith("\n")
    assert lines[-1] == "| locked | Turn | the right key | lock | shut |"
    assert "| shut | Turn |  | lock | shut |" in lines


def test_handler_names():
    class Verb(enum.Enum):
        GO = "go"

    class Thing:
        def _turn(self) -> None: ...

    assert handler_name(close) == "close" and handler_name(Thing._turn) == "turn" and handler_name(Verb.GO) == "go"


# --- the story ---------------------------------------------------------------------------------------

def test_the_story_is_bounded_and_told_per_key():
    story = Story(limit=4)
    for i in range(6):
        story.record(float(i), "a" if i % 2 else "b", "shut", "Push", "open", "why" if i == 5 else "")
    assert [t.at for t in story.of("a")] == [3.0, 5.0] and [t.at for t in story.of("b")] == [2.0, 4.0]
    assert story.show("a").splitlines() == ["  +0.000000s shut --Push--> open",
                                            "  +2.000000s shut --Push--> open (why)"]
    assert "no transitions" in story.show("c")


def test_the_story_keeps_no_event_alive():
    """What a story records are names, keys and times: an event handed to the machine (a chunk, its
    payload) is gone once the machine is done with it."""
    class Payload(bytearray):
        pass

    story, payload = Story(), Payload(b"x" * 4096)
    gone = weakref.ref(payload)
    event = Push(force=len(payload))
    story.record(1.0, 7, Door.SHUT, type(event).__name__, Door.OPEN)
    del payload, event
    gc.collect()
    assert gone() is None
    assert all(isinstance(v, (str, int, float, Door)) for entry in story.log for v in entry)
    assert story.of(7) == [(1.0, 7, "shut", "Push", "open", "")]


def test_an_invariant_broken_names_its_key():
    broken = InvariantBroken(0xABC, "transfer abc: its lease is not the store's")
    assert isinstance(broken, AssertionError) and broken.key == 0xABC and "lease" in str(broken)
    with pytest.raises(AssertionError):
        raise broken
