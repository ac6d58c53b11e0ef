"""Rendezvous placement of KV tier pages (kvd.cluster.rendezvous), pure: the same home everywhere,
an even spread, and membership changes that move only the keys they must; the node record's
cache budget field, old records without it still readable."""
from __future__ import annotations

import collections
import json

import pytest

from kvd.cluster.records import NodeRecord, decode_node, encode_node
from kvd.cluster.rendezvous import cache_nodes, home, homes

KEYS = [f"{i:064x}" for i in range(6000)]


def placement(nodes: list[str], namespace: str = "ns") -> dict[str, str]:
    return dict(zip(KEYS, homes(namespace, KEYS, nodes)))


def test_the_home_does_not_depend_on_the_order_of_the_node_list():
    nodes = ["a", "b", "c", "d"]
    assert placement(nodes) == placement(list(reversed(nodes))) == placement([*nodes, "b"])
    assert home("ns", "k", []) is None


@pytest.mark.parametrize("count", [3, 5, 8])
def test_keys_spread_evenly(count):
    nodes = [f"node-{i}" for i in range(count)]
    load = collections.Counter(placement(nodes).values())
    share = len(KEYS) / count
    assert set(load) == set(nodes)
    assert all(0.85 * share < n < 1.15 * share for n in load.values()), load


@pytest.mark.parametrize("count", [3, 4, 7])
def test_a_join_moves_only_keys_to_the_newcomer_and_about_one_nth(count):
    nodes = [f"node-{i}" for i in range(count)]
    before, after = placement(nodes), placement([*nodes, "new"])
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "new" for k in moved)
    assert abs(len(moved) - len(KEYS) / (count + 1)) < 0.15 * len(KEYS) / (count + 1)


@pytest.mark.parametrize("count", [3, 4, 7])
def test_a_leave_moves_only_the_leavers_keys(count):
    nodes = [f"node-{i}" for i in range(count)]
    before, after = placement(nodes), placement(nodes[1:])
    for key in KEYS:
        if before[key] != nodes[0]:
            assert after[key] == before[key]
        else:
            assert after[key] != nodes[0]


def test_namespaces_place_the_same_key_independently():
    nodes = ["a", "b", "c"]
    one, two = placement(nodes, "tenant=1"), placement(nodes, "tenant=2")
    same = sum(one[k] == two[k] for k in KEYS)
    assert 0.25 * len(KEYS) < same < 0.42 * len(KEYS)  # chance: a third


def test_only_nodes_with_a_cache_budget_take_pages():
    records = [NodeRecord("a", 1, "tcp://h:1", cache_bytes=1 << 30), NodeRecord("b", 2, "tcp://h:2"),
               NodeRecord("c", 3, "tcp://h:3", cache_bytes=1)]
    assert cache_nodes(records) == ["a", "c"]


def test_the_cache_budget_field_round_trips_and_old_records_read_as_none():
    rec = NodeRecord("a", 7, "tcp://h:1", pool_bytes=1 << 30, cache_bytes=1 << 28)
    raw = encode_node(rec)
    assert json.loads(raw)["cache_bytes"] == 1 << 28 and decode_node(raw) == rec
    old = NodeRecord("a", 7, "tcp://h:1", pool_bytes=1 << 30)
    assert "cache_bytes" not in json.loads(encode_node(old))  # unchanged bytes for a node without a tier
    assert decode_node(encode_node(old)).cache_bytes == 0
    with pytest.raises(Exception, match="cache_bytes"):
        decode_node(json.dumps(json.loads(raw) | {"cache_bytes": -1}))
