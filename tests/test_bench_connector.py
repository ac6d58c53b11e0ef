"""`python -m bench.connector`'s harness without engines: argument parsing, the interleaved order,
percentiles, token equality against the engine alone, ratios, NIXL's log lines, the skip lines and
the proxy's streamed-token parsing (against a local HTTP server that speaks vLLM's SSE). One run
on real engines (2 requests, kvd's push row and the engine alone) is under -m slow."""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from bench import connector_load as load
from bench.connector_report import (
    NOT_ON_CPU,
    Pass,
    Sample,
    count_nixl_failures,
    engine_deltas,
    own_cpu,
    parse_rows,
    parse_sizes,
    percentile,
    schedule,
    scrape_totals,
    side_of,
    skip_lines,
    step_table,
    summarize,
    table,
)
from kvd.testing.daemons import eventually


def test_sizes_and_rows_parse_and_bad_ones_say_what_is_allowed():
    assert parse_sizes("512, 1024,2048") == [512, 1024, 2048]
    for bad in ("", "512,x", "1", "0,512"):
        with pytest.raises(ValueError, match="--sizes"):
            parse_sizes(bad)
    assert parse_rows("nixl,none,nixl") == ["nixl", "none"]
    with pytest.raises(ValueError, match=r"unknown row 'kvd'.*kvd-push"):
        parse_rows("none,kvd")


def test_rows_are_interleaved_forward_then_backward_at_every_size():
    order = schedule(["a", "b", "c"], [512, 1024], passes=2)
    assert order == [(0, 512, "a"), (0, 512, "b"), (0, 512, "c"), (0, 1024, "a"), (0, 1024, "b"), (0, 1024, "c"),
                     (1, 512, "c"), (1, 512, "b"), (1, 512, "a"), (1, 1024, "c"), (1, 1024, "b"), (1, 1024, "a")]
    # each row's mean position over the passes is the same: none is favoured by going first
    positions = {r: [i % 3 for i, (_, _, row) in enumerate(order) if row == r] for r in "abc"}
    assert len({sum(p) for p in positions.values()}) == 1


def test_percentiles_interpolate_like_numpy():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert math.isnan(percentile([], 50))


def sample(ttft: float, tokens: list[int], prefill: float | None = 0.1, error: str | None = None) -> Sample:
    return Sample(prefill, ttft, ttft + 0.05, tokens, error)


def test_summaries_pool_passes_count_equal_tokens_and_give_ratios_to_the_engine_alone_and_nixl():
    ref = [[1, 2], [3, 4]]
    passes = [
        Pass("none", 512, 0, [sample(0.5, ref[0], None), sample(0.7, ref[1], None)], 1.0, 0,
             {"kvd: decode engine": 2.0}),
        Pass("kvd-push", 512, 0, [sample(1.0, ref[0]), sample(1.2, [3, 5])], 2.0, 4 << 20,
             {"kvd: decode engine": 1.0, "kvd: daemon D": 0.5, "nixl: decode engine": 4.0, "proxy": 0.25}),
        Pass("nixl", 512, 0, [sample(4.0, ref[0]), sample(6.0, ref[1])], 4.0, 4 << 20, {"nixl: decode engine": 3.0},
             expired=2, invalid=1),
        Pass("none", 512, 1, [sample(0.6, ref[0], None), sample(0.6, ref[1], None)], 1.0, 0,
             {"kvd: decode engine": 2.0}),
        Pass("kvd-push", 512, 1, [sample(1.1, ref[0]), sample(0.9, ref[1], error="HTTPError: 500")], 2.0, 2 << 20,
             {"kvd: decode engine": 1.0}),
    ]
    by_row = {s.row: s for s in summarize(passes)}
    kvd, none, nixl = by_row["kvd-push"], by_row["none"], by_row["nixl"]
    assert kvd.requests == 4 and kvd.errors == 1
    assert kvd.equal == 2  # one differs, the failed one is not equal
    assert none.equal == 4 and nixl.equal == 2
    assert kvd.ttft_p50 == pytest.approx(1.1)  # of the three that answered
    assert kvd.pass_p50s == [pytest.approx(1.1), pytest.approx(1.1)]
    assert none.ttft_p50 == pytest.approx(0.6)
    assert kvd.ratios == {"none": pytest.approx(1.1 / 0.6), "nixl": pytest.approx(1.1 / 5.0)}
    assert "nixl" not in nixl.ratios and "none" not in none.ratios
    assert kvd.kv_mib_per_request == pytest.approx(6 / 4)
    assert kvd.cpu_s == {"kvd: decode engine": 2.0, "kvd: daemon D": 0.5, "nixl: decode engine": 4.0, "proxy": 0.25}
    assert own_cpu(kvd) == 2.75  # not the idle NIXL engines' (shown apart, by cpu_lines)
    assert kvd.tokens_per_s == pytest.approx(6 / 4.0)  # tokens of the answered requests over both passes' wall
    assert (nixl.expired, nixl.invalid) == (2, 1)
    text = table(list(by_row.values()))
    line = next(line for line in text.splitlines() if "| kvd-push (1 failed) |" in line)
    assert "| 3/4 |" not in line and "| 2/4 |" in line and "| 2.8 |" in line and "1.83x" in line and "0.22x" in line
    assert "| 2 / 1 |" in next(line for line in text.splitlines() if "| nixl |" in line)


def test_without_the_engine_alone_there_is_no_equality_and_no_ratio_to_it():
    [only] = summarize([Pass("kvd-pull", 1024, 0, [sample(1.0, [1])], 1.0, None, {})])
    assert only.equal is None and only.ratios == {} and only.kv_mib_per_request is None


METRICS_BEFORE = """# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="model"} 1.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="model"} 0.5
vllm:request_queue_time_seconds_count{engine="0",model_name="model"} 2.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="model"} 1.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="model"} 10.0
vllm:num_preemptions_total{engine="0",model_name="model"} 1.0
vllm:kvd_save_step_seconds_sum{engine="0",model_name="model"} 0.0
vllm:kvd_save_step_seconds_count{engine="0",model_name="model"} 0.0
"""


def test_the_engines_metrics_are_summed_over_label_sets_and_differenced_between_scrapes():
    before = scrape_totals(METRICS_BEFORE)
    assert before["vllm:request_queue_time_seconds_sum"] == 0.5  # (buckets and HELP lines are not totals)
    assert "vllm:request_queue_time_seconds_bucket" not in before
    after = scrape_totals(METRICS_BEFORE.replace("0.5", "1.7").replace("_count{engine=\"0\",model_name=\"model\"} 2.0",
                                                                       "_count{engine=\"0\",model_name=\"model\"} 5.0")
                          + 'vllm:request_queue_time_seconds_sum{engine="1",model_name="model"} 1.0\n'
                          + 'vllm:request_queue_time_seconds_count{engine="1",model_name="model"} 1.0\n'
                          + 'vllm:num_preemptions_total{engine="1",model_name="model"} 3.0\n')
    deltas = engine_deltas("P", before, after)
    assert deltas["P:queue"] == pytest.approx((2.2, 4.0))  # 3 more on engine 0, 1 on engine 1
    assert deltas["P:preemptions"] == (3.0, 1.0)
    assert "P:step" not in deltas and "P:kvd save" not in deltas  # nothing counted: no column
    assert engine_deltas("D", {}, scrape_totals("")) == {}  # an engine that did not answer


def test_the_step_table_compares_decode_s_side_with_one_decode_step_of_the_engine_alone():
    none = Pass("none", 512, 0, [sample(0.5, [1], None)], 1.0, 0, {},
                engine={"D:step": (0.4, 8.0), "D:queue": (0.02, 1.0)})
    push = Pass("kvd-push", 512, 0, [sample(1.0, [1], prefill=0.88), sample(1.2, [1], prefill=1.0)], 1.0, 0, {},
                engine={"P:kvd save": (0.03, 2.0), "P:preemptions": (0.0, 1.0), "D:kvd load": (0.02, 2.0)})
    summaries = summarize([none, push])
    by_row = {s.row: s for s in summaries}
    assert by_row["kvd-push"].decode_p50 == pytest.approx(0.16)  # (0.12 and 0.2)
    assert by_row["none"].decode_p50 is None  # no prefill step
    lines = step_table(summaries).splitlines()
    [row] = [line for line in lines if "| kvd-push |" in line]
    cells = [c.strip() for c in row.strip("|").split("|")]
    # P kvd save/step 15 ms, D kvd load 10 ms, decode side 160 ms = 3.2x the alone's 50 ms step
    assert cells[4] == "15" and cells[6] == "10" and cells[9] == "160" and cells[10] == "3.20x"
    assert cells[11] == "P 0"


def test_nixl_expiry_and_invalid_block_lines_are_counted():
    log = "\n".join([
        "(EngineCore pid=1) WARNING [base_worker.py:3033] Releasing expired KV blocks for request cmpl-1 which were "
        "retrieved by 0 remote worker(s) before lease expired.",
        "(EngineCore pid=1) WARNING [pull_worker.py:668] Potentially invalid KV blocks for unrecognized request "
        "cmpl-2 were retrieved by a decode worker.",
        "INFO something else about KV blocks",
        "Releasing expired KV blocks for request cmpl-3 which were retrieved by 0 remote worker(s)"])
    assert count_nixl_failures(log) == (2, 1)
    assert count_nixl_failures("") == (0, 0)


def test_rows_that_cannot_run_here_are_one_line_each_saying_why():
    lines = skip_lines(["none", "shared-storage", "kvd-push", "lmcache"])
    assert [line.split(":")[1].strip().split()[0] for line in lines] == ["lmcache"]
    assert NOT_ON_CPU["lmcache"] in lines[0]
    assert skip_lines(["none", "nixl"]) == []


def test_the_proxy_params_of_each_row():
    assert load.first_params("kvd-push", "tcp://10.0.0.2:7470") == {"do_remote_decode": True,
                                                                    "kvd_dest": "tcp://10.0.0.2:7470"}
    assert load.first_params("kvd-pull", None) == {"do_remote_decode": True}
    # the pipelined prefill pushes like kvd-push, from engines of its own
    assert load.first_params("kvd-pp", "tcp://10.0.0.3:7470")["kvd_dest"] == "tcp://10.0.0.3:7470"
    assert side_of("kvd-pp") == "pp" and side_of("kvd-push") == side_of("kvd-pull") == side_of("none") == "kvd"
    # kvd on the NIXL plane: a push, from a set of its own (its daemons on --data-plane nixl); a side's name has
    # no "-" (engines are named side-P, side-D)
    assert load.first_params("kvd-nixl", "tcp://10.0.0.4:7470")["kvd_dest"] == "tcp://10.0.0.4:7470"
    assert side_of("kvd-nixl") == "plane" and "-" not in side_of("kvd-nixl")
    assert load.first_params("nixl", None)["remote_block_ids"] is None
    with pytest.raises(ValueError, match="no prefill step"):
        load.first_params("none", None)
    a, b = load.prompts(2, 512, seed=0), load.prompts(2, 512, seed=0)
    assert a == b and len(a[0]) == 512 and a[0] != a[1] and load.prompts(2, 512, seed=1) != a


class FakeEngine(BaseHTTPRequestHandler):
    """vLLM's completions: a plain reply for the prefill, server-sent events for the decode."""

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        self.send_response(200)
        self.end_headers()
        if not body.get("stream"):
            self.wfile.write(json.dumps({"kv_transfer_params": {"kvd_request_id": "x"}}).encode())
            return
        chunks = [{"choices": [{"token_ids": None, "text": ""}]}, {"choices": [{"token_ids": [7, 8]}]},
                  {"choices": [{"token_ids": [9]}]}]
        for chunk in chunks:
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def fake_engine():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeEngine)
    server.bodies = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


def test_one_request_is_timed_from_the_send_to_the_first_streamed_token(fake_engine):
    url = f"http://127.0.0.1:{fake_engine.server_address[1]}"
    samples, wall = load.send_all("kvd-push", [[5, 6, 7]], 3, url, url, "tcp://d:1")
    [s] = samples
    assert s.error is None and s.tokens == [7, 8, 9]
    assert 0 < s.prefill_s <= s.ttft_s <= s.e2e_s <= wall
    prefill, decode = fake_engine.bodies
    assert prefill["max_tokens"] == 1 and prefill["kv_transfer_params"]["kvd_dest"] == "tcp://d:1"
    assert decode["stream"] and decode["kv_transfer_params"] == {"kvd_request_id": "x"}


def test_a_failed_request_is_counted_not_raised():
    [s], _ = load.send_all("kvd-push", [[1, 2]], 2, "http://127.0.0.1:9", "http://127.0.0.1:9", "tcp://d:1")
    assert s.error and s.tokens == []


def test_engine_sets_not_measured_are_paused_whole_and_resumed():
    # an engine is a process group (API server, engine core, workers): every one of them stops
    import subprocess

    from bench.connector_engines import pause

    def state(pid: int) -> str:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    def children(pid: int) -> list[int]:  # (by parent pid: not every kernel has /proc/PID/task/PID/children)
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(stat.parent.name))
            except (OSError, ValueError):
                pass
        return found

    sleeper = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; " \
              "time.sleep(60)']); time.sleep(60)"
    engine = subprocess.Popen([sys.executable, "-c", sleeper], start_new_session=True)
    try:
        eventually(lambda: len(children(engine.pid)) == 1)
        [worker] = children(engine.pid)
        pause(engine.pid, group=True, paused=True)
        eventually(lambda: state(engine.pid) == "T" and state(worker) == "T")
        pause(engine.pid, group=True, paused=False)
        eventually(lambda: state(engine.pid) != "T" and state(worker) != "T")
    finally:
        os.killpg(engine.pid, signal.SIGKILL)
        engine.wait()
    pause(engine.pid, group=False, paused=True)  # gone: nothing to do, no error


@pytest.mark.slow
def test_two_requests_through_kvd_on_real_engines_are_token_exact(tmp_path, capsys):
    pytest.importorskip("vllm")
    from bench import connector

    out = tmp_path / "samples.json"
    assert connector.main(["--sizes", "128", "--requests", "2", "--rows", "none,kvd-push,kvd-pp", "--passes", "1",
                           "--workdir", str(tmp_path), "--json", str(out)]) == 0
    passes = json.loads(out.read_text())
    assert {p["row"] for p in passes} == {"none", "kvd-push", "kvd-pp"}
    push = next(p for p in passes if p["row"] == "kvd-push")
    assert push["kv_bytes"] >= 2 * 4 * 128 * 1024  # 2 prompts x 4 layers x 128 tokens x 1 KiB
    assert all(s["error"] is None for p in passes for s in p["samples"])
    printed = capsys.readouterr().out
    assert "| 128 | kvd-push | " in printed and "| 128 | kvd-pp | " in printed
    assert "idle, each set alone: kvd " in printed and " pp " in printed
    assert sys.modules["bench.connector"] is connector
