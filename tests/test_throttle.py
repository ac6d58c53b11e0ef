"""kvd.throttle: one line per key per interval, the rest counted, the memory bounded."""
from __future__ import annotations

from kvd.throttle import Throttle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_key_per_interval():
    clock = Clock()
    throttle = Throttle(60.0, clock=clock)
    assert throttle.allow("a")
    assert not throttle.allow("a")
    assert throttle.allow("b")  # each key has its own interval
    clock.now += 59.9
    assert not throttle.allow("a")
    clock.now += 0.1
    assert throttle.allow("a")
    assert not throttle.allow("a")


def test_due_says_how_many_lines_were_held_back():
    clock = Clock()
    throttle = Throttle(30.0, clock=clock)
    assert throttle.due("x") == 0
    for _ in range(49):
        assert throttle.due("x") is None
    clock.now += 30.0
    assert throttle.due("x") == 49
    clock.now += 30.0
    assert throttle.due("x") == 0  # counted since the last line only


def test_the_keys_remembered_are_bounded():
    clock = Clock()
    throttle = Throttle(60.0, keys=4, clock=clock)
    for key in range(4):
        assert throttle.allow(key)
    assert not throttle.allow(0)
    assert throttle.allow(4)  # a fifth key: everyone is forgotten, and it is let through
    assert len(throttle._last) == 1
    assert throttle.allow(0)  # (forgotten: said again, once)


def test_the_first_line_of_a_key_always_goes_through_even_at_clock_zero():
    throttle = Throttle(60.0, clock=lambda: 0.0)
    assert throttle.allow()
    assert not throttle.allow()
