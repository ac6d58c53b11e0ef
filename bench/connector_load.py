"""The connector benchmark's proxy: sends N requests at once, each as a disaggregation proxy would
(examples/vllm_proxy.py: prefill with max_tokens=1 and the connector's kv_transfer_params, then
decode with what prefill returned), and times each from its send to the decode engine's first
streamed token and to its last.
"""
from __future__ import annotations

import json
import random
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .connector_report import Sample

NO_PARAMS = ("split", "shared-storage")  # rows whose prefill request carries no kv_transfer_params
TIMEOUT = 900.0  # seconds for one request: 16 long prompts on two busy cores take minutes with NIXL


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    """Random token ids (the model's vocabulary is 1024; 0-2 are the word tokenizer's specials)."""
    rng = random.Random(seed * 100_003 + length)
    return [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(count)]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT) as reply:
        return json.loads(reply.read())


def stream(url: str, body: dict) -> tuple[float, float, list[int]]:
    """(first token's arrival, last's, the token ids) of a streamed completion."""
    request = urllib.request.Request(url, data=json.dumps(dict(body, stream=True)).encode(),
                                     headers={"Content-Type": "application/json"})
    first = last = None
    tokens: list[int] = []
    with urllib.request.urlopen(request, timeout=TIMEOUT) as reply:
        for raw in reply:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            new = [t for choice in chunk.get("choices", []) for t in choice.get("token_ids") or []]
            if new:
                last = time.monotonic()
                first = first or last
                tokens += new
    if first is None:
        raise RuntimeError("the decode engine streamed no token")
    return first, last, tokens


def body(prompt: list[int], max_tokens: int, params: dict | None = None) -> dict:
    out = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
           "return_token_ids": True}
    if params is not None:
        out["kv_transfer_params"] = params
    return out


def first_params(row: str, decode_kvd: str | None) -> dict | None:
    """What the proxy gives the prefill engine: kvd's push names the decode daemon, its pull names
    nothing (decode's daemon pulls from the source prefill returns), NIXL's are vLLM's own."""
    if row in ("kvd-push", "kvd-push-background", "kvd-pp", "kvd-nixl"):
        return {"do_remote_decode": True, "kvd_dest": decode_kvd}
    if row == "kvd-pull":
        return {"do_remote_decode": True}
    if row == "nixl":
        return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}
    if row in NO_PARAMS:  # a plain prefill request (the storage connector finds the KV by the prompt's hash)
        return None
    raise ValueError(f"row {row!r} has no prefill step")


def one(row: str, prompt: list[int], max_tokens: int, prefill_url: str | None, decode_url: str,
        decode_kvd: str | None, blocks: Callable[[dict], None] | None = None) -> Sample:
    """One request through the row, timed from the proxy's send."""
    t0 = time.monotonic()
    try:
        params = prefill_s = None
        if prefill_url is not None:
            prefilled = post(prefill_url + "/v1/completions", body(prompt, 1, first_params(row, decode_kvd)))
            prefill_s = time.monotonic() - t0
            params = prefilled.get("kv_transfer_params")
            if row not in NO_PARAMS and not params:
                raise RuntimeError("the prefill engine returned no kv_transfer_params")
            if blocks is not None and params:
                blocks(params)
        first, last, tokens = stream(decode_url + "/v1/completions", body(prompt, max_tokens, params))
        return Sample(prefill_s, first - t0, last - t0, tokens)
    except Exception as exc:  # one failed request is counted, not the end of the benchmark
        now = time.monotonic() - t0
        return Sample(None, now, now, [], error=f"{type(exc).__name__}: {exc}")


def send_all(row: str, batch: list[list[int]], max_tokens: int, prefill_url: str | None, decode_url: str,
             decode_kvd: str | None = None, blocks: Callable[[dict], None] | None = None) -> tuple[list[Sample], float]:
    """Every prompt at once, each on its own thread; (samples in prompt order, wall seconds)."""
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(batch)) as pool:
        futures = [pool.submit(one, row, p, max_tokens, prefill_url, decode_url, decode_kvd, blocks) for p in batch]
        samples = [f.result() for f in futures]
    return samples, time.monotonic() - started
