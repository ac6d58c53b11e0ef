"""The KV tier's event log (kvd.daemon.store.tier_events) through the store that notes into it,
pure: stored and removed pages of a followed namespace, a follower that falls behind or follows a
log that is gone told it lost its place, logs kept only while somebody reads them."""
from __future__ import annotations

import pytest

from kvd.daemon.store import tier_events
from kvd.daemon.store.page_store import CacheStore, SharedPool
from kvd.daemon.store.tier_events import REMOVED, STORED, TierEvents
from kvd.errors import BadRequest

BLOCK = 4096
PAGE = ["uint8", [BLOCK]]


def put(cache: CacheStore, keys: list[str], namespace: str = "ns") -> None:
    token, _ = cache.reserve(namespace, keys, [PAGE] * len(keys))
    cache.commit(token)


def follow(events: TierEvents, namespace: str = "ns"):
    """A follower: each call returns the events since its last, and whether it lost its place."""
    cursor = {"epoch": 0, "since": 0}

    def poll() -> tuple[list, bool]:
        answer = events.read(namespace, cursor["epoch"], cursor["since"])
        cursor.update(epoch=answer["epoch"], since=answer["next"])
        return [tuple(e) for e in answer["events"]], answer["lost"]
    return poll


def test_a_follower_sees_what_was_stored_and_evicted_after_it_started_following():
    cache = CacheStore(SharedPool(16), BLOCK, 4 * BLOCK)  # room for 4 pages
    put(cache, ["before"])  # nobody follows yet: nothing is logged
    poll = follow(cache.events)
    assert poll() == ([], False)
    put(cache, ["a", "b", "c"])
    put(cache, ["d", "e"])  # the budget holds 4: the two least recently used go (at the reservation)
    events, lost = poll()
    assert not lost
    assert events == [(STORED, "a"), (STORED, "b"), (STORED, "c"), (REMOVED, "before"), (REMOVED, "a"),
                      (STORED, "d"), (STORED, "e")]
    assert poll() == ([], False)  # nothing twice
    assert cache.clear("ns") == 4
    assert sorted(poll()[0]) == [(REMOVED, k) for k in ("b", "c", "d", "e")]
    put(cache, ["x"], namespace="other")  # another namespace's pages are not this log's
    assert poll() == ([], False)


def test_a_put_given_up_or_a_held_key_put_again_is_no_event():
    cache = CacheStore(SharedPool(16), BLOCK, 8 * BLOCK)
    poll = follow(cache.events)
    poll()
    token, _ = cache.reserve("ns", ["a"], [PAGE])
    cache.commit(token, ok=False)  # never visible: never stored, never removed
    put(cache, ["b"])
    put(cache, ["b"])  # already held
    assert poll() == ([(STORED, "b")], False)


def test_a_follower_that_falls_behind_the_log_is_told_it_lost_events(monkeypatch):
    monkeypatch.setattr(tier_events, "CAPACITY", 4)
    events = TierEvents()
    poll = follow(events)
    poll()
    for i in range(6):
        events.note("ns", STORED, f"k{i}")
    got, lost = poll()
    assert lost and got == [(STORED, f"k{i}") for i in range(2, 6)]
    assert poll() == ([], False)


def test_a_long_backlog_comes_in_bounded_answers(monkeypatch):
    monkeypatch.setattr(tier_events, "MAX_REPLY", 3)
    events = TierEvents()
    poll = follow(events)
    poll()
    for i in range(7):
        events.note("ns", REMOVED, f"k{i}")
    answers = [poll()[0] for _ in range(4)]
    assert [len(a) for a in answers] == [3, 3, 1, 0]
    assert [k for a in answers for _, k in a] == [f"k{i}" for i in range(7)]


def test_a_log_nobody_reads_goes_and_its_follower_learns_it_lost_its_place():
    now = [0.0]
    events = TierEvents(clock=lambda: now[0])
    poll = follow(events)
    poll()
    events.note("ns", STORED, "a")
    now[0] += tier_events.IDLE + 1
    other = follow(events, "other")
    other()  # a read of anything drops the idle logs
    events.note("ns", STORED, "b")  # not logged: nobody follows ns any more
    assert poll() == ([], True)  # (the log was made anew: another epoch)
    events.note("ns", STORED, "c")
    assert poll() == ([(STORED, "c")], False)


def test_at_most_max_followed_logs_the_least_recently_read_going_first(monkeypatch):
    monkeypatch.setattr(tier_events, "MAX_FOLLOWED", 2)
    now = [0.0]
    events = TierEvents(clock=lambda: now[0])
    polls = {}
    for name in ("a", "b", "c"):
        now[0] += 1
        polls[name] = follow(events, name)
        polls[name]()
    assert events.followed() == 2
    assert polls["a"]() == ([], True)  # a's log went for c's; it starts over (b's goes now)
    assert polls["c"]() == ([], False)


@pytest.mark.parametrize("epoch,since", [(-1, 0), (0, -2), ("1", 0), (1, 1.5)])
def test_bad_cursors_are_refused(epoch, since):
    with pytest.raises(BadRequest, match="cache_events"):
        TierEvents().read("ns", epoch, since)
