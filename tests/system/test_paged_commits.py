"""A push's commit off the engine's thread (`PagedKVWorker(commit_in_background=True)`, what the vLLM
connector runs): the step ends once its blocks are in the pool, the next step's streams open on
another connection, the entry still arrives bit-exact and whole, and a failed delivery is counted,
never raised into the engine. Real daemons, real paged tensors, no vLLM."""
from __future__ import annotations

import time

import pytest
import torch

from kvd import Client
from kvd.integrations.paged.handoff import MAX_COMMITS_IN_FLIGHT, LoadSpec, PagedKVLayout, PagedKVWorker, SaveSpec
from kvd.testing.daemons import free_port

from .test_paged_kv import BLOCK, LAYERS, bits, paged_caches, wait_results


def make(daemon, caches, background: bool, retry_after: float = 10.0) -> PagedKVWorker:
    layout = PagedKVLayout.from_caches(caches, model="tiny", block_size=BLOCK)
    return PagedKVWorker(caches, layout, load_timeout=10.0, commit_in_background=background, retry_after=retry_after,
                         connect=lambda: Client(daemon.socket, reply_timeout=2.0, connect_timeout=1.0).connect())


def step(worker: PagedKVWorker, specs: list[SaveSpec]) -> set[str]:
    for name in LAYERS:
        worker.save_layer(specs, name, worker.caches[name])
    return worker.finish_saves(specs)


@pytest.mark.slow  # the opt-in background commit (KVD_VLLM_COMMIT_IN_BACKGROUND); ~10 s each
def test_pushes_committed_in_the_background_arrive_bit_exact_and_steps_reuse_connections(daemons):
    a, b = daemons.pair()
    producer = make(a, paged_caches(seed=1), background=True)
    consumer_caches = paged_caches(seed=2)
    consumer = make(b, consumer_caches, background=False)
    try:
        tables = {f"r{i}": [3 * i + 1, 3 * i + 2, 3 * i + 3] for i in range(6)}
        for req_id, table in tables.items():  # one request per step, as prefills complete
            assert step(producer, [SaveSpec(req_id, f"eng:{req_id}", table, 3 * BLOCK - 1, dest=b.listen)]) == set()
            # (each step's connection is busy with its commit: the next opens on another, up to the cap)
            assert len(producer._commits) <= MAX_COMMITS_IN_FLIGHT
        producer.flush_commits()
        assert not producer._commits and 1 <= len(producer._spare) <= MAX_COMMITS_IN_FLIGHT
        dst = {req_id: [20 + 3 * i, 21 + 3 * i, 22 + 3 * i] for i, req_id in enumerate(tables)}
        for req_id in tables:
            consumer.start_load(LoadSpec(req_id, f"eng:{req_id}", dst[req_id], 3 * BLOCK - 1))
        finished, failed, _ = wait_results(consumer)
        assert (finished, failed) == (set(tables), set())
        for req_id, table in tables.items():
            for name in LAYERS:
                assert torch.equal(bits(consumer_caches[name][dst[req_id]]), bits(producer.caches[name][table]))
        stats = producer.take_stats()
        assert (stats.saves, stats.save_failures) == (len(tables), 0)
    finally:
        producer.close()
        consumer.close()


@pytest.mark.slow
def test_a_delivery_that_fails_in_the_background_is_counted_and_the_engine_goes_on(daemons):
    a = daemons.start("A", pool_size="64MiB")
    nobody = f"tcp://127.0.0.1:{free_port()}"  # no daemon there: the push cannot be delivered
    producer = make(a, paged_caches(seed=1), background=True, retry_after=0.0)
    try:
        started = time.monotonic()
        assert step(producer, [SaveSpec("lost", "eng:lost", [1, 2], 2 * BLOCK, dest=nobody)]) == set()
        assert time.monotonic() - started < 2.0  # the step did not wait for the delivery
        producer.flush_commits()
        stats = producer.take_stats()
        assert (stats.saves, stats.save_failures) == (0, 1)
        # the next request, kept on this node (a pull), saves and commits as before (once retry_after
        # has passed: a failure reported by the daemon holds saves back for that long, as inline)
        assert step(producer, [SaveSpec("kept", "eng:kept", [3], BLOCK)]) == set()
        producer.flush_commits()
        assert producer.take_stats().saves == 1
        with a.client() as client:
            assert [e["request_id"] for e in client.list()] == ["eng:kept@tp0.pp0"]
    finally:
        producer.close()
