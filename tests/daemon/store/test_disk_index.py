"""The disk level's index (kvd.daemon.tier.disk.disk_index), pure: the budget is a hard cap on the files
(a deleted file counts until it is unlinked), least recently used first, no write before the scan,
no new file of a key whose old one is not unlinked yet, clears and writes in flight."""
from __future__ import annotations

from kvd.daemon.tier.disk.disk_format import disk_bytes
from kvd.daemon.tier.disk.disk_index import DiskIndex

PAGE = 4096  # a page of 4 KiB takes 8 KiB on disk (its header, and its bytes)
COST = disk_bytes(PAGE)


def ready(budget_pages: int, max_pages: int = 1000) -> DiskIndex:
    index = DiskIndex(budget_pages * COST, max_pages)
    index.ready = True
    return index


def write(index: DiskIndex, key: str, namespace: str = "ns") -> list[str]:
    """A write of a page, done; returns the keys evicted for it (their files unlinked at once)."""
    evicted = []
    booked = index.reserve(namespace, key, PAGE)
    while booked.page is None and booked.why == "wait":  # (the evicted files count until unlinked)
        evicted += booked.evicted
        for page in booked.evicted:
            index.deleted(page)
        booked = index.reserve(namespace, key, PAGE)
    assert booked.page is not None, booked.why
    assert booked.evicted == [] or evicted == []
    for page in booked.evicted:
        index.deleted(page)
    assert index.written(booked.page, True)
    index.check_invariants()
    return [p.key for p in evicted + booked.evicted]


def test_no_write_before_the_scan_and_a_page_over_the_budget_is_refused():
    index = DiskIndex(4 * COST, 100)
    assert index.reserve("ns", "a", PAGE).why == "not_ready"
    index.ready = True
    assert index.reserve("ns", "big", 4 * COST).why == "too_big"
    write(index, "a")
    assert index.reserve("ns", "a", PAGE).why == "held"


def test_the_budget_evicts_least_recently_used_first_and_touch_keeps_a_page():
    index = ready(3)
    for key in "abc":
        assert write(index, key) == []
    index.touch(index.lookup("ns", "a"))
    assert write(index, "d") == ["b"]
    assert write(index, "e") == ["c"]
    assert [k for k in "abcde" if index.lookup("ns", k)] == ["a", "d", "e"]
    assert index.used == 3 * COST and index.counts.evictions == 2


def test_a_file_being_deleted_counts_until_it_is_unlinked():
    index = ready(2)
    write(index, "a")
    write(index, "b")
    booked = index.reserve("ns", "c", PAGE)
    assert booked.page is None and booked.why == "wait" and [p.key for p in booked.evicted] == ["a"]
    assert index.used == 2 * COST  # a's file is still there
    assert index.reserve("ns", "a", PAGE).why == "wait"  # a new file of a could be taken by a's unlink
    index.deleted(booked.evicted[0])
    index.check_invariants()
    assert write(index, "c") == []


def test_pages_being_written_fill_the_budget_and_a_failed_write_gives_its_room_back():
    index = ready(2)
    first, second = index.reserve("ns", "a", PAGE), index.reserve("ns", "b", PAGE)
    assert first.page and second.page
    assert index.reserve("ns", "c", PAGE).why == "full"  # nothing visible to evict
    assert index.lookup("ns", "a") is None and index.writing("ns", "a") is first.page
    assert not index.written(first.page, False)
    assert index.used == COST and index.reserve("ns", "a", PAGE).page is not None
    index.check_invariants()


def test_max_pages_counts_pages_whatever_their_size():
    index = ready(100, max_pages=2)
    write(index, "a")
    write(index, "b")
    assert write(index, "c") == ["a"]


def test_clear_unlists_a_namespace_and_a_write_in_flight_is_not_kept():
    index = ready(10)
    write(index, "a", "x")
    write(index, "b", "x")
    write(index, "a", "y")
    flying = index.reserve("x", "c", PAGE).page
    count, gone = index.clear("x")
    assert count == 2 and {p.key for p in gone} == {"a", "b"}
    assert index.lookup("x", "a") is None and index.lookup("y", "a") is not None
    assert index.namespace("x").entries == 0 and index.namespace("y").entries == 1
    assert not index.written(flying, True)  # its file goes with the namespace's directory
    for page in [*gone, flying]:
        index.deleted(page)
    index.check_invariants()
    assert index.used == COST


def test_the_scan_lists_what_it_finds_in_file_time_order_and_trim_keeps_the_budget():
    index = DiskIndex(2 * COST, 100)
    for key in "abc":
        assert index.found("ns", key, PAGE, COST) is not None
    assert index.found("ns", "a", PAGE, COST) is None  # listed already
    index.order([("ns", "c"), ("ns", "a"), ("ns", "b")])  # oldest first
    index.ready = True
    assert [p.key for p in index.trim()] == ["c"]
    assert index.counts.found == 3 and index.entries == 2
