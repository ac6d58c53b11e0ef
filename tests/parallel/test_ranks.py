"""kvd.parallel.ranks: every factorization of every world size 1..16, against vLLM's own recipe."""
from __future__ import annotations

import pytest
import torch

from kvd.parallel import GROUP_KINDS, rank_layout


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorizations(world: int) -> list[tuple[int, int, int, int]]:
    """Every (tp, pp, dp, ep) with tp * pp * dp == world and ep dividing dp * tp."""
    return [(tp, pp, world // (tp * pp), ep)
            for tp in divisors(world) for pp in divisors(world // tp)
            for ep in divisors(world // pp)]


def vllm_groups(world: int, tp: int, pp: int, dp: int) -> dict[str, list[list[int]]]:
    # the tensor recipe of vllm/distributed/parallel_state.py initialize_model_parallel
    all_ranks = torch.arange(world).reshape(-1, dp, pp, tp)
    return {
        "tp": all_ranks.view(-1, tp).tolist(),
        "pp": all_ranks.transpose(2, 3).reshape(-1, pp).tolist(),
        "dp": all_ranks.transpose(1, 3).reshape(-1, dp).tolist(),
        "ep": all_ranks.transpose(1, 2).reshape(-1, dp * tp).tolist(),
    }


@pytest.mark.parametrize("world", range(1, 17))
def test_every_factorization(world):
    for tp, pp, dp, ep in factorizations(world):
        layout = rank_layout(world, tp, pp, dp, ep)
        sizes = {"tp": tp, "pp": pp, "dp": dp, "ep": ep}
        for kind in GROUP_KINDS:
            groups = layout.groups(kind)
            flat = sorted(r for g in groups for r in g)
            assert flat == list(range(world)), (kind, tp, pp, dp, ep)  # every rank exactly once
            assert all(len(g) == sizes[kind] for g in groups)
            assert len(groups) == world // sizes[kind]
            assert all(list(g) == sorted(g) for g in groups)  # new_group numbers ranks ascending
        assert all(g == tuple(range(g[0], g[0] + tp)) for g in layout.tp_groups)  # contiguous
        for rank in range(world):
            d, p, t = layout.coords(rank)
            assert rank == (d * pp + p) * tp + t == layout.rank_of(d, p, t)
            # a group fixes every coordinate but its own
            assert all(layout.coords(r)[:2] == (d, p) for r in layout.group_of("tp", rank))
            assert all(layout.coords(r)[0::2] == (d, t) for r in layout.group_of("pp", rank))
            assert all(layout.coords(r)[1:] == (p, t) for r in layout.group_of("dp", rank))
            assert all(layout.coords(r)[1] == p for r in layout.group_of("ep", rank))
            assert layout.group_of("tp", rank).index(rank) == t
            assert layout.group_of("pp", rank).index(rank) == p
            assert layout.group_of("dp", rank).index(rank) == d


@pytest.mark.parametrize("world", range(1, 17))
def test_matches_vllm_recipe(world):
    for tp, pp, dp, _ in factorizations(world):
        layout = rank_layout(world, tp, pp, dp, expert_parallel_size=None)
        assert layout.ep == dp * tp
        for kind, expected in vllm_groups(world, tp, pp, dp).items():
            assert [list(g) for g in layout.groups(kind)] == expected, kind


def test_ep_subgroups_are_consecutive_runs_of_one_stage():
    layout = rank_layout(8, tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2,
                         expert_parallel_size=2)
    # stage 0 holds ranks 0,1 (dp 0) and 4,5 (dp 1); stage 1 holds 2,3 and 6,7
    assert layout.ep_groups == ((0, 1), (4, 5), (2, 3), (6, 7))
    assert rank_layout(8, 2, 2, 2, 4).ep_groups == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert rank_layout(8, 2, 2, 2, 1).ep_groups == tuple((r,) for r in (0, 1, 4, 5, 2, 3, 6, 7))


def test_worked_example():
    layout = rank_layout(8, tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2)
    assert layout.tp_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert layout.pp_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert layout.dp_groups == ((0, 4), (2, 6), (1, 5), (3, 7))
    assert layout.coords(6) == (1, 1, 0)


@pytest.mark.parametrize("args, match", [
    ((6, 4, 1, 1), "not divisible"),
    ((8, 3, 1, 1), "not divisible"),
    ((8, 2, 2, 1), r"world size 8 != tp \* pp \* dp .*data_parallel_size=2 would fit"),
    ((4, 2, 1, 4), r"world size 4 != tp"),
    ((0, 1, 1, 1), "world_size must be a positive int"),
    ((4, 0, 1, 1), "tensor_parallel_size must be a positive int"),
    ((4, -2, 1, 1), "tensor_parallel_size must be a positive int"),
    ((4, 2, -1, 1), "pipeline_parallel_size"),
    ((4, 2, 1, 0), "data_parallel_size"),
    ((4, 2.0, 2, 1), "tensor_parallel_size"),
    ((4, True, 4, 1), "tensor_parallel_size"),
])
def test_invalid_sizes(args, match):
    with pytest.raises(ValueError, match=match):
        rank_layout(*args)


def test_invalid_ep_and_ranks():
    with pytest.raises(ValueError, match="expert_parallel_size 3 must divide"):
        rank_layout(8, 2, 2, 2, 3)
    with pytest.raises(ValueError, match="expert_parallel_size must be a positive int"):
        rank_layout(8, 2, 2, 2, 0)
    layout = rank_layout(4, 2, 2)
    for bad in (-1, 4):
        with pytest.raises(ValueError, match="out of range"):
            layout.coords(bad)
        with pytest.raises(ValueError, match="out of range"):
            layout.group_of("tp", bad)
    with pytest.raises(ValueError, match="tp index 2 out of range"):
        layout.rank_of(0, 0, 2)
    with pytest.raises(ValueError, match="unknown group kind"):
        layout.groups("xx")  # type: ignore[arg-type]
