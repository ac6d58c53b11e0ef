"""kvd.daemon.local.reservation: a local write's life as a table, without sockets or a store."""
from __future__ import annotations

import itertools

import pytest

import kvd.daemon.local.reservation as writes
from kvd.daemon.local.reservation import FINAL, TABLE, LocalWrite, WriteAction, WriteEvent, WriteState
from kvd.errors import InternalError, NotFound, Timeout

S, E, A = WriteState, WriteEvent, WriteAction


def test_the_docstring_is_the_table():
    assert writes.describe() in writes.__doc__


def test_every_event_has_a_row_in_every_state_that_is_not_final_and_is_refused_in_the_others():
    coverage = TABLE.coverage()
    assert coverage.uncovered == () and coverage.both == ()
    for state, event in itertools.product(WriteState, WriteEvent):
        assert ((state, event) in coverage.handled) == (state not in FINAL), (state, event)
        assert ((state, event) in coverage.refused) == (state in FINAL), (state, event)
    assert (len(coverage.handled), len(coverage.refused)) == (12, 12)
    assert all(len(TABLE.rows_of(state, event)) == 1 for state, event in coverage.handled)  # no guards here


def test_every_state_is_reached_from_writing():
    seen, todo = {S.WRITING}, [S.WRITING]
    while todo:
        state = todo.pop()
        for row in TABLE.rows:
            if row.state is state and row.next not in seen:
                seen.add(row.next)
                todo.append(row.next)
    assert seen == set(WriteState)


def test_a_put_written_then_committed():
    write = LocalWrite()
    assert write.step(E.WRITE) is A.COPIED and write.step(E.WRITE) is A.COPIED and write.live
    assert write.step(E.COMMIT) is A.PUBLISH and write.state is S.COMMITTED and not write.live


def test_removed_under_its_writer_the_write_ends_and_its_commit_fails_with_why():
    write, why = LocalWrite(), Timeout("the lease ran out")
    assert write.step(E.REMOVED, why) is A.TELL and write.state is S.ENDED and write.ended is why
    assert write.step(E.WRITE) is A.NOTHING  # the writer was told; its writes are ignored
    assert write.step(E.REMOVED, NotFound("again")) is A.NOTHING and write.ended is why  # the first reason stays
    assert write.step(E.COMMIT) is A.FAIL and write.state is S.RELEASED


@pytest.mark.parametrize("event, action", [(E.ABORT, A.DROP), (E.GONE, A.DROP), (E.REMOVED_UNHEARD, A.FREE)])
def test_a_live_write_that_ends_without_a_commit(event, action):
    write = LocalWrite()
    assert write.step(event) is action and write.state is S.RELEASED and write.ended is None


@pytest.mark.parametrize("event", [E.ABORT, E.GONE, E.REMOVED_UNHEARD])
def test_an_ended_write_is_only_freed(event):
    write = LocalWrite()
    write.step(E.REMOVED, NotFound("deleted"))
    assert write.step(event) is A.FREE and write.state is S.RELEASED


@pytest.mark.parametrize("first", [E.COMMIT, E.ABORT, E.GONE])
def test_a_final_write_takes_no_more_events(first):
    write = LocalWrite()
    write.step(first)
    for event in WriteEvent:
        with pytest.raises(InternalError, match=r"cannot take .*: the write is over"):
            write.step(event)


def test_validate_reads_the_store_s_view():
    write = LocalWrite()
    write.validate(pinned=True, removed=False)
    with pytest.raises(AssertionError):
        write.validate(pinned=False, removed=False)  # a live write's blocks must stay pinned
    with pytest.raises(AssertionError):
        write.validate(pinned=True, removed=True)  # removed without the machine hearing of it
    write.step(E.REMOVED, NotFound("deleted"))
    write.validate(pinned=True, removed=True)
    write.step(E.GONE)
    write.validate(pinned=False, removed=True)
    with pytest.raises(AssertionError):
        write.validate(pinned=True, removed=True)  # released, yet still pinning
