"""The tier across two nodes and a real registry (etcd; issue 39, items 2 and 3): `cache_clear` means
the cluster, and pages that another node sends are held to this node's budget like its own."""
from __future__ import annotations

import signal
import uuid

import pytest
import torch

import kvd
from kvd.client.connection import ask
from kvd.cluster.rendezvous import homes
from kvd.testing.daemons import eventually
from kvd.wire import protocol as p
from tests.cluster.conftest import start_or_skip
from tests.cluster.servers import stop_server

KEYS = [f"{i:064x}" for i in range(400)]


@pytest.fixture(scope="module")
def registry():
    server = start_or_skip("etcd")
    yield server
    stop_server(server)


def pair(daemons, registry, *extra: str):
    flags = ["--registry", registry.url, "--cluster", f"c{uuid.uuid4().hex[:8]}", "--registry-ttl", "2s", *extra]
    a = daemons.start("A", pool_size="16MiB", extra=flags)
    b = daemons.start("B", pool_size="16MiB", extra=flags)

    def tier(d) -> list[str]:
        return sorted(n["node_id"] for n in ask(p.ClusterNodes(req=1), d.socket) if n.get("cache_bytes"))

    eventually(lambda: tier(a) == tier(b) == ["A", "B"], timeout=15)
    return a, b


def test_cache_clear_on_one_node_clears_the_namespace_everywhere(daemons, registry):
    a, b = pair(daemons, registry, "--block-size", "4KiB")
    pages = [torch.full((64,), i, dtype=torch.int32) for i in range(len(KEYS))]
    on_b_home = [i for i, home in enumerate(homes("ns", KEYS, ["A", "B"])) if home == "B"]
    assert len(on_b_home) > 100
    with a.client() as on_a, b.client() as on_b:
        assert on_a.cache_put(KEYS, pages, namespace="ns") == [True] * len(KEYS)
        assert on_a.cache_put(KEYS[:10], pages[:10], namespace="kept") == [True] * 10
        assert on_b.cache_exists(KEYS, namespace="ns") == len(KEYS)  # (through their homes)
        dropped = on_a.cache_clear("ns")
        assert dropped >= len(KEYS)  # A's near copies, and B's pages it is home to
        for reader in (on_a, on_b):  # nobody serves the old pages, from its own pool or a home's
            assert reader.cache_exists(KEYS, namespace="ns") == 0
            outs = [torch.empty(64, dtype=torch.int32) for _ in on_b_home]
            assert reader.cache_get([KEYS[i] for i in on_b_home], outs, namespace="ns") == [False] * len(on_b_home)
        assert on_b.cache_exists(KEYS[:10], namespace="kept") == 10  # another namespace is untouched


def test_cache_clear_that_a_node_does_not_confirm_says_so(daemons, registry):
    a, b = pair(daemons, registry)
    with a.client() as on_a:
        assert on_a.cache_put(KEYS[:50], [torch.ones(8)] * 50, namespace="ns") == [True] * 50
        b.kill(signal.SIGSTOP)
        try:
            with pytest.raises(kvd.PeerUnavailable, match="B did not confirm"):
                on_a.cache_clear("ns")
            assert on_a.cache_exists(KEYS[:50], namespace="ns") == 0  # (cleared here all the same)
        finally:
            b.kill(signal.SIGCONT)
        eventually(lambda: cleared(on_a, "ns"), timeout=10)  # a retry clears what B held
        with b.client() as on_b:
            assert on_b.cache_exists(KEYS[:50], namespace="ns") == 0


def cleared(client, namespace: str) -> bool:
    try:
        client.cache_clear(namespace)
        return True
    except kvd.PeerUnavailable:
        return False


def test_pages_another_node_sends_are_held_to_this_node_s_budget(daemons, registry):
    # 1 MiB budgets of 64 KiB blocks: 16 pages a node, however small, and whoever sends them
    a, b = pair(daemons, registry, "--cache-size", "1MiB")
    empty = torch.empty(0, dtype=torch.uint8)
    with a.client() as on_a, b.client() as on_b:
        for n in range(5):
            keys = [f"e{n}-{i}" for i in range(4096)]
            on_a.cache_put(keys, [empty] * 4096, namespace="flood")
        assert on_b.cache_stats()["entries"] <= 16 and on_a.cache_stats()["entries"] <= 16
        assert on_b.cache_stats()["cluster"]["bad"] == 0
