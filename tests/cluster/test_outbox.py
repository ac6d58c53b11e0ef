"""The outbox, candidate ordering, breaker and membership state: pure, with a hand-stepped clock."""
from __future__ import annotations

import pytest

from kvd.cluster.backends.backend import Publish, Unpublish
from kvd.cluster.candidates import order_candidates
from kvd.cluster.health import CONFLICT, REGISTERED, UNREGISTERED, Breaker, Membership
from kvd.cluster.outbox import Outbox
from kvd.cluster.records import HolderRecord, NodeRecord


def h(rid: str, gen: int = 1, node: str = "a", inc: int = 1, **kw) -> HolderRecord:
    return HolderRecord(rid, node, inc, gen, 100, **kw)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# ---- outbox ----

def test_last_state_wins_and_pending_pairs_cancel():
    ob = Outbox()
    ob.publish(h("r1", 1))
    ob.publish(h("r1", 2))
    ob.publish(h("r2"))
    ob.unpublish("r2")  # never written: nothing to send
    assert ob.take() == [Publish(h("r1", 2))]
    ob.done([Publish(h("r1", 2))])
    assert ob.take() == [] and ob.idle


def test_unpublish_names_the_written_record_and_a_stale_gen_is_ignored():
    ob = Outbox()
    ob.publish(h("r", 1))
    ob.done(ob.take())
    ob.unpublish("r", gen=5)  # a release of some other entry of r: ignored
    assert ob.take() == []
    ob.publish(h("r", 2))
    ob.unpublish("r", gen=1)  # late release of the old entry: must not withdraw gen 2
    assert ob.take() == [Publish(h("r", 2))]
    ob.done([Publish(h("r", 2))])
    ob.unpublish("r", gen=2)
    assert ob.take() == [Unpublish(h("r", 2))]  # conditional on exactly what was written
    ob.done([Unpublish(h("r", 2))])
    assert ob.published == {}


def test_batches_are_bounded_and_one_op_per_rid_is_in_flight():
    ob = Outbox()
    for i in range(300):
        ob.publish(h(f"r{i}"))
    first = ob.take(128)
    assert len(first) == 128 and len(ob) == 172
    ob.publish(h("r0", 2))  # r0 is in flight: its new state waits for the ack
    second = ob.take(500)
    assert "r0" not in {op.record.rid for op in second} and len(second) == 172
    ob.done(first + second)
    assert ob.take() == [Publish(h("r0", 2))]


def test_failed_batches_are_requeued_unless_overtaken():
    ob = Outbox()
    ob.publish(h("r1"))
    ob.publish(h("r2"))
    ops = ob.take()
    ob.unpublish("r2")  # newer than the failed publish of r2
    ob.failed(ops)
    again = ob.take()
    assert again == [Publish(h("r1"))]  # r2: publish failed, then withdrawn: nothing to do
    assert ob.published == {}


def test_overflow_asks_for_a_resync_and_resync_reconciles():
    ob = Outbox(limit=3)
    ob.publish(h("old"))
    ob.done(ob.take())
    for i in range(4):
        ob.publish(h(f"r{i}"))
    assert ob.resync_needed and len(ob) == 0 and ob.overflows == 1
    ob.publish(h("ignored"))  # deltas are moot until the snapshot is read
    assert len(ob) == 0
    ob.resync([h("r1"), h("r3")])
    ops = ob.take()
    assert set(ops) == {Unpublish(h("old")), Publish(h("r1")), Publish(h("r3"))}
    ob.done(ops)
    assert set(ob.published) == {"r1", "r3"} and not ob.resync_needed


def test_resync_after_session_loss_republishes_everything():
    ob = Outbox()
    ob.publish(h("r1"))
    ob.done(ob.take())
    ob.resync([h("r1")])  # the registry was wiped: r1 must be written again
    assert ob.take() == [Publish(h("r1"))]


# ---- candidates ----

def node(nid: str, inc: int = 1, pool: int = 100, **labels) -> NodeRecord:
    return NodeRecord(nid, inc, f"tcp://{nid}:1", pool_bytes=pool, labels=labels)


def test_candidates_dropped():
    nodes = {n.node_id: n for n in [node("me"), node("a"), node("b", inc=2), node("lost"), node("s")]}
    holders = [h("r", node="me"), h("r", node="a"), h("r", node="b", inc=1), h("r", node="lost"),
               h("r", node="gone"), h("r", node="s", state="streaming"), h("r", node="a", expires_at=10.0)]
    got = order_candidates(holders, nodes, self_id="me", now=1000.0, lost={"lost"})
    assert [(c.node.node_id, c.holder.expires_at) for c in got] == [("a", None)]
    streaming = order_candidates(holders, nodes, self_id="me", now=1000.0, lost={"lost"}, allow_streaming=True)
    assert [c.node.node_id for c in streaming] == ["a", "s"]


def test_candidate_order_complete_zone_host_room_newest():
    nodes = {n.node_id: n for n in [
        node("far-big", pool=900, zone="z2"), node("zone", pool=10, zone="z1"),
        node("host", pool=10, zone="z1", host="h"), node("zone-big", pool=50, zone="z1"),
        node("stream", pool=999, zone="z1", host="h")]}
    holders = [h("r", node=n, expires_at=2000.0) for n in nodes if n != "stream"]
    holders.append(h("r", node="stream", state="streaming"))
    got = order_candidates(holders, nodes, self_id="me", now=0, labels={"zone": "z1", "host": "h"},
                           allow_streaming=True)
    assert [c.node.node_id for c in got] == ["host", "zone-big", "zone", "far-big", "stream"]
    newer = [h("r", node="zone", expires_at=3000.0), h("r", node="zone-big", expires_at=1000.0)]
    got = order_candidates(newer, nodes, self_id=None, now=0, free={"zone": 5, "zone-big": 5})
    assert [c.node.node_id for c in got] == ["zone", "zone-big"]


# ---- breaker ----

def test_breaker_opens_fails_fast_and_probes():
    clock = Clock()
    b = Breaker(threshold=3, retry_after=2.0, clock=clock)
    for _ in range(2):
        assert b.allow()
        b.failure()
    assert b.state == "closed" and b.allow()
    b.failure()
    assert b.state == "open" and not b.up and not b.allow()
    clock.t += 1.9
    assert not b.allow()
    clock.t += 0.1
    assert b.state == "half_open"
    assert b.allow() and not b.allow()  # one probe per window
    b.failure()  # the probe failed: wait another window
    clock.t += 1.0
    assert not b.allow()
    clock.t += 1.0
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow() and b.up


# ---- membership ----

def test_membership_conflict_is_reported_once_after_two_ttls():
    clock = Clock()
    m = Membership(ttl=5.0, clock=clock)
    assert not m.on_conflict() and m.state == CONFLICT
    clock.t += 9.9
    assert not m.on_conflict()
    clock.t += 0.1
    assert m.on_conflict()
    assert not m.on_conflict()  # logged once
    m.on_registered()
    assert m.state == REGISTERED and m.resync_needed and m.conflict_since is None


def test_membership_presumes_the_session_lost_after_a_ttl_without_refresh():
    clock = Clock()
    m = Membership(ttl=5.0, clock=clock)
    m.on_registered()
    m.on_resynced()
    clock.t += 4.0
    assert not m.on_refresh_failed() and m.registered
    m.on_refreshed()
    clock.t += 4.9
    assert not m.on_refresh_failed()
    clock.t += 0.1
    assert m.on_refresh_failed() and m.state == UNREGISTERED
    m.on_registered()
    assert m.resync_needed and m.registrations == 2  # re-register, then re-publish
    m.close()
    m.on_session_lost()
    assert m.state == "closed"


@pytest.mark.parametrize("n", [0, 1])
def test_membership_first_registration_publishes_too(n):
    m = Membership(ttl=1.0)
    for _ in range(n):
        m.on_session_lost()
    m.on_registered()
    assert m.resync_needed
