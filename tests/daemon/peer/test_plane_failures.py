"""kvd.daemon.transfer.machine on a plane, when a transfer fails (the harness of `pair.py`, its
in-memory plane and each side's `PlaneIO`): what a one-sided plane may still touch is never given to
anyone else. A receiver's granted blocks stay parked until the sender says `released` (or restarts),
a sender's leased ones until its own writes ended, a puller's until its reads ended, a holder's lent
ones until the puller's `released`; and a slice that fails its digest is never published.
"""
from __future__ import annotations

import pytest

from kvd import errors
from kvd.daemon.store.entries import State
from kvd.daemon.transfer.states import (
    Cancel,
    ChannelLost,
    EntryReady,
    Published,
    ReceiverState,
    SenderState,
    Tick,
    WaitForEntry,
)
from kvd.wire import protocol as p

from .pair import (
    BLOCK,
    FIRST,
    PLANE,
    SECOND,
    TIMEOUT,
    assert_nothing_held,
    blocks,
    data_of,
    deliver,
    granted_push,
    lent_pull,
    pair,
    settle,
    types,
)
from .pair import (
    PLANE_SIZE as SIZE,
)

# --- what may still land after a failure -------------------------------------------------------------

@pytest.mark.parametrize("corrupt", ["receiver", "sender"])
def test_a_placed_slice_whose_digest_does_not_match_fails_the_transfer_and_publishes_nothing(corrupt):
    a, b, entry, out, arriving = granted_push()
    first = a.ops.pending[0]
    if corrupt == "sender":  # a block changed on the sender after its digest was taken
        a.pool[first.local[0][0]] ^= 0xFF
        a.complete(first)
    else:  # ... or on the receiver after the write landed
        a.complete(first)
        b.pool[first.remote[-1][0] + first.remote[-1][1] - 1] ^= 0x01
    b.receive(b.channel.key)  # placed
    assert types(b.sent) == ["grant", "abort"] and b.sent[-1].code == errors.ChecksumMismatch.code
    assert "r" not in b.store.entries and not any(isinstance(e, Published) for e in b.events)
    assert b.store.parked_bytes == blocks(arriving) * BLOCK  # the other write may still land in them
    a.receive(a.channel.key)  # the abort
    assert out.state is SenderState.FAILED and isinstance(a.finished()[0].error, errors.ChecksumMismatch)
    assert entry.leases and "released" not in types(a.sent)  # writes still run from its blocks
    a.complete_all()  # they land, in the parked blocks
    assert not entry.leases and a.sent[-1].TYPE == "released" and entry.state is State.READY
    deliver(a, b)
    assert_nothing_held(a, b)


@pytest.mark.parametrize("landed", [0, 1])
def test_a_write_that_failed_fails_the_push_and_its_blocks_wait_for_every_write(landed):
    a, b, _entry, out, arriving = granted_push()
    free_before, granted = b.store.allocator.free_blocks, blocks(arriving)
    failed, running = a.ops.pending
    a.complete(failed, errors.PeerUnavailable("the UCX endpoint failed"), landed=landed)
    assert out.state is SenderState.FAILED and types(a.sent) == ["offer", "abort"]
    assert "write of slice 0 failed" in a.finished()[0].error.message
    token = out.lease_token
    assert a.store.lease_of(token) is not None and a.plane.summary()["draining"] == 1
    deliver(a, b)
    assert arriving.removed and b.store.parked_bytes == blocks(arriving) * BLOCK
    # the parked blocks are nobody else's: a put that needs them does not get them
    with pytest.raises(errors.PoolFull):
        b.entry("other", bytes(free_before * BLOCK + 1))
    b.entry("fits", data_of(free_before * BLOCK, 9))
    a.complete(running)  # the other write ends late: it lands in blocks still parked for it
    assert a.store.lease_of(token) is None and a.sent[-1].TYPE == "released"
    assert b.read(b.store.entries["fits"]) == data_of(free_before * BLOCK, 9)
    deliver(a, b)
    assert b.store.parked_bytes == 0 and b.store.allocator.free_blocks == granted
    assert_nothing_held(a, b)


def test_a_read_that_failed_fails_the_pull_and_the_holder_keeps_its_blocks_until_released():
    a, b, entry, out, inbound = lent_pull()
    failed, running = b.ops.pending
    b.complete(running)  # slice 1 lands; it is checked, then slice 2 is read
    b.complete(failed, errors.PeerUnavailable("remote access error"))
    assert inbound.state is ReceiverState.FAILED and types(b.sent) == ["pull", "abort"]
    assert b.store.parked_bytes == blocks(inbound.entry) * BLOCK  # slice 2's read still lands there
    deliver(a, b)
    assert out.state is SenderState.FAILED and entry.state is State.READY  # the entry is back for others...
    assert entry.leases  # ... but its blocks stay lent until the puller's word
    assert a.plane.summary()["parked"] == 1
    b.complete()
    assert b.sent[-1].TYPE == "released" and b.store.parked_bytes == 0
    deliver(a, b)
    assert not entry.leases
    assert_nothing_held(a, b)


def test_a_sender_that_fails_mid_write_keeps_its_lease_until_its_writes_ended():
    a, b, entry, out, _arriving = granted_push()
    a.handle(Cancel(out.xfer, errors.NotFound("request 'r' was deleted on A")))
    assert out.state is SenderState.FAILED and entry.leases  # two writes still read its blocks
    a.complete()
    assert entry.leases and "released" not in types(a.sent)
    a.complete()
    assert not entry.leases and types(a.sent)[-2:] == ["abort", "released"]
    settle(a, b)
    assert_nothing_held(a, b)


@pytest.mark.parametrize("who", ["receiver", "sender"])
def test_a_lost_connection_mid_write_parks_the_granted_blocks_until_released(who):
    a, b, _entry, out, arriving = granted_push()
    a.complete()
    deliver(a, b)  # slice 0 placed and acknowledged
    lost = [b] if who == "receiver" else [a]
    for side in lost:
        side.handle(ChannelLost(side.peer.channel.key if side is a else a.channel.key, "connection lost"))
    deliver(a, b)  # the other side hears the abort
    assert out.state is SenderState.FAILED and "r" not in b.store.entries
    assert b.store.parked_bytes == blocks(arriving) * BLOCK
    settle(a, b)  # the writes end, then A says released
    assert_nothing_held(a, b)


def test_a_writer_that_restarted_releases_what_was_parked_for_it():
    """A daemon that died mid-write posts nothing more: once its new incarnation says hello, its
    peer lets go of the blocks it had granted the old one (no `released` will ever come)."""
    a, b, _entry, _out, arriving = granted_push()
    b.handle(ChannelLost(a.channel.key, "peer A stopped answering"))
    assert b.store.parked_bytes == blocks(arriving) * BLOCK and b.plane.summary()["parked"] == 1
    a.restart()
    assert b.store.parked_bytes == 0 and b.store.allocator.free_blocks == 64 and not b.plane.ledger.parked


def test_a_puller_that_restarted_releases_the_blocks_lent_to_it():
    a, b, entry, out, _inbound = lent_pull()
    a.handle(ChannelLost(b.channel.key, "peer B stopped answering"))
    assert out.state is SenderState.FAILED and entry.leases and a.plane.summary()["parked"] == 1
    b.restart()
    assert not entry.leases and entry.state is State.READY and not a.plane.ledger.parked


def test_a_pull_that_fails_before_the_offer_still_says_released():
    """The holder may have lent its blocks already (its offer on the way): a puller that gives up
    while pulling still says it will read nothing, or those blocks would stay lent for good."""
    a, b, _ = pair(plane=True, validate=True)
    entry = a.entry("r", data_of(SIZE))
    inbound, actions = b.machine.start_pull("r", a.channel, timeout=3.0, keep=False)
    b.run(actions)
    deliver(a, b)
    out = next(e for e in a.events if isinstance(e, WaitForEntry)).transfer
    a.handle(EntryReady(out.xfer, entry))  # lent: the offer is on its way
    b.handle(Cancel(inbound.xfer, errors.Timeout("the client gave up")))
    assert inbound.state is ReceiverState.FAILED and types(b.sent) == ["pull", "abort", "released"]
    a.receive(a.channel.key)  # the abort: what the holder lent stays lent...
    assert out.state is SenderState.FAILED and entry.leases and a.plane.summary()["parked"] == 1
    deliver(a, b)  # ... until released (which comes on B's own link)
    assert not entry.leases and entry.state is State.READY and not a.plane.ledger.parked


def test_a_lend_that_comes_after_its_pull_ended_is_dropped():
    """The holder's offer lending its blocks crosses the puller's abort: it names a pull that is no
    more, and is no push to grant (granted, its blocks would wait for a `released` that the holder,
    which never wrote a byte, would never send: parked for good)."""
    a, b, clock = pair(plane=True, validate=True)
    entry = a.entry("r", data_of(SIZE))
    inbound, actions = b.machine.start_pull("r", a.channel, timeout=3.0, keep=False)
    b.run(actions)
    deliver(a, b)
    out = next(e for e in a.events if isinstance(e, WaitForEntry)).transfer
    a.handle(EntryReady(out.xfer, entry))
    b.handle(Cancel(inbound.xfer, errors.Timeout("the client gave up")))
    settle(a, b)
    assert types(b.sent) == ["pull", "abort", "released"] and not b.machine.transfers
    assert "r" not in b.store.entries and b.store.allocator.free_blocks == 64
    clock.now += 2 * TIMEOUT
    for side in (a, b):
        side.handle(Tick(clock.now))
    settle(a, b)
    assert_nothing_held(a, b)


def test_released_from_another_peer_releases_nothing():
    a, b, _entry, out, arriving = granted_push()
    b.handle(ChannelLost(a.channel.key, "connection lost"))
    stranger = type(a.channel)(("router", b"C"), "C", None, lambda: False)
    stranger.plane, stranger.plane_agent = PLANE, "agent-C"
    b.plane.released(stranger, out.xfer)
    assert b.store.parked_bytes == blocks(arriving) * BLOCK


def test_a_holder_that_deletes_what_it_lent_keeps_its_blocks_until_the_puller_read_no_more():
    a, b, entry, out, inbound = lent_pull()
    a.store.remove(entry)  # a client deleted it on the holder
    a.handle(Cancel(out.xfer, errors.NotFound("request 'r' was deleted on A")))
    assert out.state is SenderState.FAILED and entry.leases and a.store.parked_bytes == blocks(entry) * BLOCK
    deliver(a, b)  # the puller hears of it; its reads still run
    assert inbound.state is ReceiverState.FAILED and b.ops.pending and entry.leases
    b.complete()
    assert entry.leases  # one read still runs
    settle(a, b)
    assert a.store.parked_bytes == 0 and not entry.leases
    assert_nothing_held(a, b)


def test_a_puller_that_gives_up_mid_read_says_released_once_its_reads_ended():
    a, b, entry, out, inbound = lent_pull()
    b.handle(Cancel(inbound.xfer, errors.Timeout("the client gave up")))
    assert types(b.sent) == ["pull", "abort"] and b.store.parked_bytes > 0  # its reads land in its blocks
    deliver(a, b)
    assert out.state is SenderState.FAILED and entry.leases
    b.complete_all()
    assert b.sent[-1].TYPE == "released" and b.store.parked_bytes == 0
    deliver(a, b)
    assert not entry.leases and entry.state is State.READY
    assert_nothing_held(a, b)


# --- known gaps, reported (each says what should hold; strict: it fails once it does) ----------------

@pytest.mark.parametrize("when", ["reading", "done sent"])
def test_a_lent_pull_that_fails_on_its_holder_as_its_puller_completes_frees_its_blocks(when):
    a, b, clock = pair(plane=True, validate=True)
    entry = a.entry("r", data_of(SIZE))
    inbound, actions = b.machine.start_pull("r", a.channel, timeout=3.0, keep=True)
    b.run(actions)
    deliver(a, b)
    out = next(e for e in a.events if isinstance(e, WaitForEntry)).transfer
    a.handle(EntryReady(out.xfer, entry))
    deliver(a, b)
    if when == "reading":  # a client deletes it on the holder while the puller's last reads run
        a.handle(Cancel(out.xfer, errors.NotFound("request 'r' was deleted on A")))
        b.complete_all()
    else:  # the puller has it all, and its done is on its way as the holder's clock passes a timeout:
        b.complete_all()  # a lent pull is the puller's to time, so the holder waits for its word
        clock.now += TIMEOUT + 1
        a.handle(Tick(clock.now))
    assert inbound.state is ReceiverState.DONE
    assert out.state is (SenderState.FAILED if when == "reading" else SenderState.LENT)
    settle(a, b)  # the done comes for a transfer that ended (or ends it), the abort for one that ended
    assert_nothing_held(a, b)


def test_a_pull_whose_reads_keep_making_progress_outlives_the_transfer_timeout():
    a, b, clock = pair(plane=True, validate=True)
    entry = a.entry("r", data_of(SIZE))
    inbound, actions = b.machine.start_pull("r", a.channel, timeout=3.0, keep=False)
    b.run(actions)
    deliver(a, b)
    out = next(e for e in a.events if isinstance(e, WaitForEntry)).transfer
    a.handle(EntryReady(out.xfer, entry))
    deliver(a, b)
    while b.ops.pending:  # each read takes 0.6 of the timeout: 4 of them, 2 at a time
        clock.now += 0.6 * TIMEOUT
        for side in (a, b):
            side.handle(Tick(clock.now))
        b.complete()
        deliver(a, b)
    assert inbound.state is ReceiverState.DONE and out.state is SenderState.DONE


def test_two_holds_parked_under_one_transfer_id_are_both_released_by_the_peers_restart():
    a, b, _entry, out, arriving = granted_push()
    offer = next(m for m in a.sent if isinstance(m, p.Offer))
    b.handle(Cancel(out.xfer, errors.NotFound("deleted on B")))  # parked for A's writes
    b.on_message(b.channel.key, offer)  # the same offer again: a new transfer under that id, granted
    b.handle(Cancel(out.xfer, errors.NotFound("deleted on B")))  # parked too
    assert b.store.parked_bytes == 2 * blocks(arriving) * BLOCK
    a.restart()
    assert b.store.parked_bytes == 0


def test_a_released_lost_with_its_connection_is_asked_for_again():
    """B lent r1 to A's pull; A gave up (its abort and released queued on its link) and the connection
    dropped with both: B's lease is parked for a word that is gone. B asks again (an abort for the
    transfer, on its own link, once a transfer timeout passed); A, whose plane is done with it, says
    released."""
    a, b, clock = pair(plane=True, validate=True)
    entry = b.entry("r1", data_of(SIZE))
    inbound, actions = a.machine.start_pull("r1", b.channel, timeout=3.0, keep=False)
    a.run(actions)
    b.receive(FIRST)  # the pull
    out = next(e for e in b.events if isinstance(e, WaitForEntry)).transfer
    b.handle(EntryReady(out.xfer, entry))  # lent: B's offer is on its way
    a.handle(Cancel(inbound.xfer, errors.Timeout("the client gave up")))  # abort and released queued to B
    a.inboxes[FIRST].clear()
    b.inboxes[FIRST].clear()  # the connection drops with both queues
    for side in (a, b):
        side.handle(ChannelLost(FIRST, "connection lost"))
    a.inboxes[FIRST].clear()
    b.inboxes[FIRST].clear()  # (B's abort went on the dead connection too)
    settle(a, b)
    assert entry.leases and b.plane.summary()["parked"] == 1
    b.plane.tick(clock.now + 1, tear_down=lambda agent: None)  # too soon to ask
    assert not b.inboxes[SECOND] and not a.inboxes[SECOND]
    clock.now += TIMEOUT + 1
    b.plane.tick(clock.now, tear_down=lambda agent: None)
    assert types(a.inboxes[SECOND]) == ["abort"]  # B asks on its own link
    settle(a, b)
    assert not entry.leases and not b.plane.ledger.parked and entry.state is State.READY
