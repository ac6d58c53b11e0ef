"""The paged KV mapping across parallel layouts, with real daemons (tier 1, no engine): a grid of
producer ranks (any TP x PP) saves a request's blocks, a grid of consumer ranks (another TP x PP)
loads them, and every consumer rank's cache must equal its slice of one full reference cache, bit
for bit. Then the shards are released as the connector's scheduler side does once every rank has
reported, and no entry may be left on either daemon (nothing waits for its TTL).

These also cover the engine combinations that cannot run on a 2-core machine (TP 4 and 8 engines,
TP x PP grids): the workers here are the same `PagedKVWorker` the vLLM connector runs in each
engine worker process, fed the layouts the connector derives from vLLM's config."""
from __future__ import annotations

import time

import pytest
import torch

from kvd.client.tensors import TORCH_DTYPES
from kvd.integrations.paged_kv import LoadSpec, PagedKVLayout, PagedKVWorker, SaveSpec, entry_key
from kvd.integrations.paged_layout import SourceDeployment, plan_loads, release_keys
from kvd.parallel import KVLayout, is_primary, shard_layouts
from kvd import Client

BLOCK = 16
HEAD_DIM = 8
NUM_BLOCKS = 24


def names(num_layers: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


def full_cache(num_layers: int, heads: int | None, dtype: str, seed: int) -> list[torch.Tensor]:
    """The reference: every layer's whole paged cache [blocks, heads, block, 2*head_dim] (K and V side
    by side, as vLLM's CPU backend stores them), or [blocks, block, latent] without heads (MLA)."""
    torch_dtype = TORCH_DTYPES[dtype]
    shape = (NUM_BLOCKS, BLOCK, 2 * HEAD_DIM) if heads is None else (NUM_BLOCKS, heads, BLOCK, 2 * HEAD_DIM)
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (*shape, torch_dtype.itemsize), generator=gen, dtype=torch.uint8)
            .view(torch_dtype).reshape(shape) for _ in range(num_layers)]


def rank_caches(full: list[torch.Tensor], kv: KVLayout, mla: bool) -> dict[str, torch.Tensor]:
    (l0, l1), (h0, h1) = kv.layer_range(), kv.head_range()
    layer_names = names(kv.num_layers)
    return {layer_names[i]: (full[i].clone() if mla else full[i][:, h0:h1].clone()) for i in range(l0, l1)}


class Grid:
    """One instance: a PagedKVWorker per (tp, pp) rank, each with its slice of `full`."""

    def __init__(self, daemon, full, model: KVLayout, tp: int, pp: int, partition: str | None, mla: bool):
        self.layouts = shard_layouts(model, tp, pp, partition)
        self.deployment = SourceDeployment(tp, pp, partition)
        self.workers = {}
        for kv in self.layouts:
            caches = rank_caches(full, kv, mla)
            layout = PagedKVLayout.from_caches(caches, model="tiny", block_size=BLOCK, kv=kv,
                                               head_axis=None if mla else 0)
            self.workers[kv.tp_rank, kv.pp_rank] = PagedKVWorker(
                caches, layout, load_timeout=10.0,
                connect=lambda: Client(daemon.socket, reply_timeout=5.0, connect_timeout=2.0).connect())

    def save(self, spec: SaveSpec) -> None:
        for worker in self.workers.values():  # each stage runs only its own layers
            for name in worker.caches:
                worker.save_layer([spec], name, worker.caches[name])
            assert worker.finish_saves() == set()

    def load(self, spec: LoadSpec, timeout: float = 20.0) -> None:
        for worker in self.workers.values():  # all at once: shared shards are read concurrently
            worker.start_load(spec)
        deadline = time.monotonic() + timeout
        for rank, worker in self.workers.items():
            finished, failed = wait_for_load(worker, spec.req_id, deadline)
            assert finished == {spec.req_id} and failed == set(), (rank, finished, failed)

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()


def wait_for_load(worker: PagedKVWorker, req_id: str, deadline: float) -> tuple[set[str], set[str]]:
    """Poll a worker until its load of req_id ended or the deadline passed: (finished, failed)."""
    finished, failed = set(), set()
    while req_id not in finished and time.monotonic() < deadline:
        results = worker.poll()
        finished |= results.finished_loads
        failed |= results.failed_loads
        time.sleep(0.005)
    return finished, failed


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def held(daemon) -> set[str]:
    with daemon.client() as client:
        return {e["request_id"] for e in client.list()}


# (KV heads or None for an MLA latent, layers, (tp, pp, partition) of the producer, of the consumer)
CASES = {
    "tp1-tp2": (8, 4, (1, 1, None), (2, 1, None)),
    "tp2-tp1": (8, 4, (2, 1, None), (1, 1, None)),
    "tp2-tp8": (8, 4, (2, 1, None), (8, 1, None)),
    "tp8-tp2": (8, 4, (8, 1, None), (2, 1, None)),
    "gqa2-tp1-tp4": (2, 4, (1, 1, None), (4, 1, None)),  # decode replicates each head on two ranks
    "gqa2-tp4-tp1": (2, 4, (4, 1, None), (1, 1, None)),  # replicas saved once: ranks 0 and 2 only
    "gqa2-tp4-tp2": (2, 4, (4, 1, None), (2, 1, None)),
    "mqa-tp2-tp4": (1, 4, (2, 1, None), (4, 1, None)),
    "gqa8-tp16-tp4": (8, 2, (16, 1, None), (4, 1, None)),  # 8 KV heads at TP 16: two replicas each
    "pp2-pp1": (2, 5, (1, 2, None), (1, 1, None)),  # vLLM's split of 5 layers: 3, 2
    "pp1-pp2-uneven": (2, 5, (1, 1, None), (1, 2, "1,4")),
    "tp2pp2-tp4pp1": (2, 6, (2, 2, None), (4, 1, None)),
    "tp1pp3-tp2pp2": (8, 7, (1, 3, "2,2,3"), (2, 2, "5,2")),
    "mla-tp2-tp4": (None, 4, (2, 1, None), (4, 1, None)),  # one latent on every rank: one shard suffices
    "mla-pp2tp2-tp1": (None, 4, (2, 2, None), (1, 1, None)),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pull", [False, True], ids=["push", "pull"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_consumer_rank_gets_exactly_its_slice_and_no_shard_is_left(daemons, case, pull):
    heads, num_layers, (stp, spp, spart), (dtp, dpp, dpart) = CASES[case]
    mla = heads is None
    dtype = "bfloat16" if "tp2-tp1" in case else "float16"
    model = KVLayout(num_layers=num_layers, num_kv_heads=heads or 1, head_dim=2 * HEAD_DIM, dtype=dtype)
    a, b = daemons.pair(pool_size="128MiB")
    full = full_cache(num_layers, heads, dtype, seed=1)
    producer = Grid(a, full, model, stp, spp, spart, mla)
    consumer_full = full_cache(num_layers, heads, dtype, seed=2)
    consumer = Grid(b, consumer_full, model, dtp, dpp, dpart, mla)
    try:
        src_ids, dst_ids = [7, 3, 12, 20, 5], [1, 2, 9, 15, 23]
        tokens, first = 4 * BLOCK + 5, 1  # the last block partly filled; block 0 a local prefix hit
        producer.save(SaveSpec("r", "eng:r", src_ids, tokens, dest=None if pull else b.listen))
        store = a if pull else b
        primaries = {entry_key("eng:r", s.tp_rank, s.pp_rank) for s in producer.layouts if is_primary(s)}
        assert held(store) == primaries and held(b if pull else a) == set()
        if mla:
            assert primaries == {entry_key("eng:r", 0, p) for p in range(spp)}

        consumer.load(LoadSpec("r", "eng:r", dst_ids, tokens, first_block=first,
                               source=a.listen if pull else None, producer=producer.deployment))
        for kv in consumer.layouts:
            caches = consumer.workers[kv.tp_rank, kv.pp_rank].caches
            (l0, l1), (h0, h1) = kv.layer_range(), kv.head_range()
            for i in range(l0, l1):
                cache, name = caches[names(num_layers)[i]], names(num_layers)[i]
                want = full[i][src_ids[first:]] if mla else full[i][src_ids[first:], h0:h1]
                assert torch.equal(bits(cache[dst_ids[first:]]), bits(want)), (case, kv, name)
                untouched = [j for j in range(NUM_BLOCKS) if j not in dst_ids[first:]]
                local = consumer_full[i] if mla else consumer_full[i][:, h0:h1]
                assert torch.equal(bits(cache[untouched]), bits(local[untouched])), (case, kv, name)

        # a shard one rank reads went with that read (pulled ones left the producer's daemon);
        # the shared ones wait here for the release
        plans = {kv: plan_loads(consumer.workers[kv.tp_rank, kv.pp_rank].layout, producer.deployment)
                 for kv in consumer.layouts}
        shared = {entry_key("eng:r", r.src.tp_rank, r.src.pp_rank) for reads in plans.values()
                  for r in reads if r.readers > 1}
        assert held(a) == set() and held(b) == shared
        ranks = release_keys(model.with_shard(0, dtp, 0, dpp, dpart), producer.deployment)
        assert {entry_key("eng:r", t, p) for t, p in ranks} == primaries
        with b.client() as client:
            for t, p in ranks:
                client.delete(entry_key("eng:r", t, p))
            assert client.stats()["entries"] == 0 and client.stats()["pool"]["used_bytes"] == 0
    finally:
        producer.close()
        consumer.close()


def test_one_shard_refused_means_nothing_is_written_by_that_rank(daemons, caplog):
    """Prefill TP 2 -> decode TP 1: rank 0 needs both shards; the second is of another model (its
    head_dim differs), so the load is refused and the first shard's heads are not written either."""
    model = KVLayout(num_layers=2, num_kv_heads=2, head_dim=2 * HEAD_DIM, dtype="float16")
    a, b = daemons.pair()
    full = full_cache(2, 2, "float16", seed=1)
    producer = Grid(a, full, model, 2, 1, None, False)
    consumer_full = full_cache(2, 2, "float16", seed=2)
    consumer = Grid(b, consumer_full, model, 1, 1, None, False)
    try:
        spec = SaveSpec("r", "eng:r", [1, 2], 2 * BLOCK, dest=b.listen)
        for name in names(2):
            producer.workers[0, 0].save_layer([spec], name, producer.workers[0, 0].caches[name])
        assert producer.workers[0, 0].finish_saves() == set()
        other = {n: torch.zeros(NUM_BLOCKS, 1, BLOCK, 4 * HEAD_DIM, dtype=torch.float16) for n in names(2)}
        other_kv = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4 * HEAD_DIM, dtype="float16", tp_rank=1, tp_size=2)
        liar = PagedKVWorker(other, PagedKVLayout.from_caches(other, model="tiny", block_size=BLOCK, kv=other_kv),
                             connect=lambda: Client(a.socket).connect())
        for name in names(2):
            liar.save_layer([spec], name, other[name])
        assert liar.finish_saves() == set()
        liar.close()
        worker = consumer.workers[0, 0]
        worker.start_load(LoadSpec("r", "eng:r", [5, 6], 2 * BLOCK, producer=producer.deployment))
        deadline = time.monotonic() + 10
        failed = set()
        while not failed and time.monotonic() < deadline:
            failed |= worker.poll().failed_loads
            time.sleep(0.01)
        assert failed == {"r"}
        message = " ".join(r.getMessage() for r in caplog.records)
        assert "LayoutMismatch" in message and "head_dim" in message and "eng:r@tp1.pp0" in message
        for i, name in enumerate(names(2)):
            assert torch.equal(bits(worker.caches[name]), bits(consumer_full[i]))
        with b.client() as client:  # refused shards stay readable for the release (none consumed)
            assert {e["request_id"] for e in client.list()} == {"eng:r@tp0.pp0", "eng:r@tp1.pp0"}
    finally:
        producer.close()
        consumer.close()
