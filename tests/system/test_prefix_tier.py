"""Prefix reuse's worker and event code (kvd.integrations.paged.tier_worker, the vLLM connector's
tier_feed) on real daemons and real paged tensors: a prefix saved by one engine's ranks is loaded
bit-exact by another's into other blocks; evicted pages are a failed load naming their blocks;
pages of another layout, dtype or salt are never read; a dead daemon costs a miss, never a raise;
the follower of the namespace says which blocks the tier holds, BlockStored and BlockRemoved
(medium CPU) in vLLM's own classes as pages come and go, and gives up what it announced when it
loses its place."""
from __future__ import annotations

import time

import pytest
import torch

from kvd import Client
from kvd.integrations.paged.groups import FULL, SLIDING, KVGroup
from kvd.integrations.paged.tier_pages import TierLayout, TierLoad, TierSave, namespace, page_key
from kvd.integrations.paged.tier_worker import TierWorker
from kvd.parallel import KVLayout, shard_layouts
from kvd.testing.daemons import eventually, wait_ready
from tests.system.test_layouts_paged import BLOCK, HEAD_DIM, NUM_BLOCKS, bits, full_cache, names, rank_caches

MODEL = KVLayout(num_layers=4, num_kv_heads=2, head_dim=2 * HEAD_DIM, dtype="float16")
HASHES = [f"{i:02x}" * 32 for i in range(1, 7)]  # six blocks' hashes (vLLM's are 32-byte sha256)


def ns(**fields) -> str:
    return namespace("test", "tiny", {"dt": "float16", "tp": 1, **fields})


def connect(daemon):
    return lambda: Client(daemon.socket, reply_timeout=5.0, connect_timeout=2.0).connect()


def worker(daemon, full, kv: KVLayout, space: str, groups=None) -> TierWorker:
    caches = rank_caches(full, kv, mla=False)
    groups = groups or (KVGroup(FULL, BLOCK, tuple(caches)),)
    return TierWorker(caches, groups, kv, space, connect=connect(daemon))


def loaded(rank: TierWorker, spec: TierLoad, timeout: float = 10.0):
    """Start a load and wait for its end: the TransferResults of the poll that reported it."""
    rank.start_load(spec)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        results = rank.poll()
        if spec.req_id in results.finished_loads:
            return results
        time.sleep(0.005)
    raise AssertionError("the load never ended")


def test_a_prefix_saved_by_one_engines_ranks_is_loaded_bit_exact_by_anothers(daemons):
    """TP 2 saves (each rank its heads); another TP 2 engine loads into other block ids."""
    daemon = daemons.start("A", pool_size="64MiB")
    space = ns(tp=2)
    full, other = full_cache(4, 2, "float16", seed=1), full_cache(4, 2, "float16", seed=2)
    src, dst = [7, 3, 12, 20], [1, 2, 9, 15]
    savers = [worker(daemon, full, kv, space) for kv in shard_layouts(MODEL, 2, 1)]
    loaders = [worker(daemon, other, kv, space) for kv in shard_layouts(MODEL, 2, 1)]
    try:
        for rank in savers:
            rank.save(TierSave([(h, 0, b) for h, b in zip(HASHES, src)]))
            assert rank.take_stats().tier_saves == 4
        with daemon.client() as client:  # one page per block and rank: every layer of the rank's heads
            assert client.cache_stats(space)["entries"] == 8
            assert client.cache_exists([page_key(HASHES[0], 0, (t, 0)) for t in (0, 1)], namespace=space) == 2
        for kv, rank in zip(shard_layouts(MODEL, 2, 1), loaders):
            results = loaded(rank, TierLoad("r", [(h, 0, b) for h, b in zip(HASHES, dst)], 4 * BLOCK))
            assert results.failed_loads == set() and results.failed_blocks == set()
            h0, h1 = kv.head_range()
            for i, name in enumerate(names(4)):
                assert torch.equal(bits(rank.caches[name][dst]), bits(full[i][src, h0:h1])), (kv.tp_rank, name)
                untouched = [j for j in range(NUM_BLOCKS) if j not in dst]
                assert torch.equal(bits(rank.caches[name][untouched]), bits(other[i][untouched, h0:h1]))
            assert rank.take_stats().tier_loads == 1
    finally:
        for rank in savers + loaders:
            rank.close()


def test_replicas_and_other_stages_read_their_primary_ranks_pages(daemons):
    """TP 4 over 2 KV heads: ranks 1 and 3 hold copies of ranks 0's and 2's heads: they save
    nothing and read their primary's page; a PP stage's pages hold its own layers only."""
    daemon = daemons.start("A", pool_size="64MiB")
    model = KVLayout(num_layers=4, num_kv_heads=2, head_dim=2 * HEAD_DIM, dtype="float16")
    layout = TierLayout.of(model.with_shard(0, 4, 0, 2), [KVGroup(FULL, BLOCK, tuple(names(4)))])
    assert layout.ranks == (((0, 0), (2, 0), (0, 1), (2, 1)),)  # the saving ranks a lookup asks for
    space = ns(tp=4, pp=2)
    full, other = full_cache(4, 2, "float16", seed=3), full_cache(4, 2, "float16", seed=4)
    grid = shard_layouts(model, 4, 2)
    savers = [worker(daemon, full, kv, space) for kv in grid]
    loaders = [worker(daemon, other, kv, space) for kv in grid]
    try:
        for rank in savers:
            rank.save(TierSave([(HASHES[0], 0, 5)]))
        with daemon.client() as client:
            assert client.cache_stats(space)["entries"] == 4  # (0,0) (2,0) (0,1) (2,1)
        for kv, rank in zip(grid, loaders):
            assert loaded(rank, TierLoad("r", [(HASHES[0], 0, 6)], BLOCK)).failed_loads == set()
            (l0, l1), (h0, h1) = kv.layer_range(), kv.head_range()
            for i in range(l0, l1):
                assert torch.equal(bits(rank.caches[names(4)[i]][6]), bits(full[i][5, h0:h1]))
    finally:
        for rank in savers + loaders:
            rank.close()


def test_evicted_pages_fail_the_load_and_name_their_blocks(daemons):
    daemon = daemons.start("A", pool_size="64MiB", extra=["--cache-size", "256KiB", "--block-size", "16KiB"])
    space = ns()
    full, other = full_cache(4, 2, "float16", seed=5), full_cache(4, 2, "float16", seed=6)
    kv = MODEL  # one rank: a page is 4 layers x 2 heads x 16 tokens x 16 x 2 B = 8 KiB, one 16 KiB block
    saver, loader = worker(daemon, full, kv, space), worker(daemon, other, kv, space)
    try:
        saver.save(TierSave([(h, 0, b) for h, b in zip(HASHES, [1, 2, 3, 4, 5, 6])]))
        with daemon.client() as client:  # another tenant's pages take the budget: ours are the oldest
            client.cache_put([f"x{i}" for i in range(14)], [torch.zeros(4096)] * 14, namespace="other")
            assert client.cache_exists([page_key(h, 0, (0, 0)) for h in HASHES], namespace=space) == 0
            held = [client.cache_exists([page_key(h, 0, (0, 0))], namespace=space) for h in HASHES]
        assert held == [0, 0, 0, 0, 1, 1]
        results = loaded(loader, TierLoad("r", [(h, 0, b) for h, b in zip(HASHES, [10, 11, 12, 13, 14, 15])], 96))
        assert results.failed_loads == {"r"} and results.failed_blocks == {10, 11, 12, 13}
        # the pages that were there are bit-exact (vLLM keeps nothing past the first lost block anyway)
        assert torch.equal(bits(loader.caches[names(4)[0]][14]), bits(full[0][5]))
        assert loader.take_stats().tier_load_failures == 1
    finally:
        saver.close()
        loader.close()


@pytest.mark.parametrize("differs", ["layout", "dtype", "salt"])
def test_pages_of_another_layout_dtype_or_salt_are_never_read(daemons, differs):
    daemon = daemons.start("A", pool_size="64MiB")
    mine = namespace("vllm", "tiny", {"dt": "float16", "tp": 1}, salt="tenant-a")
    theirs = {"layout": namespace("vllm", "tiny", {"dt": "float16", "tp": 2}, salt="tenant-a"),
              "dtype": namespace("vllm", "tiny", {"dt": "bfloat16", "tp": 1}, salt="tenant-a"),
              "salt": namespace("vllm", "tiny", {"dt": "float16", "tp": 1}, salt="tenant-b")}[differs]
    assert theirs != mine
    full, other = full_cache(4, 2, "float16", seed=7), full_cache(4, 2, "float16", seed=8)
    saver, loader = worker(daemon, full, MODEL, theirs), worker(daemon, other, MODEL, mine)
    try:
        saver.save(TierSave([(HASHES[0], 0, 3)]))
        results = loaded(loader, TierLoad("r", [(HASHES[0], 0, 4)], BLOCK))
        assert results.failed_loads == {"r"} and results.failed_blocks == {4}
        for i, name in enumerate(names(4)):
            assert torch.equal(bits(loader.caches[name]), bits(other[i]))  # nothing written
    finally:
        saver.close()
        loader.close()


def test_a_dead_daemon_is_a_miss_and_a_skipped_save_never_an_error(daemons):
    daemon = daemons.start("A", pool_size="64MiB")
    full = full_cache(4, 2, "float16", seed=9)
    rank = worker(daemon, full, MODEL, ns())
    try:
        daemon.stop()
        started = time.monotonic()
        rank.save(TierSave([(HASHES[0], 0, 3)]))  # the engine's step goes on
        results = loaded(rank, TierLoad("r", [(HASHES[0], 0, 4)], BLOCK))
        assert results.failed_blocks == {4}
        rank.save(TierSave([(HASHES[1], 0, 3)]))  # backing off: not even tried
        assert time.monotonic() - started < 8
        stats = rank.take_stats()
        assert stats.tier_save_failures == 1 and stats.tier_saves == 0
    finally:
        rank.close()


# --- what the tier holds, and the KV events that say so --------------------------------------------

def test_the_follower_knows_what_is_held_and_announces_it_in_vllms_events(daemons):
    pytest.importorskip("vllm", reason="the events are vLLM's own classes")
    from vllm.distributed.kv_events import MEDIUM_CPU, AllBlocksCleared, BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as external  # (as the engine's own events)

    from kvd.integrations.vllm.tier_feed import BlockInfo, TierFeed

    daemon = daemons.start("A", pool_size="64MiB")
    space = ns(tp=2)
    groups = (KVGroup(SLIDING, BLOCK, (names(4)[0], names(4)[2]), 32), KVGroup(FULL, BLOCK, (names(4)[1], names(4)[3])))
    layout = TierLayout.of(MODEL.with_shard(0, 2, 0, 1), groups)
    feed = TierFeed(connect(daemon), space, layout, (3, 5), publish=True, interval=0.05)
    full = full_cache(4, 2, "float16", seed=10)
    ranks = [worker(daemon, full, kv, space, groups=groups) for kv in shard_layouts(MODEL, 2, 1)]
    try:
        eventually(lambda: feed._cursor[0] != 0)  # following before anything is saved
        info = {HASHES[0]: BlockInfo(None, tuple(range(16))), HASHES[1]: BlockInfo(HASHES[0], tuple(range(16, 32)))}
        pages = [(h, g) for h in HASHES[:2] for g in (0, 1)]
        assert all(feed.wanted(p) for p in pages)
        feed.saving(pages, info)
        assert not any(feed.wanted(p) for p in pages)  # in flight: not asked for again
        ranks[0].save(TierSave([(h, g, b) for h, b in zip(HASHES[:2], [1, 2]) for g in (0, 1)]))
        time.sleep(0.3)
        assert feed.take() == []  # rank 1's pages are not there yet: no block is whole
        ranks[1].save(TierSave([(h, g, b) for h, b in zip(HASHES[:2], [1, 2]) for g in (0, 1)]))
        events = []
        eventually(lambda: len(events.extend(feed.take()) or events) == 4)
        assert all(isinstance(e, BlockStored) and e.medium == MEDIUM_CPU for e in events)
        stored = {(e.block_hashes[0], e.group_idx): e for e in events}
        assert set(stored) == {(external(bytes.fromhex(h)), gid) for h in HASHES[:2] for gid in (3, 5)}  # vLLM's ids
        second = stored[external(bytes.fromhex(HASHES[1])), 5]
        assert second.parent_block_hash == external(bytes.fromhex(HASHES[0]))
        assert second.token_ids == list(range(16, 32))
        assert second.block_size == BLOCK
        # an operator's clear (or an eviction: tests/system/test_vllm_prefix_e2e.py) removes them
        with daemon.client() as client:
            client.cache_clear(space)
        removed = []
        eventually(lambda: len(removed.extend(feed.take()) or removed) == 4)
        assert all(isinstance(e, BlockRemoved) and e.medium == MEDIUM_CPU for e in removed)
        assert all(feed.wanted(p) for p in pages)  # gone: saved again the next time they are computed
        feed.cleared()  # the engine reset its prefix cache with kvd's namespace
        assert [type(e) for e in feed.take()] == [AllBlocksCleared]
    finally:
        feed.close()
        for rank in ranks:
            rank.close()


def test_a_follower_that_loses_its_place_removes_what_it_announced(daemons):
    pytest.importorskip("vllm", reason="the events are vLLM's own classes")
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from kvd.integrations.vllm.tier_feed import BlockInfo, TierFeed

    daemon = daemons.start("A", pool_size="64MiB")
    space = ns()
    layout = TierLayout.of(MODEL, [KVGroup(FULL, BLOCK, tuple(names(4)))])
    feed = TierFeed(connect(daemon), space, layout, (0,), publish=True, interval=0.05)
    rank = worker(daemon, full_cache(4, 2, "float16", seed=11), MODEL, space)
    try:
        eventually(lambda: feed._cursor[0] != 0)
        feed.found([(HASHES[0], 0)], {HASHES[0]: BlockInfo(None, tuple(range(16)))})  # a lookup hit it
        assert [type(e) for e in feed.take()] == [BlockStored]
        assert not feed.wanted((HASHES[0], 0))
        daemon.stop()  # the daemon restarts: its tier is gone, and with it the follower's log
        restarted = daemons.start("A", pool_size="64MiB", extra=["--socket", daemon.socket], wait=False)
        restarted.socket = daemon.socket  # (the factory names a new socket; the later --socket wins)
        wait_ready(restarted)
        events = []
        eventually(lambda: events.extend(feed.take()) or events, timeout=15)
        assert [type(e) for e in events] == [BlockRemoved]
        assert feed.wanted((HASHES[0], 0))
    finally:
        feed.close()
        rank.close()
