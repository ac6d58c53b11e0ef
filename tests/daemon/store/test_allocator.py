"""BlockAllocator (kvd.daemon.store.allocator): extents, best fit, fragmented fallback, coalescing, PoolFull."""
from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvd.daemon.store.allocator import BlockAllocator
from kvd.errors import PoolFull


def blocks_of(extents) -> list[int]:
    return [b for start, count in extents for b in range(start, start + count)]


def test_fresh_pool_is_one_free_extent():
    a = BlockAllocator(16)
    assert a.free_blocks == 16 and a.used_blocks == 0
    assert a.largest_free_extent() == 16
    a.check_invariants()


@pytest.mark.parametrize("n", [0, -1])
def test_pool_needs_a_block(n):
    with pytest.raises(ValueError):
        BlockAllocator(n)


def test_allocate_zero_is_empty_and_free_nothing():
    a = BlockAllocator(4)
    assert a.allocate(0) == []
    assert a.free_blocks == 4
    a.free([])
    assert a.free_blocks == 4
    a.check_invariants()


def test_allocate_and_free_simple():
    a = BlockAllocator(10)
    x = a.allocate(3)
    y = a.allocate(4)
    assert x == [(0, 3)]
    assert y == [(3, 4)]
    assert a.free_blocks == 3 and a.used_blocks == 7
    a.check_invariants()
    a.free(x)
    assert a.free_blocks == 6
    a.check_invariants()
    a.free(y)
    assert a.free_blocks == 10
    assert a.largest_free_extent() == 10
    a.check_invariants()


def test_free_coalesces_with_both_neighbours():
    a = BlockAllocator(9)
    x, y, z = a.allocate(3), a.allocate(3), a.allocate(3)
    assert a.free_blocks == 0 and a.largest_free_extent() == 0
    a.free(x)
    a.free(z)
    assert a._free == [(0, 3), (6, 3)]
    assert a.largest_free_extent() == 3
    a.free(y)  # bridges both
    assert a._free == [(0, 9)]
    a.check_invariants()


def test_free_coalesces_with_previous_only_and_next_only():
    a = BlockAllocator(12)
    parts = [a.allocate(3) for _ in range(4)]  # (0,3) (3,3) (6,3) (9,3)
    a.free(parts[0])
    a.free(parts[1])  # merges with previous
    assert a._free == [(0, 6)]
    a.free(parts[3])
    a.free(parts[2])  # merges with both
    assert a._free == [(0, 12)]
    b = BlockAllocator(12)
    parts = [b.allocate(3) for _ in range(4)]
    b.free(parts[2])
    b.free(parts[1])  # merges with next only
    assert b._free == [(3, 6)]
    b.check_invariants()


def test_best_fit_prefers_exact_extent():
    a = BlockAllocator(20)
    e1 = a.allocate(3)   # 0-2
    a.allocate(1)        # 3
    e2 = a.allocate(2)   # 4-5
    a.allocate(1)        # 6
    e3 = a.allocate(5)   # 7-11
    a.allocate(1)        # 12
    # tail 13-19 free (7 blocks)
    a.free(e1)
    a.free(e2)
    a.free(e3)
    assert a._free == [(0, 3), (4, 2), (7, 5), (13, 7)]
    assert a.allocate(2) == [(4, 2)]   # exact, though (0, 3) comes first
    assert a.allocate(5) == [(7, 5)]   # exact, not the bigger tail
    assert a.allocate(2) == [(0, 2)]   # best fit: smallest extent that holds it
    assert a.allocate(6) == [(13, 6)]
    a.check_invariants()


def test_best_fit_picks_smallest_sufficient_extent():
    a = BlockAllocator(30)
    big = a.allocate(10)    # 0-9
    a.allocate(1)           # 10
    mid = a.allocate(6)     # 11-16
    a.allocate(1)           # 17
    small = a.allocate(4)   # 18-21
    a.allocate(8)           # 22-29, pool now full
    for e in (big, mid, small):
        a.free(e)
    assert a.allocate(5) == [(11, 5)]  # 6 is the smallest extent >= 5
    assert a.allocate(3) == [(18, 3)]  # 4 is the smallest extent >= 3
    a.check_invariants()


def test_fragmented_fallback_covers_exactly_count_blocks():
    a = BlockAllocator(12)
    parts = [a.allocate(2) for _ in range(6)]  # (0,2) (2,2) ... (10,2)
    for part in parts[::2]:
        a.free(part)  # free (0,2) (4,2) (8,2): 6 free blocks, none contiguous beyond 2
    assert a.free_blocks == 6 and a.largest_free_extent() == 2
    got = a.allocate(5)
    assert len(got) >= 3
    covered = blocks_of(got)
    assert len(covered) == 5 == len(set(covered))
    assert set(covered) <= {0, 1, 4, 5, 8, 9}
    assert a.free_blocks == 1
    a.check_invariants()
    # the extents must not overlap what is still held
    held = set(blocks_of(parts[1]) + blocks_of(parts[3]) + blocks_of(parts[5]))
    assert not held & set(covered)
    a.free(got)
    assert a.free_blocks == 6
    a.check_invariants()


def test_fragmented_fallback_takes_largest_first():
    a = BlockAllocator(20)
    e1 = a.allocate(2)   # 0-1
    a.allocate(1)
    e2 = a.allocate(5)   # 3-7
    a.allocate(1)
    e3 = a.allocate(3)   # 9-11
    a.allocate(8)        # 12-19
    for e in (e1, e2, e3):
        a.free(e)
    got = a.allocate(9)
    assert got[0] == (3, 5)
    assert got[1] == (9, 3)
    assert got[2] == (0, 1)
    assert sum(n for _, n in got) == 9
    assert a._free == [(1, 1)]
    a.check_invariants()


def test_pool_full_when_count_exceeds_free():
    a = BlockAllocator(8)
    a.allocate(6)
    with pytest.raises(PoolFull, match="pool full") as info:
        a.allocate(3)
    assert "3" in str(info.value) and "8" in str(info.value)
    # nothing changed
    assert a.free_blocks == 2
    a.check_invariants()
    assert a.allocate(2) == [(6, 2)]
    with pytest.raises(PoolFull, match="pool full"):
        a.allocate(1)
    with pytest.raises(PoolFull, match="pool full"):
        BlockAllocator(4).allocate(5)


def test_double_free_raises():
    a = BlockAllocator(8)
    x = a.allocate(3)
    a.allocate(2)
    a.free(x)
    with pytest.raises(ValueError, match="double free"):
        a.free(x)
    a.check_invariants()
    assert a.free_blocks == 6


@pytest.mark.parametrize("extent", [(4, 2), (3, 2), (5, 3), (0, 8), (4, 1)])
def test_overlapping_free_raises(extent):
    a = BlockAllocator(8)
    a.allocate(4)  # 0-3 held, 4-7 free
    with pytest.raises(ValueError):
        a.free([extent])
    assert a._free == [(4, 4)]
    a.check_invariants()


@pytest.mark.parametrize("extent", [(-1, 1), (7, 2), (8, 1), (0, 9), (2, 0), (2, -1), (100, 1)])
def test_out_of_range_free_raises(extent):
    a = BlockAllocator(8)
    a.allocate(8)
    with pytest.raises(ValueError, match="outside the pool"):
        a.free([extent])
    assert a.free_blocks == 0
    a.check_invariants()


def test_free_of_part_of_an_allocation_is_allowed_and_consistent():
    a = BlockAllocator(8)
    (_extent,) = a.allocate(8)
    a.free([(2, 3)])
    assert a._free == [(2, 3)]
    a.free([(0, 2), (5, 3)])
    assert a._free == [(0, 8)]
    a.check_invariants()


def test_thousand_mixed_cycles_leave_no_fragmentation():
    rng = random.Random(20240611)
    a = BlockAllocator(256)
    held: list[list[tuple[int, int]]] = []
    for _ in range(1000):
        if held and (rng.random() < 0.45 or a.free_blocks < 8):
            a.free(held.pop(rng.randrange(len(held))))
        else:
            count = rng.choice([1, 1, 2, 3, 5, 8, 13, 21, 34])
            if count > a.free_blocks:
                with pytest.raises(PoolFull):
                    a.allocate(count)
                continue
            held.append(a.allocate(count))
        a.check_invariants()
    rng.shuffle(held)
    for extents in held:
        a.free(extents)
    a.check_invariants()
    assert a.free_blocks == 256
    assert a.largest_free_extent() == 256
    assert a._free == [(0, 256)]


class AllocatorMachine(RuleBasedStateMachine):
    NUM_BLOCKS = 48

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BlockAllocator(self.NUM_BLOCKS)
        self.held: list[list[tuple[int, int]]] = []
        self.owner: dict[int, int] = {}  # block -> allocation id
        self.next_id = 0

    @rule(count=st.integers(min_value=0, max_value=60))
    def allocate(self, count):
        free_before = self.alloc.free_blocks
        if count > free_before:
            try:
                self.alloc.allocate(count)
            except PoolFull:
                pass
            else:
                raise AssertionError("allocate beyond free blocks did not raise PoolFull")
            assert self.alloc.free_blocks == free_before
            return
        extents = self.alloc.allocate(count)
        blocks = blocks_of(extents)
        assert len(blocks) == count
        for block in blocks:
            assert 0 <= block < self.NUM_BLOCKS
            assert block not in self.owner, f"block {block} handed out twice"
            self.owner[block] = self.next_id
        # a contiguous run is used whenever one exists
        if count and len(extents) > 1:
            assert self._largest_before < count
        self.next_id += 1
        self.held.append(extents)
        assert self.alloc.free_blocks == free_before - count

    @precondition(lambda self: self.held)
    @rule(index=st.integers(min_value=0, max_value=1000))
    def free(self, index):
        extents = self.held.pop(index % len(self.held))
        self.alloc.free(extents)
        for block in blocks_of(extents):
            del self.owner[block]

    @precondition(lambda self: self.held)
    @rule(index=st.integers(min_value=0, max_value=1000))
    def double_free_is_rejected(self, index):
        extents = self.held[index % len(self.held)]
        if not extents:
            return
        self.alloc.free(extents)
        before = list(self.alloc._free)
        try:
            self.alloc.free(extents[:1])
        except ValueError:
            pass
        else:
            raise AssertionError("double free accepted")
        assert self.alloc._free == before
        self.held.remove(extents)
        for block in blocks_of(extents):
            del self.owner[block]

    @property
    def _largest_before(self):
        # largest free extent before the last allocation: recompute from the owner map
        largest = run = 0
        last = self.next_id
        for block in range(self.NUM_BLOCKS):
            if block not in self.owner or self.owner[block] == last:
                run += 1
                largest = max(largest, run)
            else:
                run = 0
        return largest

    @invariant()
    def consistent(self):
        self.alloc.check_invariants()
        assert self.alloc.free_blocks == self.NUM_BLOCKS - len(self.owner)
        # the free list and the held blocks partition the pool
        free = set(blocks_of(self.alloc._free))
        assert not free & set(self.owner)
        assert len(free) + len(self.owner) == self.NUM_BLOCKS

    def teardown(self):
        for extents in self.held:
            self.alloc.free(extents)
        self.alloc.check_invariants()
        assert self.alloc.free_blocks == self.NUM_BLOCKS
        assert self.alloc.largest_free_extent() == self.NUM_BLOCKS


AllocatorMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase
