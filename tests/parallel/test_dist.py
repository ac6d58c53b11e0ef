"""kvd.parallel.state over real multi-process torch.distributed (gloo on loopback).

One start per world size (2, 4, 8), and each rank runs every check for several TP/PP/DP/EP
layouts in one go. Ranks are started with the "forkserver" method: like "spawn" they share
nothing with pytest's process, but they fork from a server that imported torch once, instead
of paying torch's import (seconds on a small machine) in each of the 14 ranks. A failing rank
raises; torch.multiprocessing then kills the others and re-raises here with its traceback.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kvd.parallel as par
from kvd.parallel import ParallelState, ParallelStateError, rank_layout
from kvd.testing.daemons import free_port

pytestmark = pytest.mark.timeout(180)

# (tp, pp, dp, ep) per world size; ep None = dp * tp, vLLM's expert-parallel layout
CONFIGS: dict[int, list[tuple[int, int, int, int | None]]] = {
    1: [(1, 1, 1, 1)],
    2: [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, None)],
    4: [(4, 1, 1, 1), (2, 2, 1, 1), (2, 1, 2, None), (1, 2, 2, 2)],
    8: [(8, 1, 1, 1), (2, 2, 2, None), (4, 2, 1, 2), (2, 1, 4, 4)],
}
GETTERS = {
    "tp": (par.get_tp_group, par.get_tp_rank, par.get_tp_world_size),
    "pp": (par.get_pp_group, par.get_pp_rank, par.get_pp_world_size),
    "dp": (par.get_dp_group, par.get_dp_rank, par.get_dp_world_size),
    "ep": (par.get_ep_group, par.get_ep_rank, par.get_ep_world_size),
}


def sample(rank: int) -> torch.Tensor:
    """A tensor every rank can rebuild for any other rank."""
    return torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + 100 * rank


def check_unusable() -> None:
    """Everything that needs a state raises while none is installed."""
    assert not par.is_initialized()
    for getters in GETTERS.values():
        for get in getters:
            with pytest.raises(ParallelStateError, match="not initialized"):
                get()
    with pytest.raises(ParallelStateError, match="not initialized"):
        par.tensor_model_parallel_all_reduce(torch.ones(1))
    with pytest.raises(ParallelStateError, match=r"before ParallelState.initialize"):
        _ = ParallelState().tp


def check_groups(state: ParallelState, rank: int, world: int, tp: int, pp: int, dp: int, ep: int | None) -> None:
    layout = rank_layout(world, tp, pp, dp, ep)
    assert state.layout == layout
    for kind, (get_group, get_rank, get_size) in GETTERS.items():
        group = get_group()
        expected = layout.group_of(kind, rank)
        assert group is state.group(kind) and group.kind == kind
        assert group.ranks == expected
        assert get_rank() == group.rank_in_group == expected.index(rank)
        assert get_size() == group.world_size == len(expected)
        assert dist.get_process_group_ranks(group.process_group) == list(expected)
        assert dist.get_rank(group.process_group) == group.rank_in_group
        # the process group really spans those ranks
        total = group.all_reduce(torch.tensor([float(rank)]))
        assert total.item() == sum(expected)


def check_tp_collectives(rank: int) -> None:
    group = par.get_tp_group()
    ranks, me = group.ranks, group.rank_in_group
    x = sample(rank)
    reduced = par.tensor_model_parallel_all_reduce(x)
    assert torch.equal(reduced, sum(sample(r) for r in ranks))
    assert torch.equal(x, sample(rank))  # input untouched
    for dim in (0, 1, 2, -1, -2, -3):
        gathered = par.tensor_model_parallel_all_gather(x, dim=dim)
        assert torch.equal(gathered, torch.cat([sample(r) for r in ranks], dim=dim)), dim
    # non-contiguous input
    gathered = par.tensor_model_parallel_all_gather(x.transpose(0, 2), dim=-2)
    assert torch.equal(gathered, torch.cat([sample(r).transpose(0, 2) for r in ranks], dim=-2))
    for src in range(len(ranks)):
        y = sample(rank)
        out = par.tensor_model_parallel_broadcast(y, src=src)
        assert out is y and torch.equal(y, sample(ranks[src]))
    for dst in range(len(ranks)):
        for dim in (0, -1):
            out = par.tensor_model_parallel_gather(x, dst=dst, dim=dim)
            if me == dst:
                assert torch.equal(out, torch.cat([sample(r) for r in ranks], dim=dim))
            else:
                assert out is None
    with pytest.raises(ValueError, match="outside the tp group"):
        par.tensor_model_parallel_broadcast(x, src=len(ranks))
    with pytest.raises(ValueError, match="dim 3 out of range"):
        par.tensor_model_parallel_all_gather(x, dim=3)


def check_lifecycle(rank: int, world: int) -> None:
    state = ParallelState()
    state.initialize(tensor_parallel_size=world)
    with pytest.raises(ParallelStateError, match="already initialized"):
        state.initialize(tensor_parallel_size=world)
    with pytest.raises(ParallelStateError, match="already initialized in this process"):
        ParallelState().initialize(tensor_parallel_size=world)
    par.destroy_parallel_state()
    par.destroy_parallel_state()  # idempotent
    assert state.layout is None
    check_unusable()
    # invalid sizes fail identically on every rank before any group exists
    with pytest.raises(ValueError, match="not divisible"):
        ParallelState().initialize(tensor_parallel_size=world + 1)
    with pytest.raises(ValueError, match=r"!= tp \* pp \* dp"):
        ParallelState().initialize(tensor_parallel_size=1, data_parallel_size=world + 1)
    assert not par.is_initialized()


def run_rank(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)  # 8 ranks on 2 cores: no intra-op thread pool each
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback even where the hostname does not resolve
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        check_unusable()
        for tp, pp, dp, ep in CONFIGS[world]:
            state = ParallelState()
            state.initialize(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                             expert_parallel_size=ep)
            assert par.is_initialized() and par.current_state() is state
            check_groups(state, rank, world, tp, pp, dp, ep)
            check_tp_collectives(rank)
            state.destroy()
            check_unusable()
        check_lifecycle(rank, world)
        dist.barrier()
    finally:
        par.destroy_parallel_state()
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_parallel_state_multiprocess(world):
    # ignored if this pytest process already started its forkserver: slower, still correct
    preload = ["torch", "torch.distributed", "pytest", "kvd.parallel"]
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    mp.start_processes(run_rank, args=(world, free_port()), nprocs=world, join=True, start_method="forkserver")


def test_single_process_world(monkeypatch):
    """World size 1 in this process: the no-communication paths return the input itself."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))  # run_rank sets it
    assert not dist.is_initialized()
    run_rank(0, 1, free_port())
    assert not dist.is_initialized()


def test_requires_torch_distributed():
    assert not dist.is_initialized()
    with pytest.raises(ParallelStateError, match=r"torch.distributed is not initialized"):
        ParallelState().initialize(tensor_parallel_size=1)
    assert not par.is_initialized()
