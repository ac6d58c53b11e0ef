"""What the KV tier's RAM bookkeeping (kvd.daemon.store.page_store) gives the disk level: a page past the
budget takes no room from the budget's pages; hooks on publish, eviction (before the blocks go)
and unlisting; pins that hold blocks without a lease."""
from __future__ import annotations

from kvd.daemon.store.page_store import CacheStore, SharedPool

BLOCK = 4096
PAGE = ["uint8", [BLOCK]]


def make(pool_blocks: int = 32, budget_blocks: int = 8) -> CacheStore:
    return CacheStore(SharedPool(pool_blocks), BLOCK, budget_blocks * BLOCK)


def test_pages_past_the_budget_take_no_room_from_it():
    cache = make()
    token, _ = cache.reserve("ns", [f"t{i}" for i in range(8)], [PAGE] * 8, over_budget=True)
    cache.commit(token)
    reader, found = cache.lease("ns", [f"t{i}" for i in range(8)], [BLOCK] * 8)  # read once, pinned
    assert all(found)
    token, results = cache.reserve("ns", ["a", "b", "c", "d"], [PAGE] * 4)  # (before: all four refused)
    assert all(not isinstance(r, bool) for r in results)
    cache.commit(token)
    cache.check_invariants()
    assert cache.over_blocks == 8 and cache.stats()["refused"] == 0
    for i in range(8):
        cache.drop(found[i])
    cache.release(reader)
    assert cache.over_blocks == 0 and cache.blocks == 4


def test_hooks_see_publish_eviction_before_the_free_and_unlisting_and_pins_hold_blocks():
    cache = make(budget_blocks=2)
    seen = []
    cache.follow(lambda page: seen.append(("published", page.key)),
                 lambda page: seen.append(("evicted", page.key, page.extents is not None)),
                 lambda page: seen.append(("unlisted", page.key)))
    for key in ("a", "b"):
        token, _ = cache.reserve("ns", [key], [PAGE])
        cache.commit(token)
    lease, (a, _) = cache.lease("ns", ["a", "b"], [BLOCK, BLOCK])
    cache.release(lease)
    cache.pin(a)  # (the disk level writing a out: not evictable, its blocks kept)
    token, _ = cache.reserve("ns", ["c"], [PAGE])
    cache.commit(token)
    assert seen == [("published", "a"), ("published", "b"), ("evicted", "b", True), ("unlisted", "b"),
                    ("published", "c")]
    cache.clear("ns")
    assert a.removed and a.extents is not None  # cleared while pinned: parked
    cache.pin(a, -1)
    assert a.extents is None and cache.blocks == 0
    cache.check_invariants()
