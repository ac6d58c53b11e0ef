"""kvd.daemon.store.entries: entries, leases, expiry and block accounting, with a real BlockAllocator."""
from __future__ import annotations

import itertools
import time

import pytest

from kvd.daemon.store.allocator import BlockAllocator
from kvd.daemon.store.entries import MAX_REQUEST_ID_LEN, State, Store
from kvd.errors import AlreadyExists, BadRequest, NotFound, PoolFull
from kvd.wire.layout import TensorSpec, physical_segments, split_extents

BLOCK = 4096


def make_store(num_blocks: int = 16, default_ttl: float | None = None) -> Store:
    return Store(BlockAllocator(num_blocks), BLOCK, default_ttl)


def specs(*sizes: int) -> list[TensorSpec]:
    return [TensorSpec(f"t{i}", "uint8", (n,)) for i, n in enumerate(sizes)]


def reserve(store: Store, rid: str = "r", sizes=(5000, 100), *, ttl=None, state=State.WRITING, write_deadline=None,
            meta=None):
    return store.reserve(rid, specs(*sizes), ttl, meta, state, write_deadline)


def test_reserve_allocates_blocks_for_the_whole_entry():
    store = make_store()
    entry = reserve(store, sizes=(5000, 100), meta={"model": "m"})
    # tensor 0 at 0 (5000 bytes), tensor 1 aligned to 5120
    assert entry.offsets == [0, 5120]
    assert entry.total_bytes == 5220
    assert sum(n for _, n in entry.extents) == 2
    assert store.allocator.free_blocks == 14
    assert store.used_bytes == 2 * BLOCK
    assert entry.state is State.WRITING
    assert entry.meta == {"model": "m"}
    assert store.entries == {"r": entry}
    assert store.ready("r") is None  # not visible while writing
    segs = entry.segments(BLOCK)
    assert [sum(n for _, n in s) for s in segs] == [5000, 100]
    assert segs[1] == physical_segments(entry.extents, BLOCK, 5120, 100)


def test_zero_byte_entry_holds_no_blocks():
    store = make_store()
    entry = reserve(store, sizes=(0,))
    assert entry.extents == [] and entry.total_bytes == 0
    store.publish(entry)
    lease = store.lease(entry, consume=True, deadline=None)
    store.release(lease.token, success=True)
    assert "r" not in store.entries
    assert store.allocator.free_blocks == 16


def test_put_get_consume_frees_blocks():
    store = make_store()
    entry = reserve(store)
    assert store.writing_entry("r", entry.token, State.WRITING) is entry
    store.publish(entry)
    assert entry.state is State.READY and entry.write_deadline is None
    assert store.ready("r") is entry
    lease = store.lease(entry, consume=True, deadline=None)
    assert entry.state is State.CLAIMED
    assert store.ready("r") is None  # a consuming reader hides the entry
    with pytest.raises(NotFound):
        store.lease(entry, consume=False, deadline=None)
    assert store.allocator.free_blocks == 14
    assert store.release(lease.token, success=True) is entry
    assert entry.removed
    assert "r" not in store.entries
    assert store.allocator.free_blocks == 16
    store.allocator.check_invariants()
    with pytest.raises(NotFound):
        store.release(lease.token, success=True)  # a lease ends once


def test_failed_consuming_lease_gives_the_entry_back():
    store = make_store()
    entry = reserve(store)
    store.publish(entry)
    lease = store.lease(entry, consume=True, deadline=None)
    store.release(lease.token, success=False)
    assert entry.state is State.READY
    assert store.ready("r") is entry
    assert not entry.removed
    assert store.allocator.free_blocks == 14
    # and it can be read again
    again = store.lease(entry, consume=True, deadline=None)
    store.release(again.token, success=True)
    assert store.allocator.free_blocks == 16


def test_keep_leases_share_the_entry_and_do_not_remove_it():
    store = make_store()
    entry = reserve(store)
    store.publish(entry)
    a = store.lease(entry, consume=False, deadline=None)
    b = store.lease(entry, consume=False, deadline=None)
    assert entry.state is State.READY
    store.release(a.token, success=True)
    store.release(b.token, success=True)
    assert store.ready("r") is entry
    assert store.allocator.free_blocks == 14


def test_remove_with_active_keep_lease_defers_freeing():
    store = make_store()
    entry = reserve(store)
    store.publish(entry)
    lease = store.lease(entry, consume=False, deadline=None)
    extents = list(entry.extents)
    store.remove(entry)
    assert "r" not in store.entries
    assert store.ready("r") is None
    assert store.allocator.free_blocks == 14  # still held by the reader
    assert entry.extents == extents
    # a new entry under the same id can not reuse the reader's blocks
    other = reserve(store, sizes=(8192,))
    held = {b for s, n in extents for b in range(s, s + n)}
    assert not held & {b for s, n in other.extents for b in range(s, s + n)}
    store.remove(entry)  # removing twice is harmless
    store.release(lease.token, success=True)
    assert entry.extents == []
    assert store.allocator.free_blocks == 14  # only `other` remains
    store.allocator.check_invariants()


def test_consuming_lease_on_a_removed_entry_just_frees():
    store = make_store()
    entry = reserve(store)
    store.publish(entry)
    lease = store.lease(entry, consume=True, deadline=None)
    store.remove(entry)  # e.g. a delete while the reader copies
    assert store.allocator.free_blocks == 14
    store.release(lease.token, success=False)
    assert entry.removed and entry.state is State.CLAIMED  # not resurrected
    assert "r" not in store.entries
    assert store.allocator.free_blocks == 16


def test_lease_requires_ready():
    store = make_store()
    entry = reserve(store)
    with pytest.raises(NotFound):
        store.lease(entry, consume=False, deadline=None)
    store.publish(entry)
    store.remove(entry)
    with pytest.raises(NotFound):
        store.lease(entry, consume=False, deadline=None)


def test_duplicate_request_id_raises_already_exists():
    store = make_store()
    reserve(store, "dup")
    with pytest.raises(AlreadyExists, match="dup"):
        reserve(store, "dup")
    assert store.allocator.free_blocks == 14  # the failed reserve took nothing
    assert isinstance(AlreadyExists("x"), BadRequest)


def test_request_id_can_be_reused_after_removal():
    store = make_store()
    first = reserve(store, "x")
    store.remove(first)
    second = reserve(store, "x")
    assert second is not first and second.token != first.token
    with pytest.raises(NotFound):
        store.writing_entry("x", first.token, State.WRITING)  # the stale token is refused


@pytest.mark.parametrize("rid", ["", None, 5, "x" * (MAX_REQUEST_ID_LEN + 1)])
def test_bad_request_ids(rid):
    store = make_store()
    with pytest.raises(BadRequest):
        store.reserve(rid, specs(1), None, None, State.WRITING, None)
    assert store.entries == {}


@pytest.mark.parametrize("ttl", [-1.0, float("inf"), float("nan")])
def test_bad_ttl(ttl):
    store = make_store()
    with pytest.raises(BadRequest, match="ttl"):
        reserve(store, ttl=ttl)
    assert store.allocator.free_blocks == 16


def test_duplicate_tensor_names_rejected():
    store = make_store()
    with pytest.raises(BadRequest, match="unique"):
        store.reserve("r", [TensorSpec("a", "uint8", (1,))] * 2, None, None, State.WRITING, None)


def test_pool_full_reserve_leaves_no_entry():
    store = make_store(num_blocks=2)
    with pytest.raises(PoolFull):
        reserve(store, sizes=(3 * BLOCK,))
    assert store.entries == {}
    assert store.allocator.free_blocks == 2


def test_writing_entry_checks_token_and_state():
    store = make_store()
    entry = reserve(store)
    with pytest.raises(NotFound):
        store.writing_entry("r", entry.token + 1000, State.WRITING)
    with pytest.raises(NotFound):
        store.writing_entry("r", entry.token, State.RECEIVING)
    with pytest.raises(NotFound):
        store.writing_entry("nope", entry.token, State.WRITING)
    store.publish(entry)
    with pytest.raises(NotFound):
        store.writing_entry("r", entry.token, State.WRITING)


def test_tokens_are_never_reused():
    store = make_store(num_blocks=64)
    seen: set[int] = set()
    for round_ in range(20):
        entry = reserve(store, f"r{round_ % 3}", sizes=(10,))
        assert entry.token not in seen
        seen.add(entry.token)
        store.publish(entry)
        for consume in (False, True):
            lease = store.lease(entry, consume=consume, deadline=None)
            assert lease.token not in seen
            seen.add(lease.token)
            store.release(lease.token, success=True)
    assert store.entries == {}
    assert store.allocator.free_blocks == 64


# ---- expiry ---------------------------------------------------------------------------------


def test_sweep_expires_ready_entries_past_ttl():
    store = make_store()
    short = reserve(store, "short", ttl=5.0)
    forever = reserve(store, "forever", ttl=0)  # 0 = forever
    for e in (short, forever):
        store.publish(e)
    assert forever.expires_at is None
    now = time.monotonic()
    assert store.sweep(now) == ([], [], [])
    expired, abandoned, stale = store.sweep(now + 10)
    assert expired == [short] and abandoned == [] and stale == []
    assert short.removed and "short" not in store.entries
    assert "forever" in store.entries
    assert store.expired_total == 1
    assert store.allocator.free_blocks == 14


def test_default_ttl_applies_when_none_given():
    store = make_store(default_ttl=5.0)
    entry = reserve(store, ttl=None)
    assert entry.expires_at is not None
    assert entry.expires_at - time.monotonic() == pytest.approx(5.0, abs=1.0)
    explicit = reserve(store, "other", ttl=0)
    assert explicit.expires_at is None


def test_sweep_does_not_expire_unpublished_or_claimed_entries():
    store = make_store()
    writing = reserve(store, "w", ttl=1.0)
    claimed = reserve(store, "c", ttl=1.0)
    store.publish(claimed)
    lease = store.lease(claimed, consume=True, deadline=None)
    expired, _, _ = store.sweep(time.monotonic() + 100)
    assert expired == []
    assert not writing.removed and not claimed.removed
    store.release(lease.token, success=False)
    expired, _, _ = store.sweep(time.monotonic() + 100)
    assert expired == [claimed]


def test_sweep_removes_abandoned_writes():
    store = make_store()
    now = time.monotonic()
    late = reserve(store, "late", write_deadline=now + 1)
    receiving = reserve(store, "recv", state=State.RECEIVING, write_deadline=now + 1)
    reserve(store, "ontime", write_deadline=now + 100)
    published = reserve(store, "pub", write_deadline=now + 1)
    store.publish(published)  # publishing clears the write deadline
    expired, abandoned, stale = store.sweep(now + 10)
    assert expired == [] and stale == []
    assert set(map(id, abandoned)) == {id(late), id(receiving)}
    assert "late" not in store.entries and "recv" not in store.entries
    assert "ontime" in store.entries and "pub" in store.entries
    # the received entry's blocks are free; the local write's stay parked until its writer lets go
    assert store.allocator.free_blocks == 16 - 3 * 2
    assert store.parked_bytes == 2 * BLOCK
    store.release_writer(late)
    assert store.allocator.free_blocks == 16 - 2 * 2 and store.parked_bytes == 0
    assert store.expired_total == 0


def test_sweep_gives_stale_leases_back():
    store = make_store()
    entry = reserve(store)
    store.publish(entry)
    now = time.monotonic()
    lease = store.lease(entry, consume=True, deadline=now + 1)
    keep = reserve(store, "k")
    store.publish(keep)
    keep_lease = store.lease(keep, consume=False, deadline=now + 1)
    fresh = store.lease(keep, consume=False, deadline=now + 100)
    no_deadline = store.lease(keep, consume=False, deadline=None)
    expired, abandoned, stale = store.sweep(now + 10)
    assert {s.token for s in stale} == {lease.token, keep_lease.token}
    assert expired == [] and abandoned == []
    # the consumed-but-abandoned entry is back, not lost; the stale leases no longer claim, but
    # pin the blocks until their readers release them (they may still be copying out)
    assert entry.state is State.READY and store.ready("r") is entry
    assert not lease.claiming and not keep_lease.claiming and fresh.claiming
    assert set(keep.leases) == {keep_lease.token, fresh.token, no_deadline.token}
    second = store.lease(entry, consume=True, deadline=None)  # another reader takes it
    store.release(second.token, success=True)
    assert entry.removed and store.parked_bytes == 2 * BLOCK  # removed, still pinned by the slow reader
    assert store.release(lease.token, success=True) is entry  # a late consume of a stale lease: just unpins
    assert store.parked_bytes == 0
    with pytest.raises(NotFound):
        store.release(lease.token, success=True)
    assert store.allocator.free_blocks == 14


def test_a_removed_writing_entry_is_parked_until_its_writer_lets_go():
    store = make_store()
    entry = reserve(store)
    assert entry.writer
    store.remove(entry)  # deleted, or its lease ran out, while the client may still copy in
    assert store.allocator.free_blocks == 14 and store.parked_bytes == 2 * BLOCK
    store.release_writer(entry)
    assert store.allocator.free_blocks == 16 and store.parked_bytes == 0
    committed = reserve(store, "c")
    store.publish(committed)  # a commit comes after the last copy: the writer's pin ends
    assert not committed.writer
    store.remove(committed)
    assert store.allocator.free_blocks == 16


def test_a_lease_whose_claim_ended_pins_its_blocks_until_released():
    """A transfer that finished (the receiver said done) no longer claims its entry, which is
    consumed at once, but ZeroMQ may still send from the blocks: they stay until release."""
    store = make_store()
    entry = reserve(store)
    store.publish(entry)
    lease = store.lease(entry, consume=True, deadline=None)
    assert store.end_claim(lease.token, success=True) is entry
    assert entry.removed and "r" not in store.entries
    assert store.allocator.free_blocks == 14
    store.end_claim(lease.token, success=True)  # once only
    store.release(lease.token, success=False)
    assert store.allocator.free_blocks == 16
    failed = reserve(store, "f")
    store.publish(failed)
    lease = store.lease(failed, consume=True, deadline=None)
    store.end_claim(lease.token, success=False)  # a failed pull: the holder has it back at once
    assert failed.state is State.READY and store.ready("f") is failed
    store.release(lease.token, success=False)
    assert store.ready("f") is failed and store.allocator.free_blocks == 14


def test_sweep_expiry_of_entry_with_keep_lease_defers_freeing():
    store = make_store()
    entry = reserve(store, ttl=1.0)
    store.publish(entry)
    lease = store.lease(entry, consume=False, deadline=None)
    expired, _, _ = store.sweep(time.monotonic() + 5)
    assert expired == [entry]
    assert store.allocator.free_blocks == 14
    store.release(lease.token, success=True)
    assert store.allocator.free_blocks == 16


def test_counts_and_describe():
    store = make_store()
    a = reserve(store, "a")
    b = reserve(store, "b", state=State.RECEIVING)
    c = reserve(store, "c", ttl=30.0)
    store.publish(c)
    d = reserve(store, "d")
    store.publish(d)
    store.lease(d, consume=True, deadline=None)
    assert store.counts() == {"writing": 1, "receiving": 1, "ready": 1, "claimed": 1}
    info = c.describe()
    assert info["request_id"] == "c" and info["state"] == "ready"
    assert info["bytes"] == c.total_bytes and info["tensors"] == 2 and info["blocks"] == 2
    assert 0 < info["ttl_s"] <= 30.0
    assert a.describe()["ttl_s"] is None
    del b


# ---- streamed writes: per-tensor progress ----------------------------------------------------


def test_tensor_ranges_partition_the_entry():
    store = make_store()
    entry = reserve(store, sizes=(5000, 100, 0, 7))
    ranges = entry.tensor_ranges()
    assert ranges[0][0] == 0 and ranges[-1][1] == entry.total_bytes
    for (_, hi), (lo, _) in itertools.pairwise(ranges):
        assert hi == lo
    assert entry.remaining == [hi - lo for lo, hi in ranges]
    assert entry.complete_tensors() == [2]  # the empty tensor owns no bytes


def test_mark_range_reports_tensors_as_they_complete():
    store = make_store()
    entry = reserve(store, sizes=(300, 300, 10))  # ranges [0,512) [512,1024) [1024,1034)
    assert entry.tensor_ranges() == [(0, 512), (512, 1024), (1024, 1034)]
    assert entry.mark_range(0, 500) == []
    assert entry.mark_range(500, 100) == [0]
    assert entry.mark_range(1024, 10) == [2]
    assert entry.mark_range(600, 424) == [1]
    assert entry.complete_tensors() == [0, 1, 2]


def test_mark_tensors_returns_merged_ranges_and_rejects_rewrites():
    store = make_store()
    entry = reserve(store, sizes=(300, 300, 10))
    assert entry.mark_tensors([1, 0]) == [(0, 1024)]
    assert entry.complete_tensors() == [0, 1]
    with pytest.raises(BadRequest, match="already written"):
        entry.mark_tensors([1])
    with pytest.raises(BadRequest, match="no tensor"):
        entry.mark_tensors([3])
    with pytest.raises(BadRequest, match="no tensor"):
        entry.mark_tensors([-1])
    assert entry.mark_tensors([2]) == [(1024, 10)]


def test_publish_completes_every_tensor():
    store = make_store()
    entry = reserve(store, sizes=(300, 300))
    store.publish(entry)
    assert entry.remaining == [0, 0]
    assert entry.state is State.READY


def test_streaming_consumer_claims_on_publish():
    """A consuming lease taken while writing (a streaming push) owns the entry once it is published."""
    store = make_store()
    entry = reserve(store)
    with pytest.raises(NotFound):
        store.lease(entry, consume=True, deadline=None)  # not without incomplete=True
    push = store.lease(entry, consume=True, deadline=None, incomplete=True)
    assert entry.state is State.WRITING
    store.publish(entry)
    assert entry.state is State.CLAIMED
    assert store.ready("r") is None
    store.release(push.token, success=True)
    assert entry.removed and store.allocator.free_blocks == 16


def test_failed_streaming_consumer_leaves_a_writing_entry_writing():
    store = make_store()
    entry = reserve(store)
    push = store.lease(entry, consume=True, deadline=None, incomplete=True)
    store.release(push.token, success=False)
    assert entry.state is State.WRITING and not entry.removed
    store.publish(entry)
    assert entry.state is State.READY


def test_set_lease_deadline_makes_a_lease_sweepable():
    store = make_store()
    entry = reserve(store)
    store.publish(entry)
    lease = store.lease(entry, consume=False, deadline=None)
    now = time.monotonic()
    assert store.sweep(now + 100)[2] == []
    store.set_lease_deadline(lease.token, now + 1)
    assert store.sweep(now + 100)[2] == [lease]
    store.set_lease_deadline(lease.token, now)  # unknown token now: ignored


# --- scratch: blocks lent to a client ahead of its next put -------------------------------------


def test_lent_scratch_is_counted_apart_and_comes_back():
    store = make_store(num_blocks=8)
    token, extents = store.lend_scratch(3)
    assert sum(n for _, n in extents) == 3
    assert store.scratch_bytes == 3 * BLOCK and store.used_bytes == 0
    assert store.allocator.free_blocks == 5
    store.return_scratch(token)
    store.return_scratch(token)  # twice is harmless
    assert store.scratch_bytes == 0 and store.allocator.free_blocks == 8


def test_an_entry_made_in_scratch_takes_its_first_blocks_in_order_and_frees_the_rest():
    store = make_store(num_blocks=8)
    store.reserve("gap", [TensorSpec("x", "uint8", (BLOCK,))], None, None, State.WRITING, None)
    token, extents = store.lend_scratch(4)
    specs = [TensorSpec("k", "uint8", (BLOCK + 10,)), TensorSpec("v", "int8", (5,))]
    entry = store.reserve_in_scratch(token, "e", specs, None, None, State.WRITING, None)
    assert entry.extents == split_extents(extents, 2)[0]
    # the client computed the same segments from the extents it was lent
    assert entry.segments(BLOCK) == [
        physical_segments(extents, BLOCK, offset, spec.nbytes) for spec, offset in zip(specs, entry.offsets)
    ]
    assert store.scratch_bytes == 0 and store.allocator.free_blocks == 8 - 1 - 2
    with pytest.raises(NotFound):
        store.reserve_in_scratch(token, "again", specs, None, None, State.WRITING, None)


@pytest.mark.parametrize("problem", ["duplicate", "too_big", "bad_ttl"])
def test_a_refused_entry_in_scratch_frees_the_scratch(problem):
    store = make_store(num_blocks=8)
    store.reserve("dup", [TensorSpec("x", "uint8", (1,))], None, None, State.WRITING, None)
    token, _ = store.lend_scratch(2)
    request_id, size, ttl = {"duplicate": ("dup", 1, None), "too_big": ("e", 2 * BLOCK + 1, None),
                             "bad_ttl": ("e", 1, -1.0)}[problem]
    with pytest.raises((AlreadyExists, BadRequest)):
        store.reserve_in_scratch(token, request_id, [TensorSpec("x", "uint8", (size,))], ttl, None,
                                 State.WRITING, None)
    assert store.scratch_bytes == 0 and store.allocator.free_blocks == 7 and list(store.entries) == ["dup"]


# --- what a local producer announced as written ---------------------------------------------------


def test_the_rest_of_a_streamed_put_is_what_was_not_announced():
    store = make_store()
    entry = reserve(store, sizes=(1000, 100, 300))  # tensors at 0, 1024, 1280; total 1580
    assert entry.mark_tensors([1]) == [(1024, 256)]  # a tensor owns its padding
    rest, done = entry.mark_rest()
    assert rest == [(0, 1024), (1280, 300)] and sorted(done) == [0, 2]
    assert entry.mark_rest() == ([], [])
    with pytest.raises(BadRequest, match="already written"):
        entry.mark_tensors([0])


def test_pool_full_says_how_many_blocks_are_lent():
    store = make_store(num_blocks=8)
    store.lend_scratch(3)
    with pytest.raises(PoolFull, match="need 6 blocks, 5 of 8 free; 3 blocks are lent to connected clients"):
        reserve(store, sizes=(6 * BLOCK,))
    assert store.entries == {} and store.scratch_blocks == 3
