"""SGLang's HiCache L3 on kvd's KV tier, on real daemons: the backend built by SGLang's own factory
and driven in SGLang's call patterns (HiCacheController, sglang 0.5.23): backup through
batch_set_v1 in batches of STORAGE_BATCH_SIZE pages, prefetch through batch_exists then
batch_get_v1, with SGLang's own page keys (get_storage_hash_str). Every page bit-exact in every
layout and dtype; a second instance hits the first's pages; the generic path; a daemon that dies
or is full answers misses and Falses.

The host pool is kvd.testing.sglang_pool.MHAHostPool: SGLang's own MHATokenToKVPoolHost
cannot be imported with the CPU torch (its module imports torchvision; see kvd/testing/sglang_pool.py).
test_the_real_sglang_host_pools (slow) runs the cycle on SGLang's own classes and checks that
MHAHostPool pages equal theirs."""
from __future__ import annotations

import os
import signal
import sys
import time
import types

import pytest
import torch

from kvd.testing.daemons import DaemonFactory, wait_ready
from kvd.testing.sglang_pool import LAYOUTS, MHAHostPool

EXTRA = {"backend_name": "kvd", "module_path": "kvd.integrations.sglang", "class_name": "KvdHiCacheStorage",
         "interface_v1": 1}
PAGE = 4  # tokens per page
PAGES = 12


@pytest.fixture(scope="module")
def sglang():
    try:
        from sglang.srt.mem_cache import hicache_storage, utils
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    except ImportError as error:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"sglang is not installed (./dev test installs it): {error}")
    return types.SimpleNamespace(storage=hicache_storage, factory=StorageBackendFactory, utils=utils)


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory):
    factory = DaemonFactory(tmp_path_factory.mktemp("sglang"), log_level="info")
    yield factory.start("A", pool_size="64MiB")
    assert not factory.stop_all()


def make_backend(sglang, socket, pool, **overrides):
    """SGLang's attach: StorageBackendFactory.create_backend('dynamic', config, pool), then register."""
    extra = {**EXTRA, "kvd_socket": socket, **overrides.pop("extra", {})}
    fields = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                  enable_storage_metrics=True, is_page_first_layout=pool.layout == "page_first",
                  model_name="org/model", extra_config=extra)
    fields.update(overrides)
    backend = sglang.factory.create_backend("dynamic", sglang.storage.HiCacheStorageConfig(**fields), pool)
    backend.register_mem_pool_host(pool)
    return backend


def page_keys(sglang, seed: int, pages: int = PAGES) -> list[str]:
    """SGLang's L3 keys for a prompt of `pages` pages: chained SHA-256 per page (get_storage_hash_str)."""
    tokens = torch.randint(0, 32000, (pages * PAGE,), generator=torch.Generator().manual_seed(seed)).tolist()
    return sglang.utils.get_storage_hash_str(tokens, None, page_size=PAGE)


def token_indices(page_order: list[int]) -> torch.Tensor:
    """Host indices as SGLang hands them: page_size token indices per page, pages anywhere in the pool."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in page_order])


def backup(sglang, backend, keys, indices) -> int:
    """HiCacheController._page_backup with _page_set_zero_copy: batch by batch, stop at a failure."""
    done, batch = 0, sglang.storage.STORAGE_BATCH_SIZE
    for i in range(0, len(keys), batch):
        extra = sglang.storage.HiCacheStorageExtraInfo(prefix_keys=keys[:i])
        if not all(backend.batch_set_v1(keys[i:i + batch], indices[i * PAGE:(i + batch) * PAGE], extra)):
            break
        done += len(keys[i:i + batch])
    return done


def prefetch(sglang, backend, keys, indices) -> int:
    """_storage_hit_query (batch_exists per batch, leading hits) then _page_get_zero_copy: pages loaded."""
    hits, batch = [], sglang.storage.STORAGE_BATCH_SIZE
    for i in range(0, len(keys), batch):
        n = backend.batch_exists(keys[i:i + batch], sglang.storage.HiCacheStorageExtraInfo(prefix_keys=keys[:i]))
        hits += keys[i:i + n]
        if n < len(keys[i:i + batch]):
            break
    results = backend.batch_get_v1(hits, indices[:len(hits) * PAGE]) if hits else []
    assert results is not None and len(results) == len(hits)
    return next((i for i, ok in enumerate(results) if not ok), len(results))


def page_bytes(pool, start: int) -> torch.Tensor:
    return pool.get_data_page(start, flat=True).view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_backup_then_prefetch_by_a_second_instance_is_bit_exact_in_every_layout(sglang, shared_daemon, dtype):
    for n, layout in enumerate(LAYOUTS):
        writer_pool = MHAHostPool(layer_num=3, head_num=2, head_dim=16, page_size=PAGE, pages=PAGES + 4,
                                  dtype=dtype, layout=layout)
        writer_pool.fill_random(seed=n)
        keys = page_keys(sglang, seed=100 + n)
        writer_order = list(range(2, 2 + PAGES))
        writer = make_backend(sglang, shared_daemon.socket, writer_pool)
        assert backup(sglang, writer, keys, token_indices(writer_order)) == PAGES
        assert backup(sglang, writer, keys, token_indices(writer_order)) == PAGES  # a held page: a no-op success
        writer.close()
        # another engine (a new backend, its own client and host pool), pages landing elsewhere
        reader_pool = MHAHostPool(layer_num=3, head_num=2, head_dim=16, page_size=PAGE, pages=PAGES + 4,
                                  dtype=dtype, layout=layout)
        reader_order = list(reversed(range(PAGES)))
        reader = make_backend(sglang, shared_daemon.socket, reader_pool)
        assert prefetch(sglang, reader, keys + page_keys(sglang, seed=999, pages=2), token_indices(reader_order)) \
            == PAGES
        for w, r in zip(writer_order, reader_order):
            assert torch.equal(page_bytes(writer_pool, w * PAGE), page_bytes(reader_pool, r * PAGE)), (layout, w)
        stats = reader.tier_stats()
        assert stats["entries"] == PAGES and stats["hits"] >= PAGES
        metrics = reader.get_stats()  # SGLang's StorageMetrics where its module imports; else None
        assert metrics is None or metrics.prefetch_pgs == [PAGES]
        reader.close()


def test_namespaces_keep_ranks_tenants_and_formats_apart_and_mla_ranks_share(sglang, shared_daemon):
    pool = MHAHostPool(layer_num=2, head_num=2, head_dim=8, page_size=PAGE, pages=PAGES)
    pool.fill_random(seed=7)
    keys, indices = page_keys(sglang, seed=7), token_indices(list(range(PAGES)))
    writer = make_backend(sglang, shared_daemon.socket, pool, tp_size=2, extra={"kvd_salt": "tenant-a"})
    assert backup(sglang, writer, keys, indices) == PAGES
    same = make_backend(sglang, shared_daemon.socket, pool, tp_size=2, extra={"kvd_salt": "tenant-a"})
    assert same.batch_exists(keys) == PAGES
    others = [make_backend(sglang, shared_daemon.socket, pool, tp_size=2, extra={"kvd_salt": "tenant-b"}),
              make_backend(sglang, shared_daemon.socket, pool, tp_size=2, tp_rank=1, extra={"kvd_salt": "tenant-a"}),
              make_backend(sglang, shared_daemon.socket, pool, tp_size=2, model_name="org/other",
                           extra={"kvd_salt": "tenant-a"}),
              make_backend(sglang, shared_daemon.socket, MHAHostPool(layer_num=2, head_num=2, head_dim=8,
                           page_size=PAGE, pages=PAGES, layout="layer_first"), tp_size=2,
                           extra={"kvd_salt": "tenant-a"})]
    assert [b.batch_exists(keys) for b in others] == [0, 0, 0, 0]
    # MLA: rank 0 writes, rank 1 writes nothing and reads rank 0's pages
    mla = [make_backend(sglang, shared_daemon.socket, MHAHostPool(layer_num=2, head_num=1, head_dim=8,
                        page_size=PAGE, pages=PAGES), tp_rank=r, tp_size=2, is_mla_model=True) for r in range(2)]
    mla[0].host_pages.pool.fill_random(seed=8)
    mla_keys = page_keys(sglang, seed=8)
    assert mla[1].batch_set_v1(mla_keys, indices) == [True] * PAGES and mla[1].batch_exists(mla_keys) == 0
    assert backup(sglang, mla[0], mla_keys, indices) == PAGES
    assert prefetch(sglang, mla[1], mla_keys, indices) == PAGES
    assert torch.equal(mla[0].host_pages.pool.kv_buffer.view(torch.uint8),
                       mla[1].host_pages.pool.kv_buffer.view(torch.uint8))
    for b in [writer, same, *others, *mla]:
        b.close()


def test_the_generic_path_and_its_pages_interoperate_with_v1(sglang, shared_daemon):
    pool = MHAHostPool(layer_num=2, head_num=2, head_dim=8, page_size=PAGE, pages=PAGES, dtype=torch.float16)
    pool.fill_random(seed=11)
    keys, backend = page_keys(sglang, seed=11), make_backend(sglang, shared_daemon.socket, pool)
    half = PAGES // 2
    # HiCacheController._generic_page_set: flat data pages, one bool for the batch
    assert backend.batch_set(keys[:half], [pool.get_data_page(i * PAGE) for i in range(half)]) is True
    assert backend.set(keys[half], pool.get_data_page(half * PAGE)) is True
    assert backend.batch_set_v1(keys[half + 1:], token_indices(list(range(half + 1, PAGES)))) == [True] * (
        PAGES - half - 1)
    fresh = MHAHostPool(layer_num=2, head_num=2, head_dim=8, page_size=PAGE, pages=PAGES, dtype=torch.float16)
    # _generic_page_get: dummy flat pages filled, then set_from_flat_data_page; None on a miss
    dummies = [fresh.get_dummy_flat_data_page() for _ in range(PAGES + 1)]
    got = backend.batch_get([*keys, "f" * 64], dummies)
    assert got[-1] is None and all(g is d for g, d in zip(got[:-1], dummies))
    for i, page in enumerate(got[:-1]):
        fresh.set_from_flat_data_page(i * PAGE, page)
    assert torch.equal(fresh.kv_buffer.view(torch.uint8), pool.kv_buffer.view(torch.uint8))
    assert backend.get(keys[0], fresh.get_dummy_flat_data_page()).view(torch.uint8).equal(page_bytes(pool, 0))
    assert backend.get("0" * 64, fresh.get_dummy_flat_data_page()) is None
    assert backend.exists(keys[-1]) and not backend.exists("0" * 64)
    # pages set through the generic path read back through v1, and v1 pages through the generic path above
    again = MHAHostPool(layer_num=2, head_num=2, head_dim=8, page_size=PAGE, pages=PAGES, dtype=torch.float16)
    reader = make_backend(sglang, shared_daemon.socket, again)
    assert reader.batch_get_v1(keys[:half], token_indices(list(range(half)))) == [True] * half
    assert all(torch.equal(page_bytes(again, i * PAGE), page_bytes(pool, i * PAGE)) for i in range(half))
    assert backend.clear() is True and reader.batch_exists(keys) == 0
    backend.close()
    reader.close()


def test_a_dead_daemon_gives_misses_and_a_new_one_is_used_again(sglang, daemons):
    daemon = daemons.start("A", pool_size="32MiB")
    pool = MHAHostPool(layer_num=2, head_num=2, head_dim=8, page_size=PAGE, pages=PAGES)
    pool.fill_random(seed=5)
    keys, indices = page_keys(sglang, seed=5), token_indices(list(range(PAGES)))
    backend = make_backend(sglang, daemon.socket, pool, extra={"kvd_timeout": 2})
    assert backup(sglang, backend, keys, indices) == PAGES
    daemon.kill(signal.SIGKILL)
    started = time.monotonic()
    for _ in range(3):  # SGLang keeps calling: each a miss, none raising, none None
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, indices) == [False] * PAGES
        assert backend.batch_set_v1(keys, indices) == [False] * PAGES
        assert backend.batch_get(keys[:1], [pool.get_dummy_flat_data_page()]) == [None]
    assert time.monotonic() - started < 10
    # a daemon back on the same socket (its pages are gone: they were the dead daemon's)
    restarted = daemons.start("A", pool_size="32MiB", extra=["--socket", daemon.socket], wait=False)
    restarted.socket = daemon.socket  # (the factory names a new socket; the later --socket wins)
    wait_ready(restarted)
    deadline = time.monotonic() + 15
    while backend.batch_set_v1(keys, indices) != [True] * PAGES:
        assert time.monotonic() < deadline, "the backend did not come back to a restarted daemon"
        time.sleep(0.3)
    assert backend.batch_exists(keys) == PAGES
    backend.close()


def test_a_page_bigger_than_the_tier_is_refused_as_false(sglang, daemons):
    daemon = daemons.start("A", pool_size="16MiB", extra=["--cache-size", "64KiB"])
    pool = MHAHostPool(layer_num=8, head_num=4, head_dim=256, page_size=PAGE, pages=4)
    assert pool.get_data_page(0).numel() * 2 == 128 << 10  # a page of 128 KiB, the tier's budget 64 KiB
    backend = make_backend(sglang, daemon.socket, pool)
    keys = page_keys(sglang, seed=3, pages=2)
    assert backend.batch_set_v1(keys, token_indices([0, 1])) == [False, False]
    assert backend.batch_exists(keys) == 0
    backend.close()


def import_sglang_host_pools():
    """SGLang's MHATokenToKVPoolHost and MLATokenToKVPoolHost with their buffer descriptions.

    Their module imports SGLang's model configs, which import torchvision at module level (for
    image models) and gguf; PyPI's torchvision does not load with the CPU torch. A stand-in
    torchvision is in sys.modules only while these modules import (nothing of it is called by a
    host pool), then removed; gguf must be installed."""
    pytest.importorskip("gguf", reason="gguf is not installed (SGLang's quantization configs import it)")

    class Absent:
        def __init__(self, name):
            self.name = name

        def __getattr__(self, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return Absent(f"{self.name}.{attr}")

        def __call__(self, *args, **kwargs):
            raise RuntimeError(f"{self.name}: torchvision is a stand-in here")

    def stand_in(name):
        module = types.ModuleType(name)
        module.__path__ = []
        module.__getattr__ = Absent(name).__getattr__
        return module

    added = [n for n in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional",
                         "torchvision.transforms.v2", "torchvision.io", "torchvision.ops") if n not in sys.modules]
    real = "torchvision" in sys.modules
    sys.modules.update({n: stand_in(n) for n in added} if not real else {})
    try:
        from sglang.srt.mem_cache import device_pool_info as info
        from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    finally:
        for name in added if not real else ():
            sys.modules.pop(name, None)
    return info, MHATokenToKVPoolHost, MLATokenToKVPoolHost, host_memory_budget_scope


def real_mha_pool(info, cls, layout, dtype, *, layers=3, heads=2, dim=16, tokens=64):
    """SGLang's MHA host pool over CPU "device" buffers (the K/V tensors SGLang would take from the GPU pool)."""
    k = tuple(torch.zeros(tokens, heads, dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(tokens, heads, dim, dtype=dtype) for _ in range(layers))
    ptrs = [torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64) for ts in (k, v)]
    buffers = info.KVBuffers(k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1], layout=info.KVBufferLayout.NHD)
    buffer_info = info.MHABufferInfo(buffers=buffers, page_size=PAGE, head_num=heads, head_dim=dim, v_head_dim=dim,
                                     dtype=dtype, device=torch.device("cpu"))
    return cls(buffer_info, 1.0, 0, PAGE, layout, pin_memory=False, device="cpu",
               device_capacity_tokens=tokens, start_layer=0, end_layer=layers)


def real_mla_pool(info, cls, layout, dtype, *, layers=3, rank=32, rope=8, tokens=64):
    rows = tuple(torch.zeros(tokens, 1, rank + rope, dtype=dtype) for _ in range(layers))
    buffer_info = info.MLABufferInfo(buffers=rows, data_ptrs=torch.tensor([t.data_ptr() for t in rows],
                                     dtype=torch.uint64), layer_indices=tuple(range(layers)), device_layer_num=layers,
                                     page_size=PAGE, kv_lora_rank=rank, qk_rope_head_dim=rope,
                                     kv_cache_dim=rank + rope, dtype=dtype, device=torch.device("cpu"))
    return cls(buffer_info, 1.0, 0, PAGE, layout, pin_memory=False, device="cpu", device_capacity_tokens=tokens,
               start_layer=0, end_layer=layers, target_layer_num=layers)


def random_bits(tensor: torch.Tensor, seed: int) -> None:
    raw = tensor.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_real_sglang_host_pools(sglang, shared_daemon):
    """SGLang's own MHA and MLA host pools: pages are views (one copy each way), a backup and
    prefetch cycle is bit-exact, and MHAHostPool's pages and pointer tables equal the real ones."""
    info, MHAHost, MLAHost, budget = import_sglang_host_pools()
    with budget(1 << 30):  # (SGLang's own sizing keeps 10+ GiB of the host free; these pools are tiny)
        cycle_on_real_pools(sglang, shared_daemon, info, MHAHost, MLAHost)


def cycle_on_real_pools(sglang, shared_daemon, info, MHAHost, MLAHost):
    for n, (layout, dtype) in enumerate([(layout, dtype) for layout in LAYOUTS
                                         for dtype in (torch.bfloat16, torch.float16, torch.float32)]):
        pools = [real_mha_pool(info, MHAHost, layout, dtype) for _ in range(2)]
        random_bits(pools[0].kv_buffer, seed=n)
        ours = MHAHostPool(layer_num=3, head_num=2, head_dim=16, page_size=PAGE, pages=pools[0].page_num,
                           dtype=dtype, layout=layout)
        assert ours.kv_buffer.shape == pools[0].kv_buffer.shape
        ours.kv_buffer.copy_(pools[0].kv_buffer)
        indices = token_indices([3, 1, 4])
        assert [p - pools[0].kv_buffer.data_ptr() for p in pools[0].get_page_buffer_meta(indices)[0]] == \
               [p - ours.kv_buffer.data_ptr() for p in ours.get_page_buffer_meta(indices)[0]]
        assert pools[0].get_page_buffer_meta(indices)[1] == ours.get_page_buffer_meta(indices)[1]
        for start in (0, 3 * PAGE):
            assert torch.equal(page_bytes(pools[0], start), page_bytes(ours, start))
            assert torch.equal(pools[0].get_dummy_flat_data_page(), ours.get_dummy_flat_data_page())
        mla = [real_mla_pool(info, MLAHost, layout, dtype) for _ in range(2)]
        random_bits(mla[0].kv_buffer, seed=50 + n)
        for kind, (src, dst), mla_model in (("mha", pools, False), ("mla", mla, True)):
            keys = page_keys(sglang, seed=200 + n, pages=PAGES)
            # MHA: a second instance of the same rank; MLA: rank 1 of 2 reads what rank 0 wrote
            writer, reader = (make_backend(sglang, shared_daemon.socket, pool, is_mla_model=mla_model,
                                           tp_rank=r if mla_model else 0, tp_size=2 if mla_model else 1)
                              for r, pool in enumerate((src, dst)))
            assert writer.host_pages.zero_copy and reader.host_pages.zero_copy, (kind, layout)
            order = list(range(PAGES))
            assert backup(sglang, writer, keys, token_indices(order)) == PAGES
            assert prefetch(sglang, reader, keys, token_indices(order[::-1])) == PAGES
            for w, r in zip(order, order[::-1]):
                assert torch.equal(page_bytes(src, w * PAGE), page_bytes(dst, r * PAGE)), (kind, layout, dtype, w)
            writer.close()
            reader.close()
