"""The engine-agnostic side of the vLLM connector (tier 1: CPU torch and real daemons, no vLLM):
paged blocks saved layer by layer and loaded into another worker's blocks, the handshake, the errors."""
from __future__ import annotations

import time

import pytest
import torch

from kvd import Client
from kvd.client.tensors import DTYPE_NAMES
from kvd.errors import BadRequest
from kvd.integrations.paged.handoff import (
    LoadSpec,
    PagedKVLayout,
    PagedKVWorker,
    SaveSpec,
    SourceDeployment,
    blocks_for,
    entry_key,
)
from kvd.integrations.transfer_params import ConnectorSettings, dest_for_prefill, params_for_decode, params_for_decoder

BLOCK = 16
LAYERS = ("model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn")


def paged_caches(num_blocks: int = 40, dtype=torch.float16, block_shape=(2, BLOCK, 8), seed: int = 0):
    """Per-layer paged caches [num_blocks, *block_shape] (any block-first layout) filled with random bits."""
    gen = torch.Generator().manual_seed(seed)
    caches = {}
    for name in LAYERS:
        raw = torch.randint(0, 256, (num_blocks, *block_shape, dtype.itemsize), generator=gen, dtype=torch.uint8)
        caches[name] = raw.view(dtype).reshape(num_blocks, *block_shape)
    return caches


_workers: list[PagedKVWorker] = []


@pytest.fixture(autouse=True)
def close_workers():
    """Every worker a test made is closed after it (its clients with it)."""
    yield
    while _workers:
        _workers.pop().close()


def worker(daemon, caches, *, model="tiny", block_size=BLOCK, tp_size=1, load_timeout=10.0) -> PagedKVWorker:
    layout = PagedKVLayout.from_caches(caches, model=model, block_size=block_size, tp_size=tp_size)
    made = PagedKVWorker(caches, layout, load_timeout=load_timeout,
                         connect=lambda: Client(daemon.socket, reply_timeout=2.0, connect_timeout=1.0).connect())
    _workers.append(made)
    return made


def save(producer: PagedKVWorker, specs: list[SaveSpec]) -> set[str]:
    """What the engine does during a forward: each layer saved once it is computed, then commit."""
    for name in LAYERS:
        producer.save_layer(specs, name, producer.caches[name])
    return producer.finish_saves()


def wait_results(consumer: PagedKVWorker, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    finished, failed, blocks = set(), set(), set()
    while consumer.pending_loads() and time.monotonic() < deadline:
        time.sleep(0.01)
        results = consumer.poll()
        finished |= results.finished_loads
        failed |= results.failed_loads
        blocks |= results.failed_blocks
    results = consumer.poll()
    return finished | results.finished_loads, failed | results.failed_loads, blocks | results.failed_blocks


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", list(DTYPE_NAMES), ids=lambda d: str(d).removeprefix("torch."))
def test_blocks_cross_two_daemons_bit_exact_into_other_block_ids(daemons, dtype):
    a, b = daemons.pair()
    producer = worker(a, paged_caches(dtype=dtype, seed=1))
    consumer_caches = paged_caches(dtype=dtype, seed=2)
    before = {name: c.clone() for name, c in consumer_caches.items()}
    consumer = worker(b, consumer_caches)
    src_ids, dst_ids = [7, 3, 12, 30, 5], [1, 2, 9, 20, 33]
    tokens = 4 * BLOCK + 5  # 5 blocks, the last one partial
    assert save(producer, [SaveSpec("r1", "eng:r1", src_ids, tokens, dest=b.listen)]) == set()
    consumer.start_load(LoadSpec("r1", "eng:r1", dst_ids, tokens))
    finished, failed, _ = wait_results(consumer)
    assert (finished, failed) == ({"r1"}, set())
    for name in LAYERS:
        assert torch.equal(bits(consumer_caches[name][dst_ids]), bits(producer.caches[name][src_ids]))
        untouched = [i for i in range(len(consumer_caches[name])) if i not in dst_ids]
        assert torch.equal(bits(consumer_caches[name][untouched]), bits(before[name][untouched]))
    with b.client() as client:
        assert client.stats()["entries"] == 0  # the load consumed the entry
    block_bytes = producer.caches[LAYERS[0]][0].numel() * dtype.itemsize
    saved, loaded = producer.take_stats(), consumer.take_stats()
    assert (saved.saves, saved.save_failures, saved.saved_bytes) == (1, 0, 5 * len(LAYERS) * block_bytes)
    assert (loaded.loads, loaded.load_failures, loaded.loaded_bytes) == (1, 0, 5 * len(LAYERS) * block_bytes)
    assert len(loaded.load_seconds) == 1 and consumer.take_stats().empty()
    # one step saved: its time in kvd is counted once, and the consumer's steps saved nothing
    assert len(saved.save_seconds) == 1 and 0 < saved.save_seconds[0] < 30 and loaded.save_seconds == []


def test_pull_from_the_producers_daemon_and_skip_a_locally_cached_prefix(daemons):
    a, b = daemons.pair()
    producer = worker(a, paged_caches(seed=1))
    consumer_caches = paged_caches(seed=2)
    before = {name: c.clone() for name, c in consumer_caches.items()}
    consumer = worker(b, consumer_caches)
    assert save(producer, [SaveSpec("r", "eng:r", [0, 1, 2, 3], 4 * BLOCK)]) == set()  # stays on A
    # blocks 0-1 are a local prefix-cache hit: only blocks 2-3 are filled
    consumer.start_load(LoadSpec("r", "eng:r", [10, 11, 12, 13], 4 * BLOCK, first_block=2, source=a.listen))
    finished, failed, _ = wait_results(consumer)
    assert (finished, failed) == ({"r"}, set())
    for name in LAYERS:
        assert torch.equal(bits(consumer_caches[name][[12, 13]]), bits(producer.caches[name][[2, 3]]))
        assert torch.equal(bits(consumer_caches[name][[10, 11]]), bits(before[name][[10, 11]]))
    with a.client() as client:
        assert client.stats()["entries"] == 0


def test_many_requests_in_one_step_each_get_their_own_blocks(daemons):
    a, b = daemons.pair()
    producer = worker(a, paged_caches(seed=3))
    consumer_caches = paged_caches(seed=4)
    consumer = worker(b, consumer_caches)
    specs = [SaveSpec(f"r{i}", f"eng:r{i}", [i * 3, i * 3 + 1, i * 3 + 2], 3 * BLOCK - i, dest=b.listen)
             for i in range(8)]
    assert save(producer, specs) == set()
    for i, spec in enumerate(specs):
        consumer.start_load(LoadSpec(spec.req_id, spec.request_key, [39 - i * 3, 38 - i * 3, 37 - i * 3],
                                     spec.num_tokens))
    finished, failed, _ = wait_results(consumer)
    assert finished == {s.req_id for s in specs} and failed == set()
    for i in range(8):
        for name in LAYERS:
            assert torch.equal(bits(consumer_caches[name][[39 - i * 3, 38 - i * 3, 37 - i * 3]]),
                               bits(producer.caches[name][[i * 3, i * 3 + 1, i * 3 + 2]]))


@pytest.mark.parametrize("change, expected", [
    ({"model": "other-model"}, "model"),
    ({"block_size": 32}, "block_size"),
    ({"tp_size": 2}, "num_kv_heads"),  # a TP-2 rank holding 2 heads: a model of 4 KV heads
    ({"block_shape": (2, BLOCK, 16)}, "head_dim"),
    ({"dtype": torch.bfloat16}, "dtype"),
    ({"src": SourceDeployment(tp_size=2)}, "tp_size"),  # the handshake names another deployment
    ({"src": SourceDeployment(tp_size=3)}, "tp_size"),  # 2 KV heads cannot be split over TP 3
])
def test_a_mismatched_layout_is_refused_and_the_cache_left_untouched(daemons, change, expected, caplog):
    a, b = daemons.pair()
    producer = worker(a, paged_caches(seed=1))
    consumer_caches = paged_caches(block_shape=change.get("block_shape", (2, BLOCK, 8)),
                                   dtype=change.get("dtype", torch.float16), seed=2)
    before = {name: c.clone() for name, c in consumer_caches.items()}
    consumer = worker(b, consumer_caches, model=change.get("model", "tiny"),
                      block_size=change.get("block_size", BLOCK), tp_size=change.get("tp_size", 1))
    tokens = 3 * change.get("block_size", BLOCK) if "block_size" in change else 3 * BLOCK
    assert save(producer, [SaveSpec("r", "eng:r", [4, 5, 6], 3 * BLOCK, dest=b.listen)]) == set()
    consumer.start_load(LoadSpec("r", "eng:r", [1, 2, 3], min(tokens, 3 * BLOCK),
                                 producer=change.get("src", SourceDeployment())))
    finished, failed, blocks = wait_results(consumer)
    assert finished == {"r"} and failed == {"r"} and blocks == {1, 2, 3}
    [message] = [r.getMessage() for r in caplog.records if "loading the KV" in r.getMessage()]
    assert "LayoutMismatch" in message and expected in message, message
    for name in LAYERS:
        assert torch.equal(bits(consumer_caches[name]), bits(before[name]))


def test_a_missing_entry_fails_the_load_after_the_timeout(daemon):
    consumer = worker(daemon, paged_caches(), load_timeout=0.3)
    consumer.start_load(LoadSpec("r", "nobody:r", [1, 2], 2 * BLOCK))
    finished, failed, blocks = wait_results(consumer)
    assert finished == failed == {"r"} and blocks == {1, 2}
    stats = consumer.take_stats()
    assert (stats.loads, stats.load_failures) == (0, 1)


def test_a_save_missing_a_layer_is_never_published(daemons):
    a, b = daemons.pair()
    producer = worker(a, paged_caches())
    spec = SaveSpec("r", "eng:r", [1, 2], 2 * BLOCK, dest=b.listen)
    producer.save_layer([spec], LAYERS[0], producer.caches[LAYERS[0]])  # the forward died after layer 0
    assert producer.finish_saves() == {"r"}
    consumer = worker(b, paged_caches(), load_timeout=0.5)
    consumer.start_load(LoadSpec("r", "eng:r", [1, 2], 2 * BLOCK))
    assert wait_results(consumer)[1] == {"r"}
    for d in (a, b):
        with d.client() as client:
            assert client.stats()["entries"] == 0 and client.stats()["pool"]["used_bytes"] == 0
    # the worker goes on: the next request's save works
    assert save(producer, [SaveSpec("r2", "eng:r2", [3], BLOCK)]) == set()


def test_a_save_with_the_wrong_block_count_fails_alone(daemon):
    producer = worker(daemon, paged_caches())
    good, bad = SaveSpec("ok", "e:ok", [1, 2], 2 * BLOCK), SaveSpec("bad", "e:bad", [1], 5 * BLOCK)
    assert save(producer, [bad, good]) == {"bad"}
    with daemon.client() as client:
        assert [e["request_id"] for e in client.list()] == [entry_key("e:ok", 0)]
    assert entry_key("e:ok", 0) == "e:ok@tp0.pp0" and entry_key("e:ok", 1, 2) == "e:ok@tp1.pp2"


def test_a_dead_daemon_fails_saves_fast_and_loads_without_raising(daemon):
    producer = worker(daemon, paged_caches(), load_timeout=0.5)
    daemon.kill()
    started = time.monotonic()
    assert save(producer, [SaveSpec("r", "e:r", [1], BLOCK)]) == {"r"}
    first = time.monotonic() - started
    started = time.monotonic()
    assert save(producer, [SaveSpec("r2", "e:r2", [1], BLOCK)]) == {"r2"}  # within retry_after: no wait
    assert first < 6.0 and time.monotonic() - started < 0.2
    producer.start_load(LoadSpec("x", "e:x", [2], BLOCK))
    assert wait_results(producer)[1] == {"x"}


def test_layout_wire_round_trip_and_bad_input():
    layout = PagedKVLayout.from_caches(paged_caches(), model="m", block_size=BLOCK, tp_size=2, tp_rank=1)
    assert PagedKVLayout.from_wire(layout.to_wire()) == layout
    wire = layout.to_wire()  # the meta names the shard: TP/PP, layer range, head range, block shapes
    assert (wire["kv"]["tp_size"], wire["kv"]["tp_rank"], wire["kv"]["pp_size"]) == (2, 1, 1)
    assert wire["layer_range"] == [0, 3] and wire["head_range"] == [2, 4]
    assert wire["layers"][0] == [LAYERS[0], [2, BLOCK, 8], "float16"]
    for bad in (None, {}, {"model": "m"}, {**wire, "layers": [[1]]}, {**wire, "head_range": [0, 2]},
                {**wire, "kv": {**wire["kv"], "tp_rank": 5}}):
        with pytest.raises(BadRequest):
            PagedKVLayout.from_wire(bad)
    with pytest.raises(BadRequest):
        PagedKVLayout.from_caches({}, model="m", block_size=BLOCK)
    with pytest.raises(BadRequest):
        PagedKVLayout.from_caches({"x": torch.zeros(4, dtype=torch.complex64)}, model="m", block_size=BLOCK)


def test_block_math():
    assert [blocks_for(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_handshake_params():
    spec = SaveSpec("r", "eng:r", [1, 2], 20, dest="tcp://10.0.0.2:7470")
    prefill = SourceDeployment(tp_size=2, pp_size=2, pp_partition="3,1")
    params = params_for_decoder(spec, "tcp://10.0.0.1:7470", "eng", prefill)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["kvd_layout"] == {"tp_size": 2, "pp_size": 2, "pp_partition": "3,1"}
    wanted = params_for_decode(params)
    assert (wanted.request_key, wanted.num_tokens, wanted.source, wanted.producer) == ("eng:r", 20, None, prefill)
    pulled = params_for_decoder(SaveSpec("r", "eng:r", [1, 2], 20), "tcp://10.0.0.1:7470", "eng")
    wanted = params_for_decode(pulled)
    assert (wanted.source, wanted.producer) == ("tcp://10.0.0.1:7470", SourceDeployment())
    assert params_for_decode(None) is None
    assert params_for_decode({"do_remote_prefill": True, "remote_block_ids": [1]}) is None  # NIXL's, not ours
    for bad in ({"kvd_request_id": 5}, {"kvd_num_tokens": "20"}, {"kvd_num_tokens": -1}, {"kvd_request_id": ""},
                {"kvd_pushed": False, "kvd_source": 7}, {"kvd_layout": None}, {"kvd_layout": {"tp_size": 0}},
                {"kvd_layout": {"tp_size": 2, "pp_size": True}}, {"kvd_layout": {"tp_size": 1, "pp_partition": 4}}):
        with pytest.raises(ValueError):
            params_for_decode({**params, **bad})
    assert dest_for_prefill({"kvd_dest": "B"}, None) == "B"
    assert dest_for_prefill({}, "tcp://x:1") == "tcp://x:1"
    assert dest_for_prefill(None, None) is None
    with pytest.raises(ValueError):
        dest_for_prefill({"kvd_dest": 3}, None)


def test_connector_settings():
    assert ConnectorSettings.from_extra(None) == ConnectorSettings()
    s = ConnectorSettings.from_extra({"kvd_socket": "ipc:///x", "kvd_ttl": 10, "kvd_load_threads": 2, "other": 1})
    assert (s.socket, s.ttl, s.load_threads) == ("ipc:///x", 10.0, 2)
    for bad in ({"kvd_sockt": "x"}, {"kvd_ttl": 0}, {"kvd_load_threads": 0}, {"kvd_socket": 5}):
        with pytest.raises(ValueError):
            ConnectorSettings.from_extra(bad)


def test_kvd_and_the_engine_agnostic_parts_import_without_vllm():
    import subprocess
    import sys

    code = ("import sys; sys.modules['vllm'] = None\n"  # any `import vllm` now raises ImportError
            "import kvd, kvd.integrations, kvd.integrations.paged.handoff, kvd.integrations.transfer_params\n"
            "import kvd.integrations.paged.plans\n"
            "try:\n    import kvd.integrations.vllm\nexcept ImportError:\n    print('vllm-less')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "vllm-less"


def test_saves_resume_once_a_restarted_daemon_is_back(daemons):
    first = daemons.start("P")
    where = {"socket": first.socket}
    layout = PagedKVLayout.from_caches(paged_caches(), model="tiny", block_size=BLOCK)
    producer = PagedKVWorker(paged_caches(), layout, retry_after=0.5,
                             connect=lambda: Client(where["socket"], reply_timeout=2.0, connect_timeout=1.0).connect())
    _workers.append(producer)
    assert save(producer, [SaveSpec("r1", "e:r1", [1], BLOCK)]) == set()
    first.kill()
    assert save(producer, [SaveSpec("r2", "e:r2", [1], BLOCK)]) == {"r2"}
    second = daemons.start("P")  # the daemon comes back (systemd restarts it)
    where["socket"] = second.socket
    time.sleep(0.6)  # retry_after
    assert save(producer, [SaveSpec("r3", "e:r3", [2], BLOCK)]) == set()
    with second.client() as client:
        assert [e["request_id"] for e in client.list()] == [entry_key("e:r3", 0)]
