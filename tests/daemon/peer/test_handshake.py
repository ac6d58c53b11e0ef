"""kvd.daemon.peer.link_state: one link's handshake machine, driven by events alone (no socket, no
loop; a hand-set clock), and its table read as data."""
from __future__ import annotations

import collections

import pytest

from kvd.daemon.peer import link_state as hs
from kvd.daemon.peer.link_state import (
    DOWN_GRACE,
    REDIAL_INTERVAL,
    TABLE,
    Answered,
    Closed,
    Expired,
    Fail,
    Forgotten,
    Forward,
    Handshake,
    Heartbeat,
    Log,
    Lost,
    Redial,
    Refused,
    Resolve,
    Retrying,
    SendHello,
    SendPing,
    Silent,
    StartTimer,
    State,
    Wait,
)
from kvd.errors import PeerUnavailable, Unauthorized

EVENTS = (Wait, Expired, Answered, Refused, Retrying, Closed, Silent, Forgotten, Heartbeat)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def kinds(actions) -> list[type]:
    return [type(a) for a in actions if type(a) is not Log]


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def link(clock):
    return Handshake("B", "tcp://127.0.0.1:9", clock)


def up(link: Handshake) -> Handshake:
    link.handle(Wait(1, 5.0))
    link.handle(Answered("node-b", 7))
    assert link.state is State.UP
    return link


# --- the table ------------------------------------------------------------------------------------

def test_every_state_has_a_row_for_every_event_ending_with_one_that_always_holds():
    rows = collections.defaultdict(list)
    for row in TABLE.rows:
        rows[row.state, row.event].append(row)
    for state in State:
        for event in EVENTS:
            assert (state, event) in rows, (state, event)
            assert rows[state, event][-1].when is None, rows[state, event]
            assert all(r.when is not None for r in rows[state, event][:-1]), rows[state, event]


def test_every_row_holds_a_handler_and_every_state_is_reachable():
    for row in TABLE.rows:
        assert getattr(Handshake, row.does.__name__) is row.does, row
    reached, frontier = {State.DIALLING}, [State.DIALLING]
    while frontier:
        state = frontier.pop()
        for row in TABLE.rows:
            if row.state is state and row.next not in reached:
                reached.add(row.next)
                frontier.append(row.next)
    assert reached == set(State)


def test_every_pair_of_a_state_and_an_event_is_handled():
    coverage = TABLE.coverage()
    assert coverage.uncovered == () and not coverage.refused and len(coverage.handled) == len(State) * len(EVENTS)


def test_the_table_prints_as_markdown():
    text = hs.markdown()
    assert text.count("\n") == len(TABLE.rows) + 2 and "| up | Closed |  | close | down |" in text


# --- the life of a link ---------------------------------------------------------------------------

def test_a_wait_says_hello_and_is_resolved_by_the_answer(link):
    assert kinds(link.handle(Wait(1, 5.0))) == [SendHello, StartTimer]
    assert link.state is State.HELLO_SENT
    assert link.handle(Wait(2, 2.0))[-1] == StartTimer(2, 2.0)
    actions = link.handle(Answered("node-b", 7))
    assert [a for a in actions if type(a) is Resolve] == [Resolve(1), Resolve(2)]
    assert link.state is State.UP and (link.node_id, link.incarnation) == ("node-b", 7)
    assert link.handle(Wait(3, 5.0)) == [Resolve(3)]  # up: at once, no hello
    assert link.handle(Expired(1)) == []  # a timer that fired late changes nothing


def test_an_unanswered_wait_fails_with_its_budget_and_marks_the_link_down(link, clock):
    link.handle(Wait(1, 1.5))
    clock.now += 1.5
    [fail] = link.handle(Expired(1))
    assert type(fail) is Fail and isinstance(fail.error, PeerUnavailable)
    assert fail.error.message == "peer B (tcp://127.0.0.1:9) did not answer within 1.5s"
    assert link.state is State.DOWN and link.down_since == clock.now


def test_a_link_known_down_gives_a_wait_only_the_grace(link, clock):
    up(link)
    assert kinds(link.handle(Closed())) == [Lost]
    assert link.state is State.DOWN
    clock.now += 3.0
    assert link.handle(Wait(2, 5.0))[-1] == StartTimer(2, DOWN_GRACE)
    assert link.handle(Wait(3, 0.2))[-1] == StartTimer(3, 0.2)  # (a shorter budget is kept)
    clock.now += DOWN_GRACE
    [fail] = link.handle(Expired(2))
    assert fail.error.message == (f"peer B (tcp://127.0.0.1:9) is not connected (its connection closed "
                                  f"{3.0 + DOWN_GRACE:.1f}s ago) and did not answer within {DOWN_GRACE:g}s")
    # the peer comes back: the pending wait is resolved, and the link is up again
    assert [a for a in link.handle(Answered("node-b", 7)) if type(a) is Resolve] == [Resolve(3)]
    assert link.state is State.UP


def test_a_new_incarnation_reports_the_old_link_lost(link):
    up(link)
    link.handle(Closed())
    actions = link.handle(Answered("node-b", 8))
    assert Lost("peer B restarted") in actions and link.state is State.UP


def test_a_heartbeat_pings_when_up_and_says_hello_otherwise(link):
    assert link.handle(Heartbeat(backlog=False)) == [SendHello()]
    assert link.state is State.HELLO_SENT
    # the hello is still queued a heartbeat later: there is no connection to send it on
    assert link.handle(Heartbeat(backlog=True)) == [] and link.state is State.DOWN
    assert link.handle(Heartbeat(backlog=False)) == [SendHello()] and link.state is State.DOWN
    up(link)
    assert link.handle(Heartbeat(backlog=False)) == [SendPing()]
    assert link.handle(Heartbeat(backlog=True)) == [] and link.state is State.UP


def test_silence_marks_the_link_down_without_reporting_it_twice(link):
    up(link)
    assert kinds(link.handle(Silent())) == []  # (the heartbeat reports the loss itself)
    assert link.state is State.DOWN and link.down_why == "it went silent"
    assert link.handle(Closed()) == [] and link.handle(Silent()) == []


def test_a_refusal_fails_every_waiter_at_once_and_dials_again_later(link, clock):
    link.handle(Wait(1, 5.0))
    link.handle(Wait(2, 5.0))
    refusal = Unauthorized("peer B refused this daemon's CURVE key")
    actions = link.handle(Refused(refusal, redial=True))
    assert [type(a) for a in actions] == [Fail, Fail]
    assert all(a.error.message == refusal.message and a.error is not refusal for a in actions)  # one each
    assert link.state is State.REFUSED and link.refusal is refusal
    assert link.handle(Heartbeat(backlog=False)) == [SendHello()]  # not yet due
    clock.now += REDIAL_INTERVAL
    assert link.handle(Heartbeat(backlog=False)) == [Redial(), SendHello()]
    assert link.handle(Heartbeat(backlog=False)) == [SendHello()]  # (once)


def test_a_wait_on_a_refused_link_dials_again_and_gets_the_refusal_on_expiry(link, clock):
    refusal = Unauthorized("peer B refused this daemon")
    link.handle(Refused(refusal, redial=True))
    assert kinds(link.handle(Wait(1, 5.0))) == [Redial, SendHello, StartTimer]
    [fail] = link.handle(Expired(1))
    assert type(fail.error) is Unauthorized and fail.error.message == refusal.message
    assert link.state is State.REFUSED


def test_a_retried_handshake_keeps_its_reason_for_the_timeout(link):
    link.handle(Wait(1, 2.0))
    assert link.handle(Retrying(PeerUnavailable("the ZeroMQ handshake failed"))) == []
    assert link.state is State.HELLO_SENT  # ZeroMQ retries: the wait goes on
    [fail] = link.handle(Expired(1))
    assert fail.error.message == "the ZeroMQ handshake failed"
    link.handle(Answered("node-b", 1))
    assert link.refusal is None  # an answer clears it


def test_forgotten_by_the_peer_says_hello_again_only_when_up(link):
    assert link.handle(Forgotten("say peer_hello first")) == [Forward()]  # not ours: the transfers'
    up(link)
    assert kinds(link.handle(Forgotten("say peer_hello first"))) == [SendHello]
    assert link.state is State.HELLO_SENT


def test_protocol_md_prints_the_handshake_table_as_it_is():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "proto" / "PROTOCOL.md").read_text()
    found = re.search(r"<!-- handshake table: begin[^>]*-->\n(.*?)<!-- handshake table: end -->", text, re.S)
    assert found, "proto/PROTOCOL.md has lost its handshake table markers"
    assert found.group(1) == hs.markdown(), \
        "proto/PROTOCOL.md's handshake table is stale: paste the output of python -m kvd.daemon.peer.link_state"
