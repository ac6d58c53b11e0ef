"""A real model (a small Llama built from a config and a seed) generates exactly the same tokens,
with bit-exact logits, whether prefill and decode run in one process or hand the KV cache over
through two kvd daemons (examples/disagg_prefill_decode.py)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
pytest.importorskip("transformers")

from kvd.testing.daemons import DaemonFactory, eventually

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "disagg_prefill_decode.py"


def load_example():
    spec = importlib.util.spec_from_file_location("disagg_prefill_decode", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


ex = load_example()


@cache
def model_for(dtype: str, which: str):
    """Separate instances for the 'prefill', 'decode' and 'reference' roles, built independently."""
    model = ex.build_model(replace(ex.SMALL, dtype=dtype))
    ex.warm_up(model)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    factory = DaemonFactory(tmp_path_factory.mktemp("disagg"), log_level="info")
    a, b = factory.pair()
    yield a, b
    failures = factory.stop_all()
    assert not failures, "\n".join(failures)


@pytest.fixture(scope="module")
def clients(pair):
    a, b = pair
    with a.client() as ca, b.client() as cb:
        yield ca, cb


def disaggregated(clients, dtype: str, batch: int, prompt_len: int, new_tokens: int, mode: str, request_id: str):
    """Prefill on A's client, decode on B's: B waits in get_stream (in a thread) while A computes."""
    ca, cb = clients
    spec = replace(ex.SMALL, dtype=dtype)
    prompts = ex.make_prompts(batch, prompt_len, spec.vocab)
    received: dict = {}
    # build both models here, one after the other: building seeds torch's global RNG, so two
    # builds running at once in two threads would interleave their draws and differ
    prefill_model, decode_model = model_for(dtype, "prefill"), model_for(dtype, "decode")

    def fetch():
        try:
            received["value"] = ex.receive(cb, decode_model, spec, request_id, timeout=30)
        except BaseException as exc:  # surfaced below
            received["error"] = exc

    reader = threading.Thread(target=fetch)
    reader.start()
    try:
        times = ex.prefill(ca, prefill_model, spec, prompts, request_id, dest="B", mode=mode)
    finally:
        reader.join(60)
    assert not reader.is_alive()
    if "error" in received:
        raise received["error"]
    cache, first, first_logits, _ = received["value"]
    assert torch.equal(first, times["first_token"])
    assert cache.get_seq_length() == prompt_len
    # generation runs in this (the main) thread, as the reference does
    tokens, logits = ex.greedy(decode_model, cache, first, first_logits, new_tokens)
    return prompts, tokens, logits


CASES = [
    # dtype, batch, prompt_len, new_tokens, mode
    pytest.param("float32", 1, 64, 12, "stream", id="fp32-b1-p64"),
    pytest.param("float32", 2, 200, 10, "stream", id="fp32-b2-p200"),
    pytest.param("float32", 3, 37, 8, "put", id="fp32-b3-p37-put"),
    pytest.param("bfloat16", 1, 64, 12, "stream", id="bf16-b1-p64"),
    pytest.param("bfloat16", 2, 200, 10, "stream", id="bf16-b2-p200"),
]


@pytest.mark.parametrize("dtype,batch,prompt_len,new_tokens,mode", CASES)
def test_disaggregated_tokens_and_logits_are_bit_exact(clients, dtype, batch, prompt_len, new_tokens, mode):
    request_id = f"model-{dtype}-{batch}-{prompt_len}-{mode}"
    prompts, tokens, logits = disaggregated(clients, dtype, batch, prompt_len, new_tokens, mode, request_id)
    ref = ex.reference(model_for(dtype, "reference"), prompts, new_tokens)

    assert tokens.shape == (batch, new_tokens)
    assert torch.equal(tokens, ref["tokens"]), (tokens, ref["tokens"])
    assert logits.dtype == ref["logits"].dtype == getattr(torch, dtype)
    # bit-exact: compare the bytes, not just values
    assert torch.equal(logits.view(torch.uint8), ref["logits"].view(torch.uint8))
    assert torch.equal(logits[:, -1], ref["logits"][:, -1])
    # a random-weight model does not emit one token forever: the check covers several distinct ones
    assert len(set(tokens.flatten().tolist())) > 1

    ca, cb = clients
    assert cb.stats()["pool"]["used_bytes"] == 0  # the get consumed the entry
    # the push released A's copy (its blocks, once ZeroMQ let go of the frames that carried them)
    eventually(lambda: ca.stats()["pool"]["used_bytes"] == 0, timeout=10)


def test_same_seed_same_weights_different_seed_different_tokens():
    spec = replace(ex.SMALL, dtype="float32")
    assert ex.fingerprint(model_for("float32", "prefill")) == ex.fingerprint(model_for("float32", "decode"))
    other = ex.build_model(replace(spec, seed=spec.seed + 1))
    assert ex.fingerprint(other) != ex.fingerprint(model_for("float32", "prefill"))
    prompts = ex.make_prompts(1, 32, spec.vocab)
    # the comparison would catch a wrong cache: a different model gives different tokens
    assert not torch.equal(ex.reference(other, prompts, 6)["logits"],
                           ex.reference(model_for("float32", "reference"), prompts, 6)["logits"])


def test_a_corrupted_layer_changes_the_output(clients):
    """The bit-exact check is sensitive: flipping one K element of one layer changes the logits."""
    dtype, batch, prompt_len, new_tokens = "float32", 1, 48, 4
    prompts, _tokens, logits = disaggregated(clients, dtype, batch, prompt_len, new_tokens, "stream", "model-corrupt")
    ref = ex.reference(model_for(dtype, "reference"), prompts, new_tokens)
    assert torch.equal(logits, ref["logits"])
    model = model_for(dtype, "reference")
    cache = ex.new_cache(model)
    first_logits = ex.forward_last(model, prompts, cache)
    keys, _ = ex.layer_kv(cache, 1)
    with torch.inference_mode():
        keys[0, 0, 5, 0] += 1.0
    _, bad = ex.greedy(model, cache, first_logits.argmax(-1), first_logits, new_tokens)
    assert not torch.equal(bad, ref["logits"])


def run_example(*args: str, timeout: float = 180) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(EXAMPLE), *args, "--json"], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_example_end_to_end_in_separate_processes():
    """The example: its own two daemons, a prefill process and a decode process, over TCP."""
    result = run_example("--prompt-len", "48", "--batch", "2", "--new-tokens", "6")
    assert result["match"] is True
    assert result["tokens_match"] and result["logits_bit_exact"] and result["same_weights"]
    assert result["prompt_tokens"] == 96
    assert result["kv_bytes"] == 2 * 4 * 2 * 2 * 48 * 64 * 4
    assert result["pool_used_after"] == {"A": 0, "B": 0}
    assert 0 <= result["handoff_share"] <= 1 and result["ttft_s"] >= result["prefill_s"]


@pytest.mark.slow
def test_example_bf16_against_running_daemons(pair):
    a, b = pair
    result = run_example("--prompt-len", "300", "--batch", "2", "--new-tokens", "16", "--dtype", "bfloat16",
                         "--socket-a", a.socket, "--socket-b", b.socket)
    assert result["match"] is True


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["stream", "put"])
def test_example_large_model(mode):
    result = run_example("--large", "--prompt-len", "512", "--batch", "2", "--new-tokens", "16", "--mode", mode,
                         timeout=600)
    assert result["match"] is True
