"""SGLang's HiCache L3 across nodes: an engine on node A backs its pages up through kvd's backend, and
another engine on node B (its own daemon, the same cluster on a real etcd) prefetches them, bit-exact.
The pages travel by the KV tier's rendezvous placement (docs/kv-tier.md), with no registry write per
page; the registry lists nodes only."""
from __future__ import annotations

import uuid

import pytest
import torch

from kvd.client.connection import ask
from kvd.testing.daemons import eventually
from kvd.testing.sglang_pool import MHAHostPool
from kvd.wire import protocol as p
from tests.cluster.conftest import start_or_skip
from tests.cluster.servers import stop_server

from .test_sglang_tier import PAGE, backup, make_backend, page_bytes, page_keys, prefetch, sglang, token_indices

__all__ = ["sglang"]  # (the fixture, imported to be found here)

PAGES = 24


@pytest.fixture(scope="module")
def etcd():
    server = start_or_skip("etcd")
    yield server
    stop_server(server)


def test_a_second_engine_on_another_node_prefetches_what_the_first_backed_up(sglang, daemons, etcd):
    cluster = f"c{uuid.uuid4().hex[:8]}"
    flags = ["--registry", etcd.url, "--cluster", cluster, "--registry-ttl", "2s", "--block-size", "4KiB",
             "--pool-overcommit", "--cache-size", "0.5"]
    a = daemons.start("A", pool_size="16MiB", extra=flags)
    b = daemons.start("B", pool_size="16MiB", extra=flags)
    eventually(lambda: all(len(ask(p.ClusterNodes(req=1), d.socket)) == 2 for d in (a, b)), timeout=15)

    writer_pool = MHAHostPool(layer_num=3, head_num=2, head_dim=16, page_size=PAGE, pages=PAGES + 2,
                              dtype=torch.bfloat16, layout="layer_first")
    writer_pool.fill_random(seed=3)
    keys = page_keys(sglang, seed=303, pages=PAGES)
    writer_order = list(range(1, 1 + PAGES))
    writer = make_backend(sglang, a.socket, writer_pool)
    assert backup(sglang, writer, keys, token_indices(writer_order)) == PAGES
    writer.close()

    reader_pool = MHAHostPool(layer_num=3, head_num=2, head_dim=16, page_size=PAGE, pages=PAGES + 2,
                              dtype=torch.bfloat16, layout="layer_first")
    reader_order = list(reversed(range(PAGES)))
    reader = make_backend(sglang, b.socket, reader_pool)
    assert prefetch(sglang, reader, keys, token_indices(reader_order)) == PAGES
    for w, r in zip(writer_order, reader_order):
        assert torch.equal(page_bytes(writer_pool, w * PAGE), page_bytes(reader_pool, r * PAGE)), w
    reader.close()
    # some pages had their home on A and some on B: both nodes' tiers took part (with 24 keys over two
    # nodes, one home taking all is a 2^-23 chance)
    held = {}
    for name, daemon in (("A", a), ("B", b)):
        with daemon.client() as client:
            held[name] = client.cache_stats()["entries"]
    assert all(n > 0 for n in held.values()), held
