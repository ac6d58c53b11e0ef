"""The prefix-reuse benchmark's pure parts (bench/connector_prefix.py): prompts, the order of the
rows, the table and the goal's verdict, from made-up measurements."""
from __future__ import annotations

from bench.connector_prefix import GOAL, MEASURED, NOT_ON_CPU, Row, goal_line, order, prompts, summarize


def test_every_request_shares_the_prefix_and_has_a_suffix_of_its_own():
    prefix, batch = prompts(2048, 16, seed=3)
    assert len(prefix) == 2048 and len(batch) == 16
    assert all(p[:2048] == prefix and 16 <= len(p) - 2048 < 64 for p in batch)
    assert len({tuple(p[2048:]) for p in batch}) == 16
    assert prompts(2048, 16, seed=3) == (prefix, batch) and prompts(2048, 16, seed=4)[0] != prefix


def test_rows_go_forward_then_backward_and_the_offload_row_says_why_it_is_not_run():
    assert order(3) == [(0, MEASURED), (1, MEASURED[::-1]), (2, MEASURED)]
    assert MEASURED == ["recompute", "kvd-same", "kvd-other"] and "offload" in NOT_ON_CPU
    table = "\n".join(summarize({"recompute": Row("recompute", [1.0, 1.2])}))
    assert "| offload | — |" in table and "CUDA-alike" in table


def row(name: str, ttft: list[float], equal: int | None = None, errors: list[str] | None = None) -> Row:
    r = Row(name, list(ttft), pass_p50s=[ttft[0]])
    if equal is not None:
        r.equal, r.compared = equal, len(ttft)
    r.errors = errors or []
    return r


def test_the_goal_is_met_only_at_half_recompute_or_better_with_every_token_equal():
    rows = {"recompute": row("recompute", [1.0, 1.0, 1.0]), "kvd-same": row("kvd-same", [0.4, 0.5, 0.45], equal=3),
            "kvd-other": row("kvd-other", [0.6, 0.6, 0.6], equal=3)}
    line = goal_line(rows)
    assert f"<= {GOAL}x" in line
    assert "kvd-same 0.45x, tokens equal: met" in line and "kvd-other 0.60x, tokens equal: NOT met" in line
    rows["kvd-same"] = row("kvd-same", [0.4, 0.4, 0.4], equal=2)  # fast, but a request's tokens differ
    assert "kvd-same 0.40x, tokens NOT all equal: NOT met" in goal_line(rows)
    rows["kvd-same"] = row("kvd-same", [0.4, 0.4, 0.4], equal=3, errors=["URLError: refused"])
    assert "kvd-same 0.40x, tokens NOT all equal: NOT met" in goal_line(rows)
    assert "kvd-other: not measured" in goal_line({"recompute": rows["recompute"]})


def test_the_table_gives_ratios_to_recompute_and_tokens_equal():
    rows = {"recompute": row("recompute", [2.0, 2.0]), "kvd-same": row("kvd-same", [0.5, 0.5], equal=2)}
    rows["kvd-same"].hits = 128
    table = summarize(rows)
    same = next(line for line in table if line.startswith("| kvd-same"))
    assert "| 500 |" in same and "| 0.25x |" in same and "| 2/2 |" in same and "| 128 |" in same
    assert table[-1].startswith("Goal")
