"""The KV tier's bookkeeping (kvd.daemon.store.page_store), pure: budget, LRU order, handoffs never
evicted, no eviction under a live reader, namespaces isolated, batch semantics."""
from __future__ import annotations

import pytest

from kvd.daemon.store.entries import State, Store
from kvd.daemon.store.page_names import MAX_BATCH
from kvd.daemon.store.page_store import CacheStore, Page, SharedPool
from kvd.errors import BadRequest, PoolFull
from kvd.wire.layout import TensorSpec

BLOCK = 4096
PAGE = ["uint8", [BLOCK]]  # one block


def make(pool_blocks: int = 16, budget_blocks: int = 8) -> tuple[CacheStore, Store]:
    pool = SharedPool(pool_blocks)
    cache = CacheStore(pool, BLOCK, budget_blocks * BLOCK)
    store = Store(pool, BLOCK, None)
    return cache, store


def put(cache: CacheStore, keys: list[str], namespace: str = "ns", page=PAGE, ok: bool = True) -> list:
    token, results = cache.reserve(namespace, keys, [page] * len(keys))
    cache.commit(token, ok=ok)
    cache.check_invariants()
    return [r if isinstance(r, bool) else "new" for r in results]


def held(cache: CacheStore, keys: list[str], namespace: str = "ns") -> list[bool]:
    return [cache.exists(namespace, [k]) == 1 for k in keys]


def handoff(store: Store, name: str, blocks: int):
    return store.reserve(name, [TensorSpec("x", "uint8", (blocks * BLOCK,))], None, None, State.WRITING, None)


def test_round_trip_counters_and_put_of_a_held_key_is_a_no_op():
    cache, _ = make()
    assert put(cache, ["a", "b"]) == ["new", "new"]
    token, _ = cache.reserve("ns", ["a", "c", "d"], [PAGE] * 3)
    assert cache.commit(token) == [True, True]  # per page written (c, d), in key order
    assert put(cache, ["a", "e"]) == [True, "new"]
    token, found = cache.lease("ns", ["a", "x", "c"], [BLOCK, BLOCK, BLOCK])
    assert [f is not None for f in found] == [True, False, True]
    assert cache.release(token) and not cache.release(token)
    stats = cache.stats()
    got = (stats["hits"], stats["misses"], stats["stored"], stats["entries"], stats["bytes"])
    assert got == (2, 1, 5, 5, 5 * BLOCK)
    assert cache.stats("ns")["entries"] == 5 and cache.stats("other")["entries"] == 0


def test_a_duplicate_key_within_one_batch_is_written_once():
    cache, _ = make()
    assert put(cache, ["a", "a"]) == ["new", True]
    assert cache.stats()["entries"] == 1


def test_budget_evicts_least_recently_used_first():
    cache, _ = make(pool_blocks=16, budget_blocks=3)
    put(cache, ["a", "b", "c"])
    token, _ = cache.lease("ns", ["a"], [BLOCK])  # a becomes the most recent
    cache.release(token)
    put(cache, ["d"])  # evicts b, the least recent
    assert held(cache, ["a", "b", "c", "d"]) == [True, False, True, True]
    put(cache, ["e"])
    assert held(cache, ["a", "c", "d", "e"]) == [True, False, True, True]
    assert cache.stats()["evictions"] == 2
    assert cache.blocks <= cache.budget_blocks


def test_exists_does_not_touch_the_lru_order():
    cache, _ = make(budget_blocks=2)
    put(cache, ["a", "b"])
    assert cache.exists("ns", ["a"]) == 1
    put(cache, ["c"])
    assert held(cache, ["a", "b", "c"]) == [False, True, True]


def test_a_page_bigger_than_the_budget_is_refused_without_evicting():
    cache, _ = make(budget_blocks=2)
    put(cache, ["a"])
    assert put(cache, ["big"], page=["uint8", [3 * BLOCK]]) == [False]
    assert held(cache, ["a", "big"]) == [True, False]
    assert cache.stats()["refused"] == 1 and cache.stats()["evictions"] == 0


def test_no_page_is_evicted_under_a_live_reader():
    cache, _ = make(budget_blocks=2)
    put(cache, ["a", "b"])
    token, found = cache.lease("ns", ["a", "b"], [BLOCK, BLOCK])
    extents = [page.extents for page in found]
    assert put(cache, ["c"]) == [False]  # both pinned: nothing to evict, the new page is refused
    assert held(cache, ["a", "b"]) == [True, True]
    assert [page.extents for page in found] == extents
    cache.release(token)
    assert put(cache, ["c"]) == ["new"]


def test_a_cleared_page_under_a_reader_is_parked_until_released():
    cache, _ = make()
    put(cache, ["a"])
    free = cache.pool.free_blocks
    token, (page,) = cache.lease("ns", ["a"], [BLOCK])
    assert cache.clear("ns") == 1
    assert cache.exists("ns", ["a"]) == 0 and page.extents is not None
    assert cache.pool.free_blocks == free and cache.stats()["parked_bytes"] == BLOCK
    cache.check_invariants()
    cache.release(token)
    assert cache.pool.free_blocks == free + 1 and cache.stats()["parked_bytes"] == 0
    cache.check_invariants()


def test_a_page_is_invisible_until_committed_and_gone_if_aborted():
    cache, _ = make()
    token, (page,) = cache.reserve("ns", ["a"], [PAGE])
    assert isinstance(page, Page)
    assert cache.exists("ns", ["a"]) == 0
    assert cache.lease("ns", ["a"], [BLOCK])[1] == [None]
    assert cache.reserve("ns", ["a"], [PAGE])[1] == [True]  # being written: nothing to do
    free = cache.pool.free_blocks
    cache.commit(token, ok=False)
    assert cache.exists("ns", ["a"]) == 0 and cache.pool.free_blocks == free + 1
    cache.check_invariants()


def test_a_page_cleared_while_written_is_freed_at_its_commit():
    cache, _ = make()
    token, _ = cache.reserve("ns", ["a"], [PAGE])
    free = cache.pool.free_blocks
    assert cache.clear("ns") == 0
    assert cache.pool.free_blocks == free  # the writer may still be copying
    assert cache.commit(token) == [False]
    assert cache.pool.free_blocks == free + 1 and cache.exists("ns", ["a"]) == 0
    cache.check_invariants()


def test_a_handoff_evicts_cache_pages_and_is_never_evicted():
    cache, store = make(pool_blocks=8, budget_blocks=8)
    put(cache, [f"k{i}" for i in range(6)])
    entry = handoff(store, "req-1", 4)  # 2 free: two LRU pages go
    assert held(cache, [f"k{i}" for i in range(6)]) == [False, False, True, True, True, True]
    assert cache.stats()["evictions"] == 2
    # the tier never takes a handoff's blocks: with 4 handoff blocks, 4 pages fit at most
    assert put(cache, ["x", "y"]) == ["new", "new"]
    assert store.entries["req-1"] is entry and not entry.removed
    assert cache.blocks == 4 and cache.pool.free_blocks == 0
    handoff_blocks = [e for e in entry.extents]
    for page in ("p1", "p2", "p3"):
        put(cache, [page])
    assert entry.extents == handoff_blocks


def test_a_handoff_that_cannot_fit_even_after_evicting_is_refused():
    cache, store = make(pool_blocks=8, budget_blocks=8)
    put(cache, ["a", "b"])
    token, _ = cache.lease("ns", ["a", "b"], [BLOCK, BLOCK])  # pinned: not evictable
    handoff(store, "req-1", 6)
    with pytest.raises(PoolFull):
        handoff(store, "req-2", 1)
    cache.release(token)
    handoff(store, "req-2", 1)  # now one page goes
    assert cache.stats()["entries"] == 1


def test_namespaces_isolate_keys_counters_and_clear():
    cache, _ = make()
    put(cache, ["a"], namespace="tenant=1")
    put(cache, ["a"], namespace="tenant=2")
    assert cache.lease("tenant=3", ["a"], [BLOCK])[1] == [None]
    assert cache.clear("tenant=1") == 1
    assert held(cache, ["a"], "tenant=1") == [False] and held(cache, ["a"], "tenant=2") == [True]
    assert cache.stats("tenant=2")["entries"] == 1 and cache.stats("tenant=3")["misses"] == 1


def test_exists_counts_leading_hits_only():
    cache, _ = make()
    put(cache, ["a", "b", "d"])
    assert cache.exists("ns", ["a", "b", "c", "d"]) == 2
    assert cache.exists("ns", ["c", "a"]) == 0
    assert cache.exists("ns", []) == 0


def test_a_get_of_another_size_is_a_miss():
    cache, _ = make()
    put(cache, ["a"], page=["float16", [2, 8]])
    assert cache.lease("ns", ["a"], [16])[1] == [None]
    assert cache.lease("ns", ["a"], [32])[1][0].dtype == "float16"


@pytest.mark.parametrize("namespace, keys, pages", [
    ("ns", ["a b"], [PAGE]),  # a space in a key
    ("ns", [""], [PAGE]),
    ("ns", ["k" * 257], [PAGE]),
    ("ns\n", ["a"], [PAGE]),
    ("n" * 257, ["a"], [PAGE]),
    ("ns", ["a"], [["float64x", [4]]]),
    ("ns", ["a"], [["uint8", [-1]]]),
    ("ns", ["a"], [["uint8", [1] * 9]]),
    ("ns", ["a", "b"], [PAGE]),
    ("ns", ["k"] * (MAX_BATCH + 1), [PAGE] * (MAX_BATCH + 1)),
])
def test_bad_input_is_refused_before_anything_is_reserved(namespace, keys, pages):
    cache, _ = make()
    free = cache.pool.free_blocks
    with pytest.raises(BadRequest):
        cache.reserve(namespace, keys, pages)
    assert cache.pool.free_blocks == free and cache.stats()["entries"] == 0


def test_stats_name_only_the_biggest_namespaces():
    cache, _ = make(pool_blocks=64, budget_blocks=64)
    for i in range(20):
        put(cache, [f"k{j}" for j in range(i % 3 + 1)], namespace=f"ns{i}")
    stats = cache.stats()
    assert stats["namespaces"] == 20 and len(stats["top_namespaces"]) == 16
    assert stats["entries"] == sum(i % 3 + 1 for i in range(20))


# --- what every page costs: a block at least, and a place in the page counts (issue 39, item 2) ---

EMPTY = ["uint8", [0]]


def test_an_empty_page_costs_a_block_like_any_page():
    cache, _ = make(pool_blocks=16, budget_blocks=3)
    assert put(cache, [f"e{i}" for i in range(5)], page=EMPTY) == ["new"] * 3 + [False] * 2  # a batch past the budget
    assert cache.stats()["entries"] == 3 and cache.stats()["refused"] == 2
    for i in range(5):  # one at a time, the oldest make room
        put(cache, [f"e{i}"], page=EMPTY)
    stats = cache.stats()
    assert stats["entries"] == 3 and stats["used_bytes"] == 3 * BLOCK and stats["evictions"] == 2
    assert held(cache, ["e0", "e1", "e2", "e3", "e4"]) == [False, False, True, True, True]
    token, found = cache.lease("ns", ["e4"], [0])
    assert found[0] is not None and found[0].nbytes == 0
    cache.release(token)


def test_the_page_count_caps_the_tier_whatever_the_budget():
    pool = SharedPool(64)
    cache = CacheStore(pool, BLOCK, 64 * BLOCK, max_pages=4)
    for key in ["a", "b", "c", "d", "e", "f"]:
        assert put(cache, [key]) == ["new"]
    assert cache.stats()["entries"] == 4 and held(cache, ["a", "b", "c", "d", "e", "f"]) == [False] * 2 + [True] * 4
    # pinned pages are never evicted: the count then refuses
    token, _ = cache.lease("ns", ["c", "d", "e", "f"], [BLOCK] * 4)
    assert put(cache, ["g"]) == [False]
    assert cache.stats()["refused"] == 1
    cache.release(token)
    assert put(cache, ["g"]) == ["new"]


def test_a_namespace_at_its_cap_makes_room_from_its_own_pages_only():
    pool = SharedPool(64)
    cache = CacheStore(pool, BLOCK, 64 * BLOCK, max_pages=10, namespace_pages=3)
    assert put(cache, ["x1", "x2"], namespace="other") == ["new"] * 2
    for key in ["a", "b", "c", "d", "e"]:
        assert put(cache, [key], namespace="busy") == ["new"]
    assert held(cache, ["a", "b", "c", "d", "e"], namespace="busy") == [False, False, True, True, True]
    assert held(cache, ["x1", "x2"], namespace="other") == [True, True]  # untouched by busy's flood
    assert cache.stats("busy")["evictions"] == 2 and cache.stats("other")["evictions"] == 0
    # a hit moves a page to the back of its namespace's order too
    token, _ = cache.lease("busy", ["c"], [BLOCK])
    cache.release(token)
    assert put(cache, ["f"], namespace="busy") == ["new"]
    assert held(cache, ["c", "d", "e", "f"], namespace="busy") == [True, False, True, True]


def test_pages_being_written_count_against_the_caps():
    pool = SharedPool(64)
    cache = CacheStore(pool, BLOCK, 64 * BLOCK, max_pages=2)
    token, results = cache.reserve("ns", ["a", "b", "c"], [PAGE] * 3)
    assert [isinstance(r, Page) for r in results] == [True, True, False]  # nothing visible to evict
    cache.commit(token)
    cache.check_invariants()
