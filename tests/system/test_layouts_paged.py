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

from kvd import Client
from kvd.client.tensors import TORCH_DTYPES
from kvd.integrations.paged.groups import CHUNKED, FULL, MAMBA, SLIDING, KVGroup
from kvd.integrations.paged.handoff import LoadSpec, PagedKVLayout, PagedKVWorker, SaveSpec, entry_key
from kvd.integrations.paged.plans import SourceDeployment, plan_loads, release_keys
from kvd.parallel import KVLayout, is_primary, shard_layouts

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


# --- hybrid models: every KV cache group into its own blocks, per group resharded -------------------

STATE = 40  # bytes of one Mamba layer's state on one rank (its own slice: no heads to cut)


def hybrid_groups(kind: str, window: int | None) -> tuple[KVGroup, KVGroup]:
    """Layers 0 and 2 of `kind`, 1 and 3 full attention (a Mamba group's block is a whole state)."""
    return (KVGroup(kind, 128 if kind == MAMBA else BLOCK, (names(4)[0], names(4)[2]), window),
            KVGroup(FULL, BLOCK, (names(4)[1], names(4)[3])))


class HybridGrid:
    """One hybrid instance: a PagedKVWorker per TP rank, attention layers its heads of `full`,
    state layers a state of its own (`states[tp_rank]`)."""

    def __init__(self, daemon, full, states, model: KVLayout, tp: int, groups):
        self.layouts = shard_layouts(model, tp, 1)
        self.deployment = SourceDeployment(tp)
        self.workers = {}
        state_layers = {n for g in groups if g.kind == MAMBA for n in g.layers}
        for kv in self.layouts:
            h0, h1 = kv.head_range()
            caches = {n: (states[kv.tp_rank][i] if n in state_layers else full[i][:, h0:h1]).clone()
                      for i, n in enumerate(names(4))}
            layout = PagedKVLayout.from_caches(caches, model="tiny", block_size=BLOCK, kv=kv, head_axis=0,
                                               groups=groups)
            self.workers[kv.tp_rank] = PagedKVWorker(
                caches, layout, load_timeout=10.0,
                connect=lambda: Client(daemon.socket, reply_timeout=5.0, connect_timeout=2.0).connect())

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()


def state_caches(tp: int, seed: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 256, (NUM_BLOCKS, 1, 1, STATE), generator=gen, dtype=torch.uint8) for _ in range(4)]
            for _ in range(tp)]


HYBRID = {  # (kind, window, producer TP, consumer TP)
    "swa-tp2-tp1": (SLIDING, 24, 2, 1),
    "swa-tp1-tp2": (SLIDING, 24, 1, 2),
    "chunked-tp2-tp1": (CHUNKED, 32, 2, 1),
    "chunked-tp1-tp2": (CHUNKED, 32, 1, 2),
    "mamba-tp1-tp1": (MAMBA, None, 1, 1),
    "mamba-tp2-tp2": (MAMBA, None, 2, 2),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pull", [False, True], ids=["push", "pull"])
@pytest.mark.parametrize("case", sorted(HYBRID))
def test_each_group_fills_its_own_blocks_with_what_its_manager_keeps(daemons, case, pull):
    kind, window, stp, dtp = HYBRID[case]
    groups = hybrid_groups(kind, window)
    model = KVLayout(num_layers=4, num_kv_heads=2, head_dim=2 * HEAD_DIM, dtype="float16")
    a, b = daemons.pair(pool_size="128MiB")
    full, consumer_full = full_cache(4, 2, "float16", seed=1), full_cache(4, 2, "float16", seed=2)
    states, consumer_states = state_caches(max(stp, dtp), 3), state_caches(max(stp, dtp), 4)
    producer = HybridGrid(a, full, states, model, stp, groups)
    consumer = HybridGrid(b, consumer_full, consumer_states, model, dtp, groups)
    tokens = 4 * BLOCK + 5  # 5 blocks; a window of 24 keeps blocks 2-4, a chunk of 32 block 4
    kept = [g.kept_blocks(tokens) for g in groups]
    null = 0  # (vLLM's null block: where a window left nothing)
    src = ([7, 3, 12, 20, 5][:kept[0][1]], [8, 9, 10, 11, 13])
    dst = ([null] * kept[0][0] + [1, 2, 14, 15, 23][kept[0][0]:kept[0][1]], [16, 17, 18, 19, 21])
    try:
        for worker in producer.workers.values():
            spec = SaveSpec(req_id="r", request_key="eng:r", block_ids=src, num_tokens=tokens,
                            dest=None if pull else b.listen, first_block=(kept[0][0], 0))
            for name, cache in worker.caches.items():
                if name not in worker.layout.state_layers:  # (the engine runs these layer by layer)
                    worker.save_layer([spec], name, cache)
            assert worker.finish_saves([spec]) == set()
        for worker in consumer.workers.values():  # block 0 of the full group: a local prefix hit
            worker.start_load(LoadSpec(req_id="r", request_key="eng:r", block_ids=dst, num_tokens=tokens,
                                       first_block=(kept[0][0], 1), source=a.listen if pull else None,
                                       producer=producer.deployment))
        deadline = time.monotonic() + 20
        for rank, worker in consumer.workers.items():
            finished, failed = wait_for_load(worker, "r", deadline)
            assert finished == {"r"} and failed == set(), (case, rank)
        for kv in consumer.layouts:
            worker, (h0, h1) = consumer.workers[kv.tp_rank], kv.head_range()
            for g, (group, (first, stop)) in enumerate(zip(groups, kept)):
                first = max(first, g)  # (group 1's block 0 was a local hit)
                for name in group.layers:
                    i = names(4).index(name)
                    cache = worker.caches[name]
                    if group.kind == MAMBA:  # each rank's own state, after the tokens computed
                        want, local = states[kv.tp_rank][i][src[g][first:stop]], consumer_states[kv.tp_rank][i]
                    else:
                        want, local = full[i][src[g][first:stop], h0:h1], consumer_full[i][:, h0:h1]
                    assert torch.equal(bits(cache[dst[g][first:stop]]), bits(want)), (case, kv.tp_rank, name)
                    untouched = [j for j in range(NUM_BLOCKS) if j not in dst[g][first:stop]]
                    assert torch.equal(bits(cache[untouched]), bits(local[untouched])), (case, kv.tp_rank, name)
            stats = worker.take_stats()
            assert set(stats.loaded_by_kind) == {kind, FULL}
            assert stats.loaded_bytes == sum(stats.loaded_by_kind.values())
        ranks = release_keys(model.with_shard(0, dtp, 0, 1), producer.deployment)
        with b.client() as client:
            for t, p in ranks:
                client.delete(entry_key("eng:r", t, p))
            assert client.stats()["entries"] == 0
        assert held(a) == set()
    finally:
        producer.close()
        consumer.close()


def test_a_group_the_producer_keeps_otherwise_refuses_the_whole_load(daemons, caplog):
    """The producer's sliding window is not the consumer's: the load is refused before a byte of
    either group is written (the full-attention group's blocks would have fitted)."""
    model = KVLayout(num_layers=4, num_kv_heads=2, head_dim=2 * HEAD_DIM, dtype="float16")
    a, b = daemons.pair()
    full, consumer_full = full_cache(4, 2, "float16", seed=1), full_cache(4, 2, "float16", seed=2)
    producer = HybridGrid(a, full, [], model, 1, hybrid_groups(SLIDING, 32))
    consumer = HybridGrid(b, consumer_full, [], model, 1, hybrid_groups(SLIDING, 24))
    tokens = 4 * BLOCK + 5
    try:
        worker = producer.workers[0]
        spec = SaveSpec(req_id="r", request_key="eng:r", block_ids=([7, 3, 12, 20, 5], [8, 9, 10, 11, 13]),
                        num_tokens=tokens, dest=b.listen, first_block=(1, 0))
        for name, cache in worker.caches.items():
            worker.save_layer([spec], name, cache)
        assert worker.finish_saves([spec]) == set()
        mine = consumer.workers[0]
        mine.start_load(LoadSpec(req_id="r", request_key="eng:r", block_ids=([0, 0, 14, 15, 23], [16, 17, 18, 19, 21]),
                                 num_tokens=tokens, first_block=(2, 0)))
        _finished, failed = wait_for_load(mine, "r", time.monotonic() + 10)
        assert failed == {"r"}
        message = " ".join(r.getMessage() for r in caplog.records)
        assert "LayoutMismatch" in message and "sliding_window(32)" in message, message
        for i, name in enumerate(names(4)):
            assert torch.equal(bits(mine.caches[name]), bits(consumer_full[i])), name
    finally:
        producer.close()
        consumer.close()
