"""kvd.daemon.store.intervals: disjoint byte intervals, checked against a set of bytes."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvd.daemon.store.intervals import Intervals


def test_adjacent_intervals_merge_and_gaps_are_what_is_left():
    spans = Intervals()
    for lo, hi in ((10, 20), (30, 40), (20, 30), (50, 55)):
        assert not spans.overlaps(lo, hi)
        spans.add(lo, hi)
    assert (spans._starts, spans._ends) == ([10, 50], [40, 55])
    assert spans.covered == 35
    assert spans.gaps(0, 60) == [(0, 10), (40, 50), (55, 60)]
    assert spans.gaps(12, 38) == []
    assert spans.gaps(38, 52) == [(40, 50)]
    assert spans.overlaps(39, 41) and spans.overlaps(0, 11) and not spans.overlaps(40, 50)
    spans.add(5, 5)  # empty: nothing
    assert spans.covered == 35


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 15)), max_size=30))
def test_matches_a_set_of_bytes(ranges):
    spans, model = Intervals(), set()
    for lo, length in ranges:
        hi = lo + length
        assert spans.overlaps(lo, hi) == bool(model & set(range(lo, hi)))
        if not spans.overlaps(lo, hi):
            spans.add(lo, hi)
            model |= set(range(lo, hi))
    assert spans.covered == len(model)
    left = {b for lo, hi in spans.gaps(0, 80) for b in range(lo, hi)}
    assert left == set(range(80)) - model
