"""A registry that someone other than kvd writes to: what the etcd and Redis backends read from it is
bounded and filtered (real servers; the "attacker" writes straight to them, bypassing kvd).

Listings page through big clusters (9,000 members broke every Redis listing in one Lua unpack), a
listing stops at its byte cap, oversized records are skipped without being transferred, a key that
does not name its value's node id is ignored, a holder flood costs misses and not memory, keys planted
with another type fail nothing, and a record kvd never writes (no lease, no TTL) never blocks a
registration. Skips are counted in `dropped` and logged once a minute per kind and reason.
"""
from __future__ import annotations

import base64
import json
import logging
import time

import pytest

from kvd.cluster.backends.backend import MAX_HOLDERS, Publish, Registered, Removed, Resync
from kvd.cluster.records import NodeRecord, encode_holder, encode_node, key_part, rid_key

from .conftest import Harness, run
from .test_contract import holder, next_event, node
from .test_listing_cost import listing_reads

SCALE = 9_000  # members: past Lua's unpack limit (~8,000), where every Redis listing used to fail


@pytest.fixture(params=["etcd", "redis"])
def real_reg(request):
    h = Harness(request.param, request.getfixturevalue(f"{request.param}_server"))
    yield h
    h.heal()


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


class Attacker:
    """Writes the registry as anyone with write access could: any key, any value, no kvd rules."""

    def __init__(self, h: Harness) -> None:
        self.h, self.c = h, h.cluster
        self._lease = 0

    def node_key(self, part: str) -> str:
        return f"/kvd/{self.c}/nodes/{part}" if self.h.kind == "etcd" else f"kvd:{self.c}:node:{part}"

    def lease(self) -> int:
        if not self._lease:
            self._lease = int(self.h.server.admin("/v3/lease/grant", {"TTL": 120})["ID"])
        return self._lease

    def nodes(self, items: list[tuple[str, bytes]], *, leased: bool = True) -> None:
        """Node records under node keys (key part, value), under a lease / TTL unless not `leased`."""
        if self.h.kind == "etcd":
            lease = {"lease": str(self.lease())} if leased else {}
            for i in range(0, len(items), 128):  # etcd's --max-txn-ops
                puts = [{"request_put": {"key": _b64(self.node_key(k)), "value": _b64(v), **lease}}
                        for k, v in items[i:i + 128]]
                self.h.server.admin("/v3/kv/txn", {"success": puts})
            return
        with self.h.server.admin() as r, r.pipeline(transaction=False) as p:
            expiry = int(time.time() * 1000) + 120_000
            for k, v in items:
                p.set(self.node_key(k), v, px=120_000 if leased else None)
                p.zadd(f"kvd:{self.c}:nodes", {self.node_key(k): expiry})
            p.execute()

    def holders(self, rid: str, items: list[tuple[str, bytes]]) -> None:
        """Holder records of `rid` under (key part, value): etcd keys, Redis hash fields."""
        if self.h.kind == "etcd":
            for i in range(0, len(items), 128):
                puts = [{"request_put": {"key": _b64(f"/kvd/{self.c}/req/{rid_key(rid)}/{k}"), "value": _b64(v),
                                         "lease": str(self.lease())}} for k, v in items[i:i + 128]]
                self.h.server.admin("/v3/kv/txn", {"success": puts})
            return
        with self.h.server.admin() as r:
            r.hset(f"kvd:{self.c}:req:{rid_key(rid)}", mapping=dict(items))
            r.pexpire(f"kvd:{self.c}:req:{rid_key(rid)}", 120_000)


def inc_of(i: int) -> int:
    return i % 1000 + 1  # node()'s endpoint port is 7000 + incarnation


def records(n: int, prefix: str = "n") -> list[tuple[str, bytes]]:
    return [(f"{prefix}{i}", encode_node(node(f"{prefix}{i}", inc=inc_of(i)))) for i in range(n)]


def big_record(node_id: str, size: int) -> bytes:
    return encode_node(NodeRecord(node_id, 7, "tcp://127.0.0.1:7007", labels={"pad": "x" * size}))


def big_holder(rid: str, node_id: str, size: int) -> bytes:
    """A valid holder record of `node_id` (incarnation 1), padded with a field readers ignore."""
    return json.dumps({**json.loads(encode_holder(holder(rid, node_id))), "pad": "x" * size}).encode()


# ---- listings ----

@run
async def _many(h: Harness, n: int, page_calls: int):
    Attacker(h).nodes(records(n))
    b, w = h.backend(op_timeout=10.0), h.backend(op_timeout=10.0)
    it = w.watch_nodes()
    try:
        before = listing_reads(h) if h.kind == "etcd" else 0
        t0 = time.monotonic()
        _, nodes = await b.list_nodes()
        took = time.monotonic() - t0
        assert len(nodes) == n and {x.node_id for x in nodes} == {f"n{i}" for i in range(n)}
        if h.kind == "etcd":  # one range per page, not one of everything
            assert listing_reads(h) - before >= page_calls
        ev = await next_event(it, 30.0)
        assert isinstance(ev, Resync) and len(ev.nodes) == n
        print(f"{h.kind}: {n} members listed in {took:.2f} s")
    finally:
        await it.aclose()
        await h.close_all()


def test_a_listing_pages_through_9000_members(real_reg):
    _many(real_reg, SCALE, SCALE // 1000)


@pytest.mark.slow
def test_a_listing_pages_through_100k_members(real_reg):
    _many(real_reg, 100_000, 100)


@run
async def _small_pages(h: Harness):
    Attacker(h).nodes(records(300))  # past 128 members Redis keeps the index as a hashtable: ZSCAN pages
    b = h.backend()
    b.list_page = 7
    try:
        _, nodes = await b.list_nodes()
        assert sorted(x.node_id for x in nodes) == sorted(f"n{i}" for i in range(300))  # none lost, none twice
        b.max_listing_bytes = 20_000  # ~70 records: the listing stops there, counted and logged
        _, nodes = await b.list_nodes()
        assert 0 < len(nodes) < 300 and b.dropped[("node", "truncated")] == 1
    finally:
        await h.close_all()


def test_small_pages_lose_nothing_and_a_listing_stops_at_its_byte_cap(real_reg):
    _small_pages(real_reg)


@run
async def _page_too_large(h: Harness):
    Attacker(h).nodes([*records(20), *((f"big{i}", big_record(f"big{i}", 200_000)) for i in range(5))])
    b = h.backend(op_timeout=5.0)
    b.page_body = 1 << 20  # the 25 records weigh ~1.4 MB: read again in smaller pages
    try:
        _, nodes = await b.list_nodes()
        assert sorted(x.node_id for x in nodes) == sorted(f"n{i}" for i in range(20))
        assert b.dropped[("node", "too_large")] == 5 and b.dropped[("node", "truncated")] == 0
    finally:
        await h.close_all()


def test_an_etcd_page_over_its_cap_is_read_again_in_smaller_pages(etcd_server):
    _page_too_large(Harness("etcd", etcd_server))


# ---- what a read believes ----

@run
async def _oversized(h: Harness):
    attacker = Attacker(h)
    huge = 20 << 20 if h.kind == "redis" else 1 << 20  # etcd refuses requests over 1.5 MiB by default
    attacker.nodes([("big", big_record("big", 20_000)), ("huge", big_record("huge", huge))])
    b = h.backend(op_timeout=5.0)
    try:
        s = await b.open_session(30)
        await b.register_node(s, node("a"))
        attacker.holders("r1", [("a", big_holder("r1", "a", 20_000))])
        sent = _redis_sent(h)
        assert [x.node_id for x in (await b.list_nodes())[1]] == ["a"]
        assert await b.get_node("big") is None and await b.get_node("huge") is None
        assert (await b.holders("r1"))[1] == []
        if h.kind == "redis":  # the 20 MB value never left the server
            assert _redis_sent(h) - sent < 1 << 20
        assert b.dropped[("node", "too_large")] >= 4 and b.dropped[("holder", "too_large")] == 1
    finally:
        await h.close_all()


def _redis_sent(h: Harness) -> int:
    if h.kind != "redis":
        return 0
    with h.server.admin() as r:
        return r.info("stats")["total_net_output_bytes"]


def test_records_over_the_size_cap_are_skipped(real_reg):
    _oversized(real_reg)


@run
async def _mismatch(h: Harness):
    attacker = Attacker(h)
    b = h.backend()
    try:
        s = await b.open_session(30)
        await b.register_node(s, node("victim"))
        await b.register_node(s, node("a"))
        forged = NodeRecord("victim", 666, "tcp://6.6.6.6:6666")
        attacker.nodes([("zzz", encode_node(forged)), ("vic%74im", encode_node(forged))])
        _, nodes = await b.list_nodes()
        assert sorted((x.node_id, x.endpoint) for x in nodes) == [("a", node("a").endpoint),
                                                                 ("victim", node("victim").endpoint)]
        assert await b.get_node("victim") == node("victim") and await b.get_node("zzz") is None
        assert b.dropped[("node", "key_mismatch")] >= 2
        # a holder record under another node's key or field
        await b.publish_batch(s, [Publish(holder("r1", "a"))])
        attacker.holders("r1", [("zzz", encode_holder(holder("r1", "a", gen=9)))])
        assert [(x.node_id, x.gen) for x in (await b.holders("r1"))[1]] == [("a", 1)]
        assert b.dropped[("holder", "key_mismatch")] == 1
    finally:
        await h.close_all()


def test_a_key_that_does_not_name_its_values_node_is_ignored(real_reg):
    _mismatch(real_reg)


@run
async def _flood(h: Harness):
    attacker = Attacker(h)
    n = 2 * MAX_HOLDERS + 88
    if h.kind == "redis":  # live nodes, so that every flooded holder would pass the liveness filter
        attacker.nodes(records(n))
    attacker.holders("r1", [(key_part(f"n{i}"), encode_holder(holder("r1", f"n{i}", inc=inc_of(i)))) for i in range(n)])
    b = h.backend(op_timeout=5.0)
    try:
        _, found = await b.holders("r1")
        assert len(found) == MAX_HOLDERS, len(found)
    finally:
        await h.close_all()


def test_a_holder_flood_is_read_only_up_to_max_holders(real_reg):
    _flood(real_reg)


@run
async def _never_written(h: Harness):
    attacker = Attacker(h)
    b = h.backend()
    try:
        cases = {  # node id -> what sits under its key
            "unleased": (encode_node(node("unleased", inc=9)), False),
            "other-id": (encode_node(node("someone", inc=9)), True),
            "partial": (json.dumps({"v": 1, "node_id": "partial", "incarnation": "9"}).encode(), True),
            "junk": (b"\xff not json", True),
        }
        for node_id, (value, leased) in cases.items():
            attacker.nodes([(node_id, value)], leased=leased)
        s = await b.open_session(30)
        for node_id in cases:
            res = await b.register_node(s, node(node_id))
            assert isinstance(res, Registered), (node_id, res)
        assert sorted(x.node_id for x in (await b.list_nodes())[1]) == sorted(cases)
    finally:
        await h.close_all()


def test_a_record_kvd_never_writes_never_blocks_a_registration(real_reg):
    _never_written(real_reg)


@run
async def _logged_once(h: Harness, caplog):
    caplog.set_level(logging.WARNING)
    Attacker(h).nodes([(f"bad{i}", b"{not json") for i in range(30)])
    b = h.backend()
    try:
        for _ in range(2):
            assert (await b.list_nodes())[1] == []
        assert b.dropped[("node", "undecodable")] == 60
        lines = [r for r in caplog.records if "undecodable" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]
    finally:
        await h.close_all()


def test_skipped_records_are_counted_each_and_logged_once_a_minute(real_reg, caplog):
    _logged_once(real_reg, caplog)


# ---- etcd: the watch applies the same rules ----

@run
async def _watch(h: Harness):
    attacker = Attacker(h)
    b, w = h.backend(), h.backend()
    it = w.watch_nodes()
    try:
        assert isinstance(await next_event(it), Resync)
        s = await b.open_session(30)
        await b.register_node(s, node("victim"))
        assert (await next_event(it)).node == node("victim")
        forged = encode_node(NodeRecord("victim", 666, "tcp://6.6.6.6:6666"))
        attacker.nodes([("vic%74im", forged)])  # no node's key: no event at all
        attacker.nodes([("zzz", forged)])  # node zzz's key, holding no record of zzz: zzz is in no listing
        ev = await next_event(it)
        assert isinstance(ev, Removed) and ev.node_id == "zzz"
        attacker.nodes([("victim", encode_node(node("victim")))], leased=False)  # no lease: not believed
        ev = await next_event(it)
        assert isinstance(ev, Removed) and ev.node_id == "victim"
        await b.register_node(s, node("victim"))  # a lease-less record is replaced
        assert (await next_event(it)).node == node("victim")
    finally:
        await it.aclose()
        await h.close_all()


def test_an_etcd_watch_ignores_mismatched_keys_and_drops_records_no_listing_would_show(etcd_server):
    _watch(Harness("etcd", etcd_server))


# ---- Redis: keys planted with another type ----

@run
async def _wrong_types(h: Harness):
    c = h.cluster
    with h.server.admin() as r:
        r.set(f"kvd:{c}:req:r1", "a string where a hash goes")
        r.set(f"kvd:{c}:nodes:version", "not a number")
        r.set(f"kvd:{c}:nodes", "a string where the index goes")
    b = h.backend()
    try:
        assert (await b.holders("r1"))[1] == [] and b.dropped[("holder", "undecodable")] == 1
        s = await b.open_session(30)
        assert isinstance(await b.register_node(s, node("a")), Registered)
        with h.server.admin() as r:
            r.hset(f"kvd:{c}:node:h", "x", "y")  # a hash under a node key, listed in the index
            r.zadd(f"kvd:{c}:nodes", {f"kvd:{c}:node:h": int(time.time() * 1000) + 60_000,
                                      "elsewhere:secret": int(time.time() * 1000) + 60_000})
        assert [x.node_id for x in (await b.list_nodes())[1]] == ["a"]
        assert b.dropped[("node", "undecodable")] == 1 and b.dropped[("node", "key_mismatch")] == 1
        await b.publish_batch(s, [Publish(holder("r1"))])
        assert [x.node_id for x in (await b.holders("r1"))[1]] == ["a"]
    finally:
        await h.close_all()


def test_redis_keys_planted_with_another_type_fail_no_read_or_write(redis_server):
    _wrong_types(Harness("redis", redis_server))
