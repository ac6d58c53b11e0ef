"""Signed registry records against memory, real etcd and real Redis: whoever can write to the
registry can no longer redirect a node, invent a holder, or lock a node out of its own id.

Each test plays the attacker with the registry's own write path (tests/cluster/conftest.py
`Harness.forge_node` / `forge_holder`: what anyone with write access can do), against members that
sign their records under one cluster CA and believe only what verifies."""
from __future__ import annotations

import asyncio
import time

from nacl.signing import SigningKey

from kvd.cluster.backends.backend import Added, Removed
from kvd.cluster.health import Breaker
from kvd.cluster.member import ClusterMember
from kvd.cluster.records import HolderRecord, NodeRecord
from kvd.cluster.signing import RecordSigner, RecordVerifier
from kvd.trust import Authority, NodeKeys, NodeSigner, issue

from .conftest import run

TTL = 1.0
EXPIRES = time.time() + 3600


class CA:
    def __init__(self, cluster: str) -> None:
        self.key, self.cluster = SigningKey.generate(), cluster

    def signer(self, node_id: str) -> NodeSigner:
        keys = NodeKeys.generate()
        cert = issue(bytes(self.key), node_id, self.cluster, keys.curve_public_raw, keys.sign_public, valid_for=3600)
        return NodeSigner(keys.sign_seed, cert)

    def verifier(self) -> RecordVerifier:
        return RecordVerifier(Authority(bytes(self.key.verify_key), self.cluster))


def record(nid: str, inc: int, port: int | None = None) -> NodeRecord:
    return NodeRecord(nid, inc, f"tcp://127.0.0.1:{port or 7000 + inc}")


def member(reg, ca: CA, nid: str, inc: int, signer: NodeSigner | None = None, **kw) -> ClusterMember:
    store: dict[str, HolderRecord] = {}
    m = ClusterMember(reg.backend(op_timeout=0.3), record(nid, inc), ttl=TTL, snapshot=lambda: list(store.values()),
                      breaker=Breaker(threshold=3, retry_after=0.3), resync_jitter=0,
                      signer=RecordSigner(signer or ca.signer(nid)), verifier=ca.verifier(), **kw)
    m.store = store
    return m


def put(m: ClusterMember, rid: str, gen: int = 1) -> None:
    m.store[rid] = HolderRecord(rid, m.record.node_id, m.record.incarnation, gen, 1024, expires_at=EXPIRES)
    m.publish(m.store[rid])


async def until(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"{what} not within {timeout} s"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


@run
async def _forged_node(reg):
    ca = CA(reg.cluster)
    a, b = member(reg, ca, "a", 1), member(reg, ca, "b", 2)
    events = []
    a.on_node_event = events.append
    try:
        await a.start()
        await b.start()
        assert await a.wait_registered(3) and await b.wait_registered(3)
        await until(lambda: a.node("b") is not None, 3, "b in a's view")
        real = a.node("b").endpoint
        # unsigned, and signed by another node of the same CA for its own id: neither redirects b
        evil = RecordSigner(ca.signer("evil"))
        for forged in (record("b", 2, port=6666), evil.node(record("b", 9, port=6666))):
            registrations, dropped = b.membership.registrations, sum(a.dropped().values())
            await reg.forge_node("b", forged)
            # b notices that its record changed and writes it again, within 2 x TTL
            took = await until(lambda: b.membership.registrations > registrations and b.membership.registered,
                               2 * TTL + 1, "b writing its own record again")
            assert took <= 2 * TTL + 0.5
            await until(lambda: sum(a.dropped().values()) > dropped, 3, "a dropping the forgery")
            await until(lambda: a.node("b") is not None, 3, "b back in a's view")
            assert a.node("b").endpoint == real
            assert all(not (isinstance(e, Added) and e.node.endpoint.endswith(":6666")) for e in events)
        assert set(a.status()["dropped"]) >= {"node:unsigned", "node:wrong_node"}, a.status()
        assert any(isinstance(e, Removed) for e in events)
    finally:
        await a.stop()
        await b.stop()


def test_a_forged_node_record_is_dropped_and_its_node_writes_its_own_again(reg):
    _forged_node(reg)


@run
async def _fake_holders(reg):
    ca = CA(reg.cluster)
    a, b = member(reg, ca, "a", 1), member(reg, ca, "b", 2)
    try:
        await a.start()
        await b.start()
        assert await a.wait_registered(3) and await b.wait_registered(3)
        await until(lambda: a.node("b") is not None, 3, "b in a's view")
        put(b, "real")
        assert [c.node.node_id for c in await a.find("real", 2)] == ["b"]
        # holders nobody signed, or signed by another node than they name, are no candidates at all
        evil = RecordSigner(ca.signer("evil"))
        fake = HolderRecord("fake", "b", 2, 7, 1 << 60, expires_at=None)
        await reg.forge_holder(fake)
        await reg.forge_holder(HolderRecord("real", "b", 2, 99, 1 << 60, expires_at=None, sig=evil.holder(fake).sig))
        assert await a.locate("fake") == []
        assert await a.locate("real") == []  # (it replaced b's genuine record: a miss, never gen 99)
        assert a.status()["dropped"].get("holder:unsigned", 0) >= 1
    finally:
        await a.stop()
        await b.stop()


def test_a_holder_record_its_node_did_not_sign_is_never_a_candidate(reg):
    _fake_holders(reg)


@run
async def _lockout(reg):
    ca = CA(reg.cluster)
    signer = ca.signer("b")
    # left by hand without a lease (or a TTL): it would outlive every b for good
    await reg.forge_node("b", record("b", 77, port=6666), leased=False)
    b = member(reg, ca, "b", 2, signer)
    try:
        await b.start()
        assert await b.wait_registered(3), b.status()
    finally:
        await b.stop()
    # under a lease the attacker keeps alive, but not signed: replaced too
    attacker = reg.backend()
    session = await attacker.open_session(5.0)
    await attacker.register_node(session, record("b", 78, port=6666))
    b = member(reg, ca, "b", 3, signer)
    try:
        await b.start()
        assert await b.wait_registered(3), b.status()
        assert (await attacker.get_node("b")).incarnation == 3
    finally:
        await b.stop()
        await session.close()


def test_a_forged_record_under_a_nodes_id_cannot_lock_it_out(reg):
    _lockout(reg)


@run
async def _duplicate(reg):
    """A record that does verify is a live daemon of that id: R7 holds (never taken over)."""
    ca = CA(reg.cluster)
    signer = ca.signer("b")
    first, second = member(reg, ca, "b", 1, signer), member(reg, ca, "b", 2, signer)
    try:
        await first.start()
        assert await first.wait_registered(3)
        await second.start()
        assert not await second.wait_registered(1.5)
        assert second.status()["state"] == "conflict" and first.status()["registered"]
    finally:
        await second.stop()
        await first.stop()


def test_a_verified_duplicate_still_never_takes_a_live_node_id(reg):
    _duplicate(reg)


@run
async def _missing_node(reg):
    ca = CA(reg.cluster)
    a, ghost = member(reg, ca, "a", 1), RecordSigner(ca.signer("ghost"))
    try:
        await a.start()
        assert await a.wait_registered(3)
        await reg.forge_holder(ghost.holder(HolderRecord("r", "ghost", 5, 1, 10, expires_at=EXPIRES)))
        t0, lookups = time.monotonic(), 0
        while time.monotonic() - t0 < 1.0:  # gets waiting on a holder whose node is not registered
            assert await a.locate("r") == []
            lookups += 1
            await asyncio.sleep(0.05)
        assert lookups >= 5, f"only {lookups} lookups in 1 s: too few to tell 'per backoff' from 'per lookup'"
        assert a.ops[("get_node", "ok")] <= 2, a.ops  # once per backoff (0.5 s, then 1 s), not per lookup
        assert a.ops[("list_nodes", "ok")] == 0
    finally:
        await a.stop()


def test_a_holder_of_an_unknown_node_costs_one_lookup_per_backoff(reg):
    _missing_node(reg)


@run
async def _router_view(reg):
    from kvd.cluster import Registry

    ca = CA(reg.cluster)
    b = member(reg, ca, "b", 2)
    try:
        await b.start()
        assert await b.wait_registered(3)
        put(b, "real")
        await reg.forge_node("ghost", record("ghost", 9, port=6666))  # unsigned, under a lease of its own
        await reg.forge_holder(HolderRecord("fake", "b", 2, 7, 10, expires_at=None))
        async with Registry(reg.url, cluster=reg.cluster, ca=bytes(ca.key.verify_key)) as router, \
                Registry(reg.url, cluster=reg.cluster) as blind:
            assert [n.node_id for n in await router.nodes()] == ["b"]
            assert {n.node_id for n in await blind.nodes()} == {"b", "ghost"}  # (without the CA: hints)
            t0 = time.monotonic()
            while not await router.locate("real"):
                assert time.monotonic() - t0 < 3, "b's holder record never showed"
                await asyncio.sleep(0.05)
            assert [c.node.node_id for c in await router.locate("real")] == ["b"]
            assert await router.locate("fake") == [] and len(await blind.locate("fake")) == 1
    finally:
        await b.stop()


def test_a_router_with_the_ca_believes_only_what_verifies(reg):
    if reg.kind == "memory":
        import pytest
        pytest.skip("a Registry opens a URL: etcd and Redis only")
    _router_view(reg)
