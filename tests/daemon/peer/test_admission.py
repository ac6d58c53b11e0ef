"""kvd.daemon.peer.admission: the ROUTER's side of the handshake, bookkeeping alone (no socket)."""
from __future__ import annotations

from kvd.daemon.peer.admission import READMIT_EVERY, REMEMBERED_REFUSALS, Admissions


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_a_connection_past_the_cap_is_cut_and_a_closed_one_frees_its_place():
    a = Admissions(2, 5.0, Clock())
    assert a.accepted(10) is None and a.accepted(11) is None
    assert a.accepted(12) == "more than 2 peer connections (--max-peer-connections)"
    assert a.closed(12) is None and a.closed(11) is None  # (none had said hello)
    assert a.accepted(13) is None


def test_a_connection_silent_past_connect_timeout_is_overdue_once():
    clock = Clock()
    a = Admissions(8, 5.0, clock)
    a.accepted(10)
    clock.now += 1
    a.accepted(11)
    a.admitted(11, b"rid-11")  # said hello in time: never overdue
    clock.now += 4.5
    assert a.overdue() == [(10, "no peer_hello within 5s")]
    assert a.overdue() == []
    assert a.closed(11) == b"rid-11" and a.closed(11) is None


def test_a_hello_before_its_accept_event_is_not_counted_twice():
    a = Admissions(1, 5.0, Clock())
    a.admitted(10, b"rid")
    assert a.accepted(10) is None  # the monitor is another socket: its event may come second
    assert a.accepted(11) == "more than 1 peer connections (--max-peer-connections)"


def test_readmission_is_due_once_per_interval():
    clock = Clock()
    a = Admissions(8, 5.0, clock)
    assert a.readmit_due() and not a.readmit_due()
    clock.now += READMIT_EVERY
    assert a.readmit_due()


def test_refusals_are_remembered_within_a_bound():
    a: Admissions[str] = Admissions(8, 5.0, Clock())
    for i in range(REMEMBERED_REFUSALS):
        a.refuse(b"%d" % i, f"no {i}")
    assert a.refusal(b"0") == "no 0"
    a.refuse(b"one more", "no")
    assert a.refusal(b"0") is None and a.refusal(b"one more") == "no"
