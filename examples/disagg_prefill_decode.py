#!/usr/bin/env python
"""Disaggregated prefill/decode of a real (small, randomly initialised) Llama model through kvd.

Three processes: this one (starts two kvd daemons, A and B, unless --socket-a/--socket-b name
running ones, and compares), a prefill worker on daemon A and a decode worker on daemon B. Both
workers build the same LlamaForCausalLM from the same config and seed (no weights are
downloaded; a hash of the weights proves they match). The prefill worker runs the prompt batch in one forward
pass; a forward hook on each decoder layer hands that layer's K and V to kvd
(`put_stream(..., dest="B")`) as soon as the layer has run, so layers travel to B while later
layers are still being computed. The last-token logits and the first generated token follow,
then the stream is committed. The decode worker, already waiting in `get_stream`, rebuilds a
DynamicCache as layers arrive and generates greedily (a model forward loop, not generate()).
Afterwards it runs the reference: the same request, prefill and decode, in its one process
without kvd. Tokens must be equal and every step's logits (the prefill's included, which crossed
from A) bit-for-bit equal.

    python examples/disagg_prefill_decode.py                      # hidden 256, 4 layers, GQA
    python examples/disagg_prefill_decode.py --batch 4 --prompt-len 512 --dtype bfloat16
    python examples/disagg_prefill_decode.py --large --json       # hidden 1024, 8 layers

Timing (all on one monotonic clock, shared by the processes):
  prefill   prompt forward on A, from its start until the logits exist (includes the per-layer
            writes into kvd's pool, which overlap the compute)
  handoff   from the logits existing on A until B holds every layer, the logits and the first
            token, with the DynamicCache rebuilt: the part of the transfer not hidden by compute
  TTFT      prefill + handoff: from the prompt's start until the decode worker has the first
            token and can go on generating
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # build from a config only: never reach a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse
import inspect
import json
import multiprocessing as mp
import queue as queue_mod
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WORKER_TIMEOUT = 300.0


@dataclass(frozen=True)
class ModelSpec:
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 688
    vocab: int = 1000
    max_positions: int = 4096
    seed: int = 1234
    dtype: str = "float32"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SMALL = ModelSpec()
LARGE = ModelSpec(hidden=1024, layers=8, heads=16, kv_heads=4, intermediate=2816, vocab=32000)


# --- the model ------------------------------------------------------------------------------------

def build_model(spec: ModelSpec):
    """The same LlamaForCausalLM in every process: a config, a fixed seed, no downloaded weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions, head_dim=spec.head_dim,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    return model.to(DTYPES[spec.dtype]).eval()


def fingerprint(model) -> str:
    """A hash of every parameter's bytes: proves both workers built the same weights."""
    import xxhash

    h = xxhash.xxh3_64()
    for name, param in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(param.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, prompt_len), generator=g)


def new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _cache_kwarg(model) -> str:
    # transformers 5.x renamed forward's `past_key_values` to `cache` (the old name is deprecated)
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def forward_last(model, input_ids: torch.Tensor, cache) -> torch.Tensor:
    """One forward pass that extends `cache`; returns the last position's logits [batch, vocab]."""
    with torch.inference_mode():
        out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{_cache_kwarg(model): cache})
    return out.logits[:, -1, :]


def layer_kv(cache, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer i's (keys, values) [batch, kv_heads, seq, head_dim] from a DynamicCache."""
    if hasattr(cache, "layers"):  # transformers >= 4.56: a list of DynamicLayer
        return cache.layers[i].keys, cache.layers[i].values
    return cache.key_cache[i], cache.value_cache[i]  # older transformers


def warm_up(model) -> None:
    """Run a short prompt and two decode steps once, so that the timed runs do not pay for
    first-call setup."""
    cache = new_cache(model)
    forward_last(model, torch.zeros(1, 8, dtype=torch.long), cache)
    for _ in range(2):
        forward_last(model, torch.zeros(1, 1, dtype=torch.long), cache)


def greedy(model, cache, first_token: torch.Tensor, first_logits: torch.Tensor, new_tokens: int):
    """Generate new_tokens greedily: the first came from the prefill's logits, each later one from a
    decode forward over the previous token. Returns (tokens [batch, n], logits [batch, n, vocab])."""
    tokens, logits = [first_token], [first_logits]
    for _ in range(new_tokens - 1):
        step = forward_last(model, tokens[-1][:, None], cache)
        logits.append(step)
        tokens.append(step.argmax(-1))
    return torch.stack(tokens, 1), torch.stack(logits, 1)


# --- the kvd handoff ------------------------------------------------------------------------------

def k_name(i: int) -> str:
    return f"layer.{i}.k"


def v_name(i: int) -> str:
    return f"layer.{i}.v"


def kv_layout(spec: ModelSpec, batch: int, prompt_len: int) -> dict[str, tuple]:
    """Every tensor of the handoff, declared before the prefill runs (put_stream needs the layout)."""
    dtype = DTYPES[spec.dtype]
    shape = (batch, spec.kv_heads, prompt_len, spec.head_dim)
    layout: dict[str, tuple] = {}
    for i in range(spec.layers):
        layout[k_name(i)] = (shape, dtype)
        layout[v_name(i)] = (shape, dtype)
    layout["logits"] = ((batch, spec.vocab), dtype)
    layout["next_token"] = ((batch,), torch.int64)
    return layout


def kv_bytes(spec: ModelSpec, batch: int, prompt_len: int) -> int:
    elem = torch.empty((), dtype=DTYPES[spec.dtype]).element_size()
    return 2 * spec.layers * batch * spec.kv_heads * prompt_len * spec.head_dim * elem


def prefill(client, model, spec: ModelSpec, prompts: torch.Tensor, request_id: str, dest: str | None,
            mode: str = "stream") -> dict:
    """Run the prompt and hand its cache, logits and first token to kvd.

    mode "stream": put_stream, each layer written from a forward hook as soon as it has run.
    mode "put": one put of everything after the forward pass (for comparison).
    Returns timestamps (time.monotonic) and the first token.
    """
    cache = new_cache(model)
    times: dict = {"layer_written": []}
    if mode == "stream":
        hooks = []
        stream = client.put_stream(request_id, kv_layout(spec, *prompts.shape), dest=dest)
        try:
            def on_layer(i):
                def hook(module, args, output):
                    k, v = layer_kv(cache, i)
                    stream.write({k_name(i): k, v_name(i): v})
                    times["layer_written"].append(time.monotonic())
                return hook

            for i, layer in enumerate(model.model.layers):
                hooks.append(layer.register_forward_hook(on_layer(i)))
            times["start"] = time.monotonic()
            logits = forward_last(model, prompts, cache)
            times["logits"] = time.monotonic()
            first = logits.argmax(-1)
            stream.write({"logits": logits, "next_token": first})
        except BaseException:
            stream.abort()
            raise
        finally:
            for h in hooks:
                h.remove()
        stream.commit()  # returns once dest holds the whole, verified cache
    elif mode == "put":
        times["start"] = time.monotonic()
        logits = forward_last(model, prompts, cache)
        times["logits"] = time.monotonic()
        first = logits.argmax(-1)
        kv = {}
        for i in range(spec.layers):
            kv[k_name(i)], kv[v_name(i)] = layer_kv(cache, i)
        kv["logits"], kv["next_token"] = logits, first
        client.put(request_id, kv, dest=dest)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    times["committed"] = time.monotonic()
    if len(cache) != spec.layers:
        raise RuntimeError(f"the model's cache has {len(cache)} layers, expected {spec.layers}")
    times["first_token"] = first
    return times


def receive(client, model, spec: ModelSpec, request_id: str, timeout: float = 60.0):
    """Fetch a request's cache from kvd as it arrives and rebuild a DynamicCache.

    Returns (cache, first_token, prefill_logits, timestamps)."""
    cache = new_cache(model)
    halves: dict[int, dict[str, torch.Tensor]] = {}
    done: set[int] = set()
    first = logits = None
    times: dict = {"waiting": time.monotonic(), "first_group": None}
    for group in client.get_stream(request_id, timeout=timeout):
        if times["first_group"] is None:
            times["first_group"] = time.monotonic()
        for name, tensor in group.items():
            if name == "logits":
                logits = tensor
            elif name == "next_token":
                first = tensor
            else:
                _, index, kind = name.split(".")
                i = int(index)
                halves.setdefault(i, {})[kind] = tensor
                if len(halves[i]) == 2:
                    cache.update(halves[i]["k"], halves[i]["v"], i)
                    done.add(i)
                    del halves[i]
    times["ready"] = time.monotonic()
    if done != set(range(spec.layers)) or first is None or logits is None:
        raise RuntimeError(f"incomplete cache for {request_id}: layers {sorted(done)}")
    return cache, first, logits, times


# --- transport of results between processes (plain bytes: no shared-memory tensor handles) ---------

def pack(t: torch.Tensor) -> tuple:
    t = t.detach().contiguous()
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), t.view(torch.uint8).numpy().tobytes()


def unpack(packed: tuple) -> torch.Tensor:
    dtype, shape, raw = packed
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


# --- the worker processes ---------------------------------------------------------------------------

def _setup_worker(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


def prefill_worker(socket: str, spec: ModelSpec, batch: int, prompt_len: int, request_id: str, dest: str,
                   mode: str, threads: int | None, go, results) -> None:
    try:
        import kvd

        _setup_worker(threads)
        model = build_model(spec)
        warm_up(model)
        prompts = make_prompts(batch, prompt_len, spec.vocab)
        with kvd.Client(socket) as client:
            results.put(("ready", "prefill", {"fingerprint": fingerprint(model)}))
            if not go.wait(WORKER_TIMEOUT):
                raise TimeoutError("never told to start")
            times = prefill(client, model, spec, prompts, request_id, dest, mode)
            stats = client.stats()
        times["first_token"] = pack(times["first_token"])
        times["pool_used_after"] = stats["pool"]["used_bytes"]
        results.put(("done", "prefill", times))
    except BaseException as exc:  # report, do not hang the parent
        results.put(("error", "prefill", f"{type(exc).__name__}: {exc}"))
        raise


def decode_worker(socket: str, spec: ModelSpec, batch: int, prompt_len: int, request_id: str, new_tokens: int,
                  threads: int | None, results) -> None:
    try:
        import kvd

        _setup_worker(threads)
        model = build_model(spec)
        warm_up(model)
        with kvd.Client(socket) as client:
            results.put(("ready", "decode", {"fingerprint": fingerprint(model), "params": param_count(model)}))
            cache, first, first_logits, times = receive(client, model, spec, request_id, timeout=WORKER_TIMEOUT)
            if cache.get_seq_length() != prompt_len:
                raise RuntimeError(f"the rebuilt cache holds {cache.get_seq_length()} positions, not {prompt_len}")
            t0 = time.monotonic()
            tokens, logits = greedy(model, cache, first, first_logits, new_tokens)
            times["decode_s"] = time.monotonic() - t0
            stats = client.stats()
        times["pool_used_after"] = stats["pool"]["used_bytes"]
        times["tokens"], times["logits"] = pack(tokens), pack(logits)
        # the reference: the whole request again in this one process, from the prompt, without kvd
        # (after the handoff, so that nothing else competes for the CPU while it is timed)
        ref = reference(model, make_prompts(batch, prompt_len, spec.vocab), new_tokens)
        times["reference"] = {"tokens": pack(ref["tokens"]), "logits": pack(ref["logits"]),
                              "ttft_s": ref["ttft_s"], "decode_s": ref["decode_s"]}
        results.put(("done", "decode", times))
    except BaseException as exc:
        results.put(("error", "decode", f"{type(exc).__name__}: {exc}"))
        raise


# --- the reference and the driver -------------------------------------------------------------------

def reference(model, prompts: torch.Tensor, new_tokens: int) -> dict:
    """Prefill and decode in one process, with the same functions and no kvd."""
    cache = new_cache(model)
    t0 = time.monotonic()
    logits = forward_last(model, prompts, cache)
    ttft = time.monotonic() - t0
    t1 = time.monotonic()
    tokens, all_logits = greedy(model, cache, logits.argmax(-1), logits, new_tokens)
    return {"tokens": tokens, "logits": all_logits, "ttft_s": ttft, "decode_s": time.monotonic() - t1}


def compare(ref_tokens, ref_logits, tokens, logits) -> dict:
    tokens_match = torch.equal(ref_tokens, tokens)
    logits_exact = ref_logits.dtype == logits.dtype and ref_logits.shape == logits.shape and torch.equal(
        ref_logits.contiguous().view(torch.uint8), logits.contiguous().view(torch.uint8))
    max_diff = (ref_logits.float() - logits.float()).abs().max().item() if ref_logits.shape == logits.shape else None
    return {"tokens_match": tokens_match, "logits_bit_exact": logits_exact, "logits_max_abs_diff": max_diff,
            "match": tokens_match and logits_exact}


def daemon_report(factory) -> str:
    """The state and log tail of the daemons started here, for an error message."""
    if factory is None:
        return ""
    parts = []
    for d in factory.daemons:
        code = d.proc.poll()
        state = "running" if code is None else f"exited {code}"
        sock_exists = os.path.exists(d.socket.split("://", 1)[1])
        parts.append(f"\n--- daemon {d.node_id} (pid {d.pid}, {state}, socket file "
                     f"{'present' if sock_exists else 'MISSING'}) log tail:\n{d.log()[-2000:]}")
    return "".join(parts)


def collect(results, go, factory) -> tuple[dict, dict]:
    """What the two workers report: each says it is ready (then both are told to go), then done."""
    ready, done = {}, {}
    deadline = time.monotonic() + WORKER_TIMEOUT
    while len(done) < 2:
        try:
            kind, who, payload = results.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue_mod.Empty:
            raise RuntimeError("the workers did not finish in time" + daemon_report(factory)) from None
        if kind == "error":
            raise RuntimeError(f"{who} worker failed: {payload}" + daemon_report(factory))
        (ready if kind == "ready" else done)[who] = payload
        if kind == "ready" and len(ready) == 2:
            time.sleep(0.05)  # the decode worker is now waiting in get_stream
            go.set()
    return ready, done


def run(args) -> dict:
    spec = replace(LARGE if args.large else SMALL, dtype=args.dtype, seed=args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = args.threads or torch.get_num_threads()
    request_id = f"disagg-{os.getpid()}-{time.time_ns()}"

    factory = tmp = None
    try:
        if args.socket_a and args.socket_b:
            socket_a, socket_b = args.socket_a, args.socket_b
        elif args.socket_a or args.socket_b:
            raise SystemExit("give both --socket-a and --socket-b, or neither")
        else:
            from kvd.testing.daemons import DaemonFactory

            tmp = tempfile.TemporaryDirectory(prefix="kvd-disagg-")
            factory = DaemonFactory(Path(tmp.name), log_level="info")
            pool = max(64 << 20, 4 * kv_bytes(spec, args.batch, args.prompt_len))
            a, b = factory.pair(pool_size=f"{-(-pool >> 20)}MiB")
            socket_a, socket_b = a.socket, b.socket

        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        go = ctx.Event()
        decode = ctx.Process(target=decode_worker, name="decode",
                             args=(socket_b, spec, args.batch, args.prompt_len, request_id, args.new_tokens,
                                   threads, results))
        prefill_p = ctx.Process(target=prefill_worker, name="prefill",
                                args=(socket_a, spec, args.batch, args.prompt_len, request_id, args.dest,
                                      args.mode, threads, go, results))
        workers = [decode, prefill_p]
        for w in workers:
            w.start()
        try:
            ready, done = collect(results, go, factory)
            for w in workers:
                w.join(30)
        finally:
            for w in workers:  # only the processes started here
                if w.is_alive():
                    w.terminate()
                    w.join(10)
        if factory is not None:
            failures = factory.stop_all()
            if failures:
                raise RuntimeError("a daemon exited uncleanly:\n" + "\n".join(failures))
    finally:
        if factory is not None:
            factory.stop_all()
        if tmp is not None:
            tmp.cleanup()

    p, d = done["prefill"], done["decode"]
    tokens, logits = unpack(d["tokens"]), unpack(d["logits"])
    ref = {**d["reference"], "tokens": unpack(d["reference"]["tokens"]), "logits": unpack(d["reference"]["logits"])}
    verdict = compare(ref["tokens"], ref["logits"], tokens, logits)
    verdict["first_token_match"] = torch.equal(unpack(p["first_token"]), ref["tokens"][:, 0])
    verdict["same_weights"] = ready["prefill"]["fingerprint"] == ready["decode"]["fingerprint"]
    n_params = ready["decode"]["params"]
    verdict["match"] = verdict["match"] and verdict["first_token_match"] and verdict["same_weights"]

    prefill_s = p["logits"] - p["start"]
    handoff_s = d["ready"] - p["logits"]
    ttft_s = d["ready"] - p["start"]
    moved = kv_bytes(spec, args.batch, args.prompt_len)
    return {
        **verdict,
        "model": {**asdict(spec), "params": n_params},
        "mode": args.mode, "batch": args.batch, "prompt_len": args.prompt_len,
        "prompt_tokens": args.batch * args.prompt_len, "new_tokens": args.new_tokens, "threads": threads,
        "kv_bytes": moved,
        "prefill_s": prefill_s,
        "handoff_s": handoff_s,
        "ttft_s": ttft_s,
        "handoff_share": handoff_s / ttft_s,
        "reference_ttft_s": ref["ttft_s"],
        "first_layer_arrival_s": (d["first_group"] - p["start"]) if d["first_group"] else None,
        "commit_s": p["committed"] - p["logits"],
        "decode_s": d["decode_s"],
        "decode_tokens_per_s": args.batch * max(args.new_tokens - 1, 0) / d["decode_s"] if d["decode_s"] else None,
        "reference_decode_s": ref["decode_s"],
        "pool_used_after": {"A": p["pool_used_after"], "B": d["pool_used_after"]},
        "tokens": tokens.tolist(),
    }


def human(r: dict) -> str:
    m = r["model"]
    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    lines = [
        f"model           Llama {m['params'] / 1e6:.1f}M params: hidden {m['hidden']}, {m['layers']} layers, "
        f"{m['heads']} heads / {m['kv_heads']} KV heads, vocab {m['vocab']}, {m['dtype']}, seed {m['seed']}",
        f"prompt          {r['batch']} x {r['prompt_len']} = {r['prompt_tokens']} tokens; "
        f"{r['new_tokens']} new tokens each; {r['threads']} torch threads per process",
        f"KV moved        {r['kv_bytes'] / 1e6:.2f} MB ({r['mode']}: "
        + ("layer by layer from forward hooks" if r["mode"] == "stream" else "one put after prefill") + ")",
        f"prefill         {ms(r['prefill_s'])} (single-process reference: {ms(r['reference_ttft_s'])})",
        f"handoff         {ms(r['handoff_s'])} after the logits existed (A's commit returned after "
        f"{ms(r['commit_s'])})",
        f"TTFT            {ms(r['ttft_s'])}; handoff share {100 * r['handoff_share']:.1f}%"
        + (f" (first layer readable on B {ms(r['first_layer_arrival_s'])} into the prefill)"
           if r["mode"] == "stream" and r["first_layer_arrival_s"] is not None else ""),
        f"decode          {ms(r['decode_s'])} for {r['new_tokens'] - 1} steps "
        f"(reference {ms(r['reference_decode_s'])})",
        f"tokens match    {r['tokens_match']} (first token from prefill: {r['first_token_match']}); "
        f"logits bit-exact {r['logits_bit_exact']}; same weights {r['same_weights']}",
        f"first tokens    {r['tokens'][0][:12]}",
        f"MATCH           {r['match']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--large", action="store_true", help="hidden 1024, 8 layers, 16/4 heads, vocab 32000")
    parser.add_argument("--mode", choices=["stream", "put"], default="stream",
                        help="stream: put_stream, layer by layer during the forward pass (default); "
                             "put: one put after it")
    parser.add_argument("--seed", type=int, default=SMALL.seed)
    parser.add_argument("--threads", type=int, default=None, help="torch threads in every process")
    parser.add_argument("--socket-a", help="the prefill node's running daemon (default: start A and B here)")
    parser.add_argument("--socket-b", help="the decode node's running daemon")
    parser.add_argument("--dest", default="B", help="daemon A's name for daemon B (default B)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.new_tokens < 1 or args.batch < 1 or args.prompt_len < 1:
        parser.error("--batch, --prompt-len and --new-tokens must be at least 1")
    result = run(args)
    print(json.dumps(result) if args.json else human(result), flush=True)
    return 0 if result["match"] else 1


if __name__ == "__main__":
    sys.exit(main())
