"""kvd.daemon.transfer.table: the transfer table itself, read as data (no machine runs here), its
coverage of every pair of a state and an event, and its printed form in proto/PROTOCOL.md."""
from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest

from kvd.daemon.transfer import table
from kvd.daemon.transfer.states import (
    KIND_STATES,
    NONE,
    TERMINAL,
    Cancel,
    ChannelLost,
    Commit,
    R,
    S,
    Tick,
    Written,
)
from kvd.daemon.transfer.table import RECEIVER_LIVE, SENDER_LIVE, TABLE
from kvd.wire import protocol as p

PROTOCOL = Path(__file__).resolve().parents[3] / "proto" / "PROTOCOL.md"
BY_KEY: dict[tuple, list] = collections.defaultdict(list)
for _row in TABLE.rows:
    BY_KEY[_row.state, _row.event].append(_row)


@pytest.mark.parametrize("key", list(BY_KEY), ids=lambda key: f"{key[0].value}-{getattr(key[1], 'TYPE', key[1])}")
def test_the_rows_of_a_state_and_event_end_with_the_one_that_always_holds(key):
    rows = BY_KEY[key]
    assert rows[-1].when is None, rows[-1]
    assert all(row.when is not None for row in rows[:-1]), rows  # (a row after it would never be taken)


def test_every_row_holds_its_handler_and_a_failing_one_says_so():
    for row in TABLE.rows:
        assert callable(row.does) and row.does.__module__.startswith("kvd.daemon.transfer."), row
        failing = row.next in (S.FAILED, R.FAILED)
        assert failing == row.does.__name__.startswith(("fail_", "refuse_")), row  # (those return a Fail)


def test_every_pair_of_a_state_and_an_event_is_handled_or_refused_with_a_reason():
    coverage = TABLE.coverage()
    assert coverage.uncovered == () and coverage.both == ()
    assert len(coverage.handled) + len(coverage.refused) == len(table.STATES) * len(table.EVENTS)
    assert (len(coverage.handled), len(coverage.refused)) == (198, 377)  # (a new row or refusal moves these)
    assert all(reason for reason in TABLE.refusals.values())
    # the machine's local events reach a live transfer only where it has a row, or its refusal says why not
    assert TABLE.refusal(R.RECEIVING, Written) == "only a push hears of its producer's writes and commit"
    assert TABLE.refusal(S.DONE, Tick) is not None and TABLE.refusal(S.SENDING, p.ChunkAck) is None


def test_each_side_moves_within_its_own_states():
    for row in TABLE.rows:
        assert row.state not in TERMINAL, row  # an ended transfer is no longer held
        if isinstance(row.state, S):
            assert isinstance(row.next, S), row
        elif isinstance(row.state, R):
            assert isinstance(row.next, R), row
        else:  # no transfer: it stays so, or one starts
            assert row.next is NONE or row.next in (S.WAITING, *RECEIVER_LIVE, R.DONE), row


@pytest.mark.parametrize("state", SENDER_LIVE, ids=lambda s: s.value)
def test_a_sender_has_a_row_for_every_local_event_that_can_reach_it(state):
    # the I/O layer tells every sender of its entry's writes and commit, and every transfer of
    # time, lost connections and cancels: none of them may be a protocol error
    for event in (Written, Commit, Cancel, ChannelLost, Tick):
        assert (state, event) in BY_KEY, (state, event)


@pytest.mark.parametrize("state", RECEIVER_LIVE, ids=lambda s: s.value)
def test_a_receiver_has_a_row_for_every_local_event_that_can_reach_it(state):
    for event in (Cancel, ChannelLost, Tick):
        assert (state, event) in BY_KEY, (state, event)


def test_every_state_is_reached_and_every_live_one_can_end():
    nexts = collections.defaultdict(set)
    for row in TABLE.rows:
        nexts[row.state].add(row.next)
    starts = {S.CONNECTING, S.STREAM_CONNECTING, R.PULLING, NONE}  # start_push, start_pull, a peer's message
    reached, todo = set(starts), list(starts)
    while todo:
        for state in nexts[todo.pop()] - reached:
            reached.add(state)
            todo.append(state)
    assert reached >= {*SENDER_LIVE, *RECEIVER_LIVE, *TERMINAL}
    for state in (*SENDER_LIVE, *RECEIVER_LIVE):
        assert nexts[state] & {S.DONE, S.FAILED, R.DONE, R.FAILED}, state
    assert set().union(*KIND_STATES.values()) == {*SENDER_LIVE, *RECEIVER_LIVE}


def test_protocol_md_shows_the_table_the_machine_walks():
    text = PROTOCOL.read_text()
    found = re.search(r"<!-- transfer table: begin[^>]*-->\n(.*?)<!-- transfer table: end -->", text, re.S)
    assert found, "proto/PROTOCOL.md has lost its transfer table markers"
    assert found.group(1) == table.markdown(), \
        "proto/PROTOCOL.md's transfer table is stale: paste the output of python -m kvd.daemon.transfer.table"
