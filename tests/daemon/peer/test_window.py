"""kvd.daemon.transfer.window: the sender's window and the receiver's ledger, without sockets."""
from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.daemon.transfer.window import ReceiveLedger, SendWindow
from kvd.errors import ProtocolError
from kvd.wire.layout import chunk_ranges

# ---- SendWindow ---------------------------------------------------------------------------


def test_whole_window_cuts_the_entry_into_chunks():
    w = SendWindow.whole(total_bytes=95, chunk_size=10, max_in_flight=3)
    assert w.chunks == chunk_ranges(95, 10)
    assert w.queued_bytes == 95
    assert not w.all_acked


def test_window_opens_up_to_its_size():
    w = SendWindow.whole(total_bytes=100, chunk_size=10, max_in_flight=3)
    assert len(w.chunks) == 10
    assert w.ready_to_send() == [0, 1, 2]
    assert w.in_flight == {0, 1, 2}
    assert w.ready_to_send() == []  # full until an ack
    w.ack(1)
    assert w.ready_to_send() == [3]
    w.ack(0)
    w.ack(2)
    assert w.ready_to_send() == [4, 5]
    assert not w.all_acked


def test_window_larger_than_chunk_count():
    w = SendWindow.whole(total_bytes=25, chunk_size=10, max_in_flight=8)
    assert w.ready_to_send() == [0, 1, 2]
    assert w.ready_to_send() == []
    for seq in (2, 0, 1):
        w.ack(seq)
    assert w.all_acked


def test_ack_of_unsent_or_repeated_seq_raises():
    w = SendWindow.whole(total_bytes=40, chunk_size=10, max_in_flight=2)
    with pytest.raises(ProtocolError, match="not in flight"):
        w.ack(0)  # nothing sent yet
    assert w.ready_to_send() == [0, 1]
    w.ack(0)
    with pytest.raises(ProtocolError, match="not in flight"):
        w.ack(0)  # acked twice
    with pytest.raises(ProtocolError, match="not in flight"):
        w.ack(3)  # not sent yet
    with pytest.raises(ProtocolError, match="not in flight"):
        w.ack(-1)
    with pytest.raises(ProtocolError, match="not in flight"):
        w.ack(99)
    assert w.acked == 1
    assert w.in_flight == {1}


def test_zero_byte_window_is_done_at_once():
    w = SendWindow.whole(total_bytes=0, chunk_size=10, max_in_flight=4)
    assert w.chunks == []
    assert w.ready_to_send() == []
    assert w.all_acked


def test_streamed_ranges_are_sent_as_they_are_queued():
    w = SendWindow(total_bytes=30, chunk_size=8, max_in_flight=4)
    assert w.ready_to_send() == []
    assert not w.all_acked  # nothing queued yet is not "done"
    w.add_range(0, 12)
    assert w.chunks == [(0, 8), (8, 4)]  # a range is cut on its own, never merged with the next
    assert w.ready_to_send() == [0, 1]
    w.ack(0)
    w.ack(1)
    assert not w.all_acked  # acked everything queued, but the entry is not all queued
    w.add_range(12, 18)
    assert w.chunks[2:] == [(12, 8), (20, 8), (28, 2)]
    assert w.ready_to_send() == [2, 3, 4]
    for seq in (4, 2, 3):
        w.ack(seq)
    assert w.queued_bytes == 30
    assert w.all_acked


def test_queueing_more_than_the_entry_raises():
    w = SendWindow(total_bytes=10, chunk_size=4, max_in_flight=2)
    w.add_range(0, 6)
    with pytest.raises(ProtocolError, match="not inside"):
        w.add_range(6, 5)
    with pytest.raises(ProtocolError, match="not inside"):
        w.add_range(-1, 2)
    w.add_range(6, 4)
    with pytest.raises(ProtocolError, match="more bytes"):
        w.add_range(0, 6)
    assert w.queued_bytes == 10
    assert w.chunks == [(0, 4), (4, 2), (6, 4)]
    with pytest.raises(ProtocolError):
        SendWindow.whole(total_bytes=5, chunk_size=4, max_in_flight=1).add_range(0, 1)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 500), st.integers(1, 64), st.integers(1, 10), st.randoms(use_true_random=False))
def test_window_never_exceeds_limit_and_finishes(total, chunk, window, rnd):
    w = SendWindow.whole(total_bytes=total, chunk_size=chunk, max_in_flight=window)
    sent: list[int] = []
    outstanding: set[int] = set()
    while True:
        new = w.ready_to_send()
        assert len(set(new)) == len(new)
        assert not set(new) & set(sent)  # each chunk sent once
        sent.extend(new)
        outstanding |= set(new)
        assert len(w.in_flight) <= window
        assert w.in_flight == outstanding
        if not outstanding:
            break
        assert not w.all_acked
        seq = rnd.choice(sorted(outstanding))
        w.ack(seq)
        outstanding.discard(seq)
    assert sent == list(range(len(w.chunks)))  # sent in order
    assert w.all_acked
    assert w.acked == len(w.chunks)
    assert sum(n for _, n in w.chunks) == total


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=6), st.integers(1, 16), st.integers(1, 5))
def test_streamed_window_chunks_partition_the_entry(pieces, chunk, window):
    total = sum(pieces)
    w = SendWindow(total_bytes=total, chunk_size=chunk, max_in_flight=window)
    offset = 0
    for piece in pieces:
        w.add_range(offset, piece)
        offset += piece
        for seq in w.ready_to_send():
            assert len(w.in_flight) <= window
            w.ack(seq)
        while w.next_seq < len(w.chunks):
            for seq in w.ready_to_send():
                w.ack(seq)
    covered = sorted(w.chunks)
    cursor = 0
    for start, length in covered:
        assert start == cursor and 0 < length <= chunk
        cursor += length
    assert cursor == total
    assert w.all_acked


# ---- ReceiveLedger ------------------------------------------------------------------------


def test_ledger_accepts_each_chunk_once_in_any_order():
    ledger = ReceiveLedger(total_bytes=25, max_chunk=10)
    chunks = {0: (0, 10), 1: (10, 10), 2: (20, 5)}
    for seq in (2, 0, 1):
        assert not ledger.complete
        offset, length = chunks[seq]
        ledger.check(seq, offset, length)
        ledger.mark(seq, offset, length)
    assert ledger.complete
    assert ledger.received_bytes == 25
    assert ledger._received.gaps(0, 25) == []


def test_ledger_rejects_duplicate_seq():
    ledger = ReceiveLedger(total_bytes=25, max_chunk=10)
    ledger.check(1, 10, 10)
    ledger.mark(1, 10, 10)
    with pytest.raises(ProtocolError, match="twice"):
        ledger.check(1, 10, 10)
    with pytest.raises(ProtocolError, match="twice"):
        ledger.check(1, 0, 10)  # even at a fresh position


def test_ledger_rejects_negative_seq():
    ledger = ReceiveLedger(total_bytes=25, max_chunk=10)
    with pytest.raises(ProtocolError, match="negative"):
        ledger.check(-1, 0, 10)


@pytest.mark.parametrize("offset, length", [
    (0, 0), (0, -1), (0, 11),        # size outside 1..max_chunk
    (-1, 5), (20, 6), (25, 1), (30, 2),  # outside the entry
])
def test_ledger_rejects_chunks_of_bad_size_or_position(offset, length):
    ledger = ReceiveLedger(total_bytes=25, max_chunk=10)
    with pytest.raises(ProtocolError):
        ledger.check(0, offset, length)
    assert ledger.received_bytes == 0


@pytest.mark.parametrize("offset, length", [(5, 10), (9, 1), (10, 10), (14, 3), (0, 10), (14, 10), (0, 6)])
def test_ledger_rejects_overlap_with_received_bytes(offset, length):
    ledger = ReceiveLedger(total_bytes=40, max_chunk=10)
    ledger.check(0, 5, 10)  # [5, 15)
    ledger.mark(0, 5, 10)
    with pytest.raises(ProtocolError, match="overlaps"):
        ledger.check(1, offset, length)


@pytest.mark.parametrize("offset, length", [(0, 5), (15, 10), (1, 4), (15, 1)])
def test_ledger_accepts_neighbours_that_touch(offset, length):
    ledger = ReceiveLedger(total_bytes=40, max_chunk=10)
    ledger.mark(0, 5, 10)  # [5, 15)
    ledger.check(1, offset, length)


def test_zero_byte_ledger_is_complete_immediately():
    ledger = ReceiveLedger(total_bytes=0, max_chunk=10)
    assert ledger.complete
    with pytest.raises(ProtocolError):
        ledger.check(0, 0, 0)
    with pytest.raises(ProtocolError):
        ledger.check(0, 0, 1)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 200), st.integers(1, 32), st.lists(st.tuples(st.integers(-5, 210), st.integers(-2, 40)),
                                                          max_size=40))
def test_ledger_matches_a_byte_map(total, max_chunk, attempts):
    """Accept exactly the chunks that are in range and overlap nothing received; count bytes right."""
    ledger = ReceiveLedger(total_bytes=total, max_chunk=max_chunk)
    have = [False] * total
    for seq, (offset, length) in enumerate(attempts):
        ok = 0 < length <= max_chunk and offset >= 0 and offset + length <= total \
            and not any(have[offset:offset + length])
        try:
            ledger.check(seq, offset, length)
        except ProtocolError:
            assert not ok, (offset, length)
            continue
        assert ok, (offset, length)
        ledger.mark(seq, offset, length)
        for i in range(offset, offset + length):
            have[i] = True
        assert ledger.received_bytes == sum(have)
        # the interval list is sorted, disjoint, non-touching and matches the byte map
        intervals = list(zip(ledger._received._starts, ledger._received._ends))
        for (a, b), (c, _) in itertools.pairwise(intervals):
            assert a < b < c
        assert sum(b - a for a, b in intervals) == sum(have)
        assert all(have[i] for a, b in intervals for i in range(a, b))
    assert ledger.complete == all(have)


def test_window_and_ledger_agree():
    rng = random.Random(7)
    for total, chunk in [(1, 1), (4096, 1024), (10_000, 4096), (123_457, 1000)]:
        w = SendWindow.whole(total_bytes=total, chunk_size=chunk, max_in_flight=4)
        ledger = ReceiveLedger(total_bytes=total, max_chunk=chunk)
        while not w.all_acked:
            batch = w.ready_to_send()
            rng.shuffle(batch)
            for seq in batch:
                offset, length = w.chunks[seq]
                ledger.check(seq, offset, length)
                ledger.mark(seq, offset, length)
                w.ack(seq)
        assert ledger.complete


def test_all_sent_is_every_byte_queued_and_out():
    w = SendWindow(total_bytes=10, chunk_size=4, max_in_flight=8)
    assert not w.all_sent  # nothing queued
    w.add_range(0, 6)
    w.ready_to_send()
    assert not w.all_sent  # out, but the entry is not all queued (a stream still writing)
    w.add_range(6, 4)
    assert not w.all_sent
    assert w.ready_to_send() == [2]
    assert w.all_sent and not w.all_acked  # `done` may now end it; no ack was needed


def test_a_plane_window_grows_its_last_unsent_chunk_with_the_next_range():
    window = SendWindow(100, 40, 1, coalesce=True)
    window.add_range(0, 10)
    window.add_range(10, 10)  # next to the unsent last chunk: it grows
    assert window.chunks == [(0, 20)]
    assert window.ready_to_send() == [0]
    window.add_range(20, 30)  # the last chunk has gone: a new one, which grows up to chunk_size only
    window.add_range(50, 25)
    assert window.chunks == [(0, 20), (20, 40), (60, 15)] and window.queued_bytes == 75
    window.add_range(80, 5)  # not next to it: its own chunk
    assert window.chunks[-1] == (80, 5) and window.queued_bytes == 80


def test_a_frames_window_never_coalesces():
    window = SendWindow(100, 40, 1)
    window.add_range(0, 10)
    window.add_range(10, 10)
    assert window.chunks == [(0, 10), (10, 10)]
