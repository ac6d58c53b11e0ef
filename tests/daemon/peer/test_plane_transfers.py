"""kvd.daemon.transfer.machine on a link with a one-sided plane (PROTOCOL.md 2.2b), without sockets: two
machines (`pair.py`) whose plane is the harness's in-memory one, each with the daemon's own plane
I/O (`PlaneIO`) and its ledger. Bytes move between the two pools only as the test ends each
operation, so every scenario says when they land. Here: what goes on the plane and what does not, and
what is refused; test_plane_failures.py has what a failure leaves the plane to touch.
"""
from __future__ import annotations

import pytest

from kvd import errors
from kvd.daemon.store.entries import State
from kvd.daemon.transfer.states import (
    Commit,
    Connected,
    EntryReady,
    Progress,
    Published,
    ReceiverState,
    SenderState,
    WaitForEntry,
    Written,
)
from kvd.wire import protocol as p
from kvd.wire.layout import TensorSpec, physical_segments

from .pair import (
    BLOCK,
    IN_FLIGHT,
    PLANE,
    PLANE_MIN,
    SLICE,
    assert_nothing_held,
    blocks,
    data_of,
    deliver,
    lent_pull,
    pair,
    push,
    quiet,
    raw,
    settle,
    types,
)
from .pair import (
    PLANE_SIZE as SIZE,
)

# --- the happy paths -------------------------------------------------------------------------------

def test_a_push_on_the_plane_is_granted_written_slice_by_slice_and_said_placed():
    a, b, _ = pair(plane=True, validate=True)
    payload = data_of(SIZE)
    entry = a.entry("r", payload)
    out = push(a, b, entry)
    a.handle(Connected(out.xfer))
    offer = a.sent[0]
    assert types(a.sent) == ["offer"] and out.state is SenderState.ASKED  # no byte goes before the grant
    assert offer.plane == PLANE and offer.lengths is None and offer.chunk_size == SLICE and offer.sealed
    deliver(a, b)
    grant = b.sent[0]
    arriving = b.store.entries["r"]
    assert types(b.sent) == ["grant"] and arriving.writer  # pinned for the sender's plane
    assert [tuple(r) for r in grant.regions] == physical_segments(arriving.extents, BLOCK, 0, SIZE)
    assert out.state is SenderState.PLACING and [op.op for op in a.ops.pending] == ["write"] * IN_FLIGHT
    assert b.read(arriving) != payload  # nothing has landed yet
    ended = 0
    while a.ops.pending or not quiet(a, b):
        if a.ops.pending:
            a.complete(a.ops.pending[-1])  # the younger write ends first
            ended += 1
            assert a.sent[-1].TYPE == "placed"  # said placed once it ended, not before
        deliver(a, b)
    assert ended == 4 and types(a.sent) == ["offer"] + ["placed"] * 4
    assert types(b.sent) == ["grant", "done"]  # no ack per slice: the ranges were all granted up front
    assert b.store.ready("r") is arriving and b.read(arriving) == payload and not arriving.writer
    assert out.state is SenderState.DONE and [f.error for f in a.finished()] == [None]
    assert entry.removed and "r" not in a.store.entries
    assert [f.error for f in b.finished()] == [None]
    assert_nothing_held(a, b)


def test_the_slices_ride_the_plane_between_fragmented_pools():
    """Each side's blocks are split where its own pool split them: a slice's pieces are paired up
    across both splits, and every byte lands where the grant said."""
    a, b, _ = pair(plane=True, validate=True)
    for side, pattern in ((a, (1, 2, 3)), (b, (2, 3, 1))):  # both pools full, then holes of 1-3 blocks
        fillers, i = [], 0
        while side.store.allocator.free_blocks:
            n = min(pattern[i % 3], side.store.allocator.free_blocks)
            fillers.append(side.entry(f"f{i}", data_of(BLOCK * n, i)))
            i += 1
        for filler in fillers[::2]:
            side.store.remove(filler)
    payload = data_of(SIZE, 7)
    entry = a.entry("r", payload)
    assert len(entry.extents) > 1
    out = push(a, b, entry)
    a.handle(Connected(out.xfer))
    settle(a, b)
    assert len(b.store.ready("r").extents) > 1 and b.read(b.store.ready("r")) == payload
    assert out.state is SenderState.DONE


def test_a_stream_on_the_plane_is_written_tensor_by_tensor_and_published_after_its_seal():
    a, b, _ = pair(plane=True, validate=True)
    sizes = [6000, 7000, 9000]  # 22000 bytes: three slices, cut where the tensors were written
    entry = a.store.reserve("s", [TensorSpec(f"l{i}", "uint8", (n,)) for i, n in enumerate(sizes)], None, None,
                            State.WRITING, None)
    whole = data_of(entry.total_bytes, 3)
    out = push(a, b, entry, sealed=False)

    def write(index: int) -> None:
        lo, hi = entry.tensor_ranges()[index]
        pos = lo
        for offset, length in physical_segments(entry.extents, BLOCK, lo, hi - lo):
            a.pool[offset:offset + length] = whole[pos:pos + length]
            pos += length
        a.handle(Written(out.xfer, [(lo, hi - lo)]))

    write(0)  # before the link is up: queued
    a.handle(Connected(out.xfer))
    assert out.state is SenderState.STREAM_ASKED and types(a.sent) == ["offer"] and not a.sent[0].sealed
    write(1)  # before the grant: queued too
    assert not a.ops.pending
    deliver(a, b)
    assert out.state is SenderState.STREAM_PLACING and len(a.ops.pending) == IN_FLIGHT
    settle(a, b)
    arriving = b.store.entries["s"]
    progress = [set(e.indices) for e in b.events if isinstance(e, Progress) and e.indices]
    assert progress == [{0}, {1}]  # each tensor told as it completed
    write(2)
    settle(a, b)
    assert arriving.state is State.RECEIVING and not any(isinstance(e, Published) for e in b.events)
    a.store.publish(entry)
    a.handle(Commit(out.xfer))
    assert a.sent[-1].TYPE == "seal" and out.state is SenderState.PLACING
    settle(a, b)
    assert b.store.ready("s") is arriving and raw(b, arriving) == whole
    assert out.state is SenderState.DONE and entry.removed
    assert_nothing_held(a, b)


@pytest.mark.parametrize("keep", [False, True])
def test_a_pull_on_the_plane_is_lent_read_slice_by_slice_and_ended_by_done(keep):
    a, b, entry, out, inbound = lent_pull(keep=keep)
    offer = a.sent[0]
    assert offer.plane == PLANE and offer.lengths is None and offer.sealed and offer.chunk_size == SLICE
    assert [tuple(r) for r in offer.regions] == physical_segments(entry.extents, BLOCK, 0, SIZE)
    assert [s[:2] for s in offer.slices] == [[i * SLICE, min(SLICE, SIZE - i * SLICE)] for i in range(4)]
    assert inbound.entry.writer and [op.op for op in b.ops.pending] == ["read"] * IN_FLIGHT
    assert types(b.sent) == ["pull"]  # the reads need no message
    b.complete(b.ops.pending[1])
    assert len(b.ops.pending) == IN_FLIGHT  # the next read goes as one ends
    settle(a, b)
    assert types(b.sent) == ["pull", "done"] and types(a.sent) == ["offer"]
    assert inbound.state is ReceiverState.DONE and b.read(b.store.ready("r")) == data_of(SIZE)
    assert out.state is SenderState.DONE and entry.removed != keep
    assert_nothing_held(a, b)


@pytest.mark.parametrize("how", ["push", "pull"])
def test_an_entry_under_the_planes_minimum_goes_as_frames_on_a_plane_link(how):
    a, b, _ = pair(plane=True, validate=True)
    payload = data_of(PLANE_MIN - 1)
    entry = a.entry("small", payload)
    if how == "push":
        out = push(a, b, entry)
        a.handle(Connected(out.xfer))
    else:
        _inbound, actions = b.machine.start_pull("small", a.channel, timeout=3.0, keep=False)
        b.run(actions)
        deliver(a, b)
        out = next(e for e in a.events if isinstance(e, WaitForEntry)).transfer
        a.handle(EntryReady(out.xfer, entry))
    deliver(a, b)
    assert "chunk" in types(a.sent) and not {"placed", "grant"} & set(types(a.sent) + types(b.sent))
    assert all(m.plane is None for m in a.sent if isinstance(m, p.Offer))
    assert not a.ops.pending and not b.ops.pending
    assert out.plane is None and out.state is SenderState.DONE and b.read(b.store.ready("small")) == payload


def test_a_stream_pulled_on_a_plane_link_goes_as_frames():
    """A pulled entry still being written is offered as a stream, and a plane lends sealed entries only."""
    a, b, _ = pair(plane=True, validate=True)
    entry = a.store.reserve("w", [TensorSpec("x", "uint8", (2 * PLANE_MIN,))], None, None, State.WRITING, None)
    _inbound, actions = b.machine.start_pull("w", a.channel, timeout=3.0, keep=False)
    b.run(actions)
    deliver(a, b)
    out = next(e for e in a.events if isinstance(e, WaitForEntry)).transfer
    a.handle(EntryReady(out.xfer, entry))
    assert out.state is SenderState.STREAM_OFFERED and a.sent[0].plane is None


# --- refusals --------------------------------------------------------------------------------------

@pytest.mark.parametrize("regions", [[[0, SIZE - 1]], [[0, SIZE], [SIZE, 1]], [[0, -5]], [[0]], "all"])
def test_a_grant_whose_ranges_do_not_hold_the_entry_is_refused(regions):
    a, b, _ = pair(plane=True, validate=True)
    entry = a.entry("r", data_of(SIZE))
    out = push(a, b, entry)
    a.handle(Connected(out.xfer))
    deliver(a, b, drop=lambda side, msg: side is a)
    grant = b.sent[0]
    arriving = b.store.entries["r"]
    a.run(a.machine.handle(p.Grant(xfer=grant.xfer, regions=regions), b.channel))
    assert out.state is SenderState.FAILED and isinstance(a.finished()[0].error, errors.ProtocolError)
    assert not a.ops.pending and types(a.sent) == ["offer", "abort", "released"]  # nothing was written
    assert entry.state is State.READY and not entry.leases  # no operation ran: the lease goes at once
    b.receive(b.channel.key)  # the abort: B's granted blocks stay parked until the sender's word
    assert arriving.removed and b.store.parked_bytes == blocks(arriving) * BLOCK
    b.receive(b.channel.key)  # released
    assert_nothing_held(a, b)


def test_a_plane_offer_on_a_link_without_that_plane_is_refused():
    a, b, _ = pair(plane=True, validate=True)
    offer = p.Offer(xfer=3, request_id="r", tensors=[["x", "uint8", [SIZE]]], total_bytes=SIZE, chunk_size=SLICE,
                    checksum="xxh3_64", sealed=True, plane="rdma-elsewhere")
    b.run(b.machine.handle(offer, a.channel))
    assert types(b.sent) == ["abort"] and b.sent[0].code == errors.ProtocolError.code
    assert "r" not in b.store.entries and b.store.allocator.free_blocks == 64
