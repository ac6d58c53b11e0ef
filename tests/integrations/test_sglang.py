"""The SGLang HiCache backend's parts without a daemon: namespaces, settings, the failure guard, the
host pool's pages as views, and the backend built by SGLang's own factory against a daemon that is
not there (every call a miss or False, none raising, none None). Real daemons: tests/system/test_sglang_tier.py."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from kvd.daemon.store.page_names import NAMESPACE_RE
from kvd.errors import BadRequest, PeerUnavailable
from kvd.integrations.sglang import naming
from kvd.integrations.sglang.guard import Guard
from kvd.integrations.sglang.pages import HostPages
from kvd.integrations.sglang.settings import Settings
from kvd.testing.sglang_pool import LAYOUTS, MHAHostPool

EXTRA = {"backend_name": "kvd", "module_path": "kvd.integrations.sglang", "class_name": "KvdHiCacheStorage",
         "interface_v1": 1}


def sglang_storage():
    """SGLang's storage modules, or a skip (a failure under CI, where ./dev test installs them)."""
    try:
        from sglang.srt.mem_cache import hicache_storage
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    except ImportError as error:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"sglang is not installed (./dev test installs it): {error}")
    return hicache_storage, StorageBackendFactory


def fmt(pool: MHAHostPool) -> str:
    pages = HostPages(pool)
    return naming.page_format(pages.layout, pages.dtype, pages.shape)


# --- namespaces

def test_mha_ranks_are_apart_and_mla_ranks_share_one_namespace():
    f = naming.page_format("page_first", torch.bfloat16, (2, 64, 32, 8, 128))
    mha = [naming.namespace(naming.RankIdentity("llama", tp_rank=r, tp_size=2), f) for r in range(2)]
    assert mha[0] != mha[1] and "tp=0/2" in mha[0]
    assert naming.namespace(naming.RankIdentity("llama", 0, 4), f) not in mha  # TP 4's heads are other bytes
    mla = {naming.namespace(naming.RankIdentity("deepseek", tp_rank=r, tp_size=4, is_mla_model=True), f)
           for r in range(4)}
    assert len(mla) == 1  # one writer, every rank reads
    stages = {naming.namespace(naming.RankIdentity("llama", pp_rank=s, pp_size=2), f) for s in range(2)}
    assert len(stages) == 2


def test_salt_format_and_model_each_separate_namespaces_and_the_salt_is_not_shown():
    rank = naming.RankIdentity("llama")
    bf16 = naming.page_format("page_first", torch.bfloat16, (2, 64, 32, 8, 128))
    seen = {naming.namespace(rank, bf16), naming.namespace(rank, bf16, "tenant-a"),
            naming.namespace(rank, bf16, "tenant-b"),
            naming.namespace(rank, naming.page_format("page_first", torch.float16, (2, 64, 32, 8, 128))),
            naming.namespace(rank, naming.page_format("layer_first", torch.bfloat16, (2, 32, 64, 8, 128))),
            naming.namespace(naming.RankIdentity("llama-2"), bf16)}
    assert len(seen) == 6
    assert all("tenant" not in ns for ns in seen)


def test_any_model_name_gives_a_bounded_namespace_the_daemon_accepts():
    f = naming.page_format("page_first", torch.bfloat16, (2, 64, 32, 8, 128))
    names = ["meta-llama/Llama-3.1-8B-Instruct", "a;b=c", "a_b_c", "/models/ünïcode name", "x" * 1000, ""]
    spaces = [naming.namespace(naming.RankIdentity(n, 3, 8, pp_rank=1, pp_size=4), f, "s" * 500) for n in names]
    assert len(set(spaces)) == len(names)  # "a;b=c" and "a_b_c" stay apart (the first is hashed)
    assert naming.namespace(naming.RankIdentity(None), f) == naming.namespace(naming.RankIdentity(""), f)
    assert all(NAMESPACE_RE.fullmatch(ns) and ";" not in ns.split("m=")[1].split(";")[0] for ns in spaces)
    assert naming.namespace(naming.RankIdentity("m"), "x" * 400).startswith(naming.PREFIX + ";h=")


def test_rank_identity_reads_sglang_config_fields_by_name():
    class Config:  # the fields of HiCacheStorageConfig this module reads (SGLang's own class below)
        model_name, tp_rank, tp_size, pp_rank, pp_size, is_mla_model = "m", 1, 2, 0, 1, False

    assert naming.RankIdentity.of(Config()) == naming.RankIdentity("m", tp_rank=1, tp_size=2)


# --- settings

def test_settings_from_the_extra_config():
    assert Settings.from_extra(EXTRA) == Settings()
    s = Settings.from_extra({**EXTRA, "kvd_socket": "unix:///tmp/x.sock", "kvd_salt": "t", "kvd_timeout": 2})
    assert (s.socket, s.salt, s.timeout) == ("unix:///tmp/x.sock", "t", 2.0)
    with pytest.raises(ValueError, match=r"kvd_slat.*known: kvd_salt"):
        Settings.from_extra({"kvd_slat": "t"})  # a typo must not share a tenant's pages
    for bad in (0, -1, "5", True, float("inf")):
        with pytest.raises(ValueError, match="kvd_timeout"):
            Settings.from_extra({"kvd_timeout": bad})
    with pytest.raises(ValueError, match="kvd_salt must be a string"):
        Settings.from_extra({"kvd_salt": 7})


# --- the guard

def test_guard_backs_off_a_daemon_that_did_not_answer_and_not_one_that_refused(caplog):
    now = [100.0]
    guard = Guard(retry_after=1.0, log_every=30.0, clock=lambda: now[0])
    assert guard.available()
    guard.failed("batch_get_v1", BadRequest("bad key"))
    assert guard.available()  # the daemon answered: ask it again
    guard.failed("batch_get_v1", PeerUnavailable("down"))
    assert not guard.available()
    now[0] += 1.01
    assert guard.available()


def test_guard_logs_at_most_once_per_period_and_counts_the_rest(caplog):
    now = [0.0]
    guard = Guard(retry_after=0.0, log_every=30.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvd.sglang"):
        for _ in range(50):
            guard.failed("batch_exists", PeerUnavailable("daemon down"))
        now[0] = 31.0
        guard.failed("batch_exists", PeerUnavailable("daemon down"))
    records = [r for r in caplog.records if r.name == "kvd.sglang"]
    assert len(records) == 2 and "49 more failures" in records[1].getMessage()
    assert guard.failures == 51


# --- host pool pages

@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_are_views_covering_exactly_sglangs_pointer_tables(layout):
    pool = MHAHostPool(layer_num=3, head_num=2, head_dim=8, page_size=4, pages=6, layout=layout)
    pages = HostPages(pool)
    assert pages.zero_copy and pages.nbytes == 2 * 3 * 4 * 2 * 8 * 2
    indices = torch.cat([torch.arange(8, 12), torch.arange(0, 4)])  # pages 2 and 0, out of order
    starts = pages.starts(2, indices)
    assert starts == [8, 0]
    for start, view in zip(starts, pages.sources(starts)):
        # the bytes a view covers are exactly the (pointer, size) runs SGLang's Mooncake/NIXL use
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(start, start + 4))
        runs = sorted(zip(ptrs, sizes))
        flat = view.reshape(-1, runs[0][1] // view.element_size())  # (a copy if not laid out in runs)
        assert flat.shape[0] == len(runs)
        assert torch.equal(flat.view(torch.uint8), torch.stack(
            [pool.kv_buffer.view(-1).view(torch.uint8)[p - pool.kv_buffer.data_ptr():][:n] for p, n in runs]))
    with pytest.raises(ValueError, match="7 host indices for 2 keys"):
        pages.starts(2, torch.arange(7))


def test_a_pool_without_page_views_gets_sglangs_two_copy_path():
    class CopyingPool(MHAHostPool):
        def get_data_page(self, index, flat=True):
            return super().get_data_page(index, flat).clone()

    pool = CopyingPool(layer_num=2, head_num=1, head_dim=4, page_size=2, pages=3)
    pool.fill_random(3)
    pages = HostPages(pool)
    assert not pages.zero_copy
    outs, land = pages.targets([0, 2])
    outs[0].copy_(pool.get_data_page(4))  # as if page 2's bytes came back for the first key
    land([True, False])
    assert torch.equal(pool.get_data_page(0).view(torch.uint8), pool.get_data_page(4).view(torch.uint8))


# --- the backend, built by SGLang's factory, with no daemon to talk to

def config(hicache_storage, **overrides):
    fields = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                  enable_storage_metrics=False, is_page_first_layout=True, model_name="test/model",
                  extra_config=dict(EXTRA))
    extra = overrides.pop("extra", {})
    fields.update(overrides)
    fields["extra_config"].update(extra)
    return hicache_storage.HiCacheStorageConfig(**fields)


def test_the_factory_builds_it_and_a_missing_daemon_is_misses_never_an_exception(tmp_path):
    hicache_storage, factory = sglang_storage()
    pool = MHAHostPool(layer_num=2, head_num=2, head_dim=8, page_size=4, pages=8)
    cfg = config(hicache_storage, extra={"kvd_socket": f"unix://{tmp_path}/absent.sock", "kvd_timeout": 1})
    backend = factory.create_backend("dynamic", cfg, pool)
    assert isinstance(backend, hicache_storage.HiCacheStorage) and type(backend).__name__ == "KvdHiCacheStorage"
    backend.register_mem_pool_host(pool)
    keys, indices = ["a", "b"], torch.arange(8)
    started = time.monotonic()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, indices) == [False, False]
    assert backend.batch_set_v1(keys, indices) == [False, False]
    assert backend.get("a", pool.get_dummy_flat_data_page()) is None
    assert backend.batch_get(keys, [pool.get_dummy_flat_data_page()] * 2) == [None, None]
    assert backend.set("a", pool.get_data_page(0)) is False
    assert backend.batch_set(keys, [pool.get_data_page(0)] * 2) is False
    assert backend.exists("a") is False and backend.clear() is False and backend.tier_stats() == {}
    assert backend.get_stats() is None
    assert time.monotonic() - started < 5  # backed off after the first failure: no wait per call
    # SGLang's own mistakes are answered too: wrong index counts, no targets
    assert backend.batch_get_v1(keys, torch.arange(5)) == [False, False]
    assert backend.batch_get(keys, None) == [None, None]
    backend.close()


def test_an_mla_reader_rank_writes_nothing_and_reports_success(tmp_path):
    hicache_storage, factory = sglang_storage()
    pool = MHAHostPool(layer_num=2, head_num=1, head_dim=8, page_size=4, pages=4)
    cfg = config(hicache_storage, tp_rank=1, tp_size=2, is_mla_model=True,
                 extra={"kvd_socket": f"unix://{tmp_path}/absent.sock"})
    assert not cfg.is_storage_writer
    backend = factory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    assert backend.batch_set_v1(["a"], torch.arange(4)) == [True]  # (no daemon: nothing was asked)
    assert backend.batch_set(["a"], [pool.get_data_page(0)]) is True
    assert "mla" in backend.namespace and "tp=" not in backend.namespace


def test_a_bad_kvd_setting_fails_the_attach_with_its_name(tmp_path):
    hicache_storage, factory = sglang_storage()
    with pytest.raises(ValueError, match="kvd_sokcet"):
        factory.create_backend("dynamic", config(hicache_storage, extra={"kvd_sokcet": "x"}), None)


def test_importing_kvd_never_needs_sglang():
    code = ("import sys; sys.modules['sglang'] = None\n"  # (None in sys.modules: any import of it fails)
            "import kvd, kvd.integrations.sglang\n"
            "from kvd.integrations.sglang import naming, pages, guard, settings\n"
            "import kvd.testing.sglang_pool\n"
            "try:\n    kvd.integrations.sglang.KvdHiCacheStorage\n"
            "except ImportError as e:\n    print('needs', e.name)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("needs sglang")
