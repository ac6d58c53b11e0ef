"""kvd.daemon.transfer.machine: two transfer state machines driven against each other through
in-memory channels (`pair.py`), with no sockets, no tasks and no subprocesses; each scenario
is one the protocol names. test_transfer_properties.py drives the same pair at random, and
test_table.py checks the table itself.
"""
from __future__ import annotations

import pytest

from kvd import errors
from kvd.daemon.store.entries import State
from kvd.daemon.transfer.channel import Channel
from kvd.daemon.transfer.machine import EAGER_CHUNKS
from kvd.daemon.transfer.states import (
    Cancel,
    ChannelLost,
    Commit,
    Connected,
    ConnectFailed,
    Dropped,
    EntryMissing,
    EntryReady,
    Progress,
    Published,
    Received,
    ReceiverState,
    SenderState,
    Tick,
    WaitForEntry,
    Written,
)
from kvd.wire import protocol as p
from kvd.wire.layout import TensorSpec

from .pair import BLOCK, CHUNK, TIMEOUT, data_of, deliver, pair, push, queue_all, types

# --- the happy paths -------------------------------------------------------------------------------

def test_a_push_offers_sends_eagerly_is_accepted_and_ends_with_done():
    a, b, _ = pair()
    payload = data_of(5 * CHUNK - 100)  # 5 chunks, a window of 4
    entry = a.entry("r", payload)
    out = push(a, b, entry)
    queue_all(a, out, entry)
    assert out.state is SenderState.CONNECTING and a.sent == []  # nothing goes before the link is up
    a.handle(Connected(out.xfer))
    assert out.state is SenderState.OFFERED
    assert types(a.sent) == ["offer"] + ["chunk"] * EAGER_CHUNKS  # chunks go before the accept
    deliver(a, b)
    assert types(b.sent)[0] == "accept" and types(b.sent)[-1] == "done"
    assert types(b.sent).count("chunk_ack") == 4  # the last chunk is acknowledged by done
    received = b.store.ready("r")
    assert received is not None and b.read(received) == payload
    assert out.state is SenderState.DONE and [f.error for f in a.finished()] == [None]
    assert entry.removed and "r" not in a.store.entries  # consumed by the push
    assert [type(e).__name__ for e in b.events if not isinstance(e, (Progress, Received))] == ["Published", "Finished"]
    assert not a.machine.transfers and not b.machine.transfers


def test_a_small_sealed_entry_needs_no_accept_and_no_acks():
    a, b, _ = pair()
    entry = a.entry("small", data_of(2 * CHUNK))
    out = push(a, b, entry)
    queue_all(a, out, entry)
    a.handle(Connected(out.xfer))
    deliver(a, b)
    assert types(a.sent) == ["offer", "chunk", "chunk"]
    assert types(b.sent) == ["done"]  # three messages per small transfer, plus its done
    assert b.read(b.store.ready("small")) == data_of(2 * CHUNK)


def test_an_entry_of_one_chunk_goes_inside_its_offer_to_a_peer_that_takes_it():
    a, b, _ = pair(features=(p.INLINE_OFFER,))
    entry = a.entry("one", data_of(CHUNK - 5))
    out = push(a, b, entry)
    queue_all(a, out, entry)
    a.handle(Connected(out.xfer))
    deliver(a, b)
    assert types(a.sent) == ["offer"] and a.sent[0].lengths == [CHUNK - 5]  # one message each way
    assert types(b.sent) == ["done"]
    assert b.read(b.store.ready("one")) == data_of(CHUNK - 5)
    assert out.state is SenderState.DONE and a.finished()[0].error is None


@pytest.mark.parametrize("size, sealed", [(2 * CHUNK, True), (CHUNK, False)])
def test_only_a_sealed_entry_of_one_chunk_goes_inside_its_offer(size, sealed):
    a, b, _ = pair(features=(p.INLINE_OFFER,))
    entry = a.entry("r", data_of(size), state=State.READY if sealed else State.WRITING)
    out = push(a, b, entry, sealed=sealed)
    queue_all(a, out, entry)
    a.handle(Connected(out.xfer))
    if not sealed:
        a.handle(Commit(out.xfer))
    deliver(a, b)
    assert a.sent[0].lengths is None and "chunk" in types(a.sent)
    assert b.read(b.store.ready("r")) == data_of(size)


def test_a_v1_peer_is_never_sent_an_offer_with_its_entry_inside():
    a, b, _ = pair(features=())
    entry = a.entry("one", data_of(100))
    out = push(a, b, entry)
    queue_all(a, out, entry)
    a.handle(Connected(out.xfer))
    deliver(a, b)
    assert types(a.sent) == ["offer", "chunk"] and a.sent[0].lengths is None


@pytest.mark.parametrize("fault", ["bad_digest", "unsealed", "too_big"])
def test_a_broken_offer_with_its_entry_inside_is_aborted_and_leaves_nothing(fault):
    a, b, _ = pair(features=(p.INLINE_OFFER,))
    entry = a.entry("one", data_of(CHUNK))
    out = push(a, b, entry)
    queue_all(a, out, entry)
    a.handle(Connected(out.xfer))
    offer = a.sent[0]
    b.inbox.clear()
    if fault == "bad_digest":
        offer.digest ^= 1
    elif fault == "unsealed":
        offer.sealed = False
    else:
        offer.chunk_size = CHUNK // 2  # the entry is two chunks long by the offer's own measure
    b.run(b.machine.handle(offer, a.channel))
    abort = b.sent[-1]
    assert isinstance(abort, p.Abort) and abort.xfer == offer.xfer
    assert abort.code == (errors.ChecksumMismatch.code if fault == "bad_digest" else errors.ProtocolError.code)
    assert "one" not in b.store.entries and b.store.allocator.free_blocks == 64 and not b.machine.transfers
    a.inbox.clear()
    a.run(a.machine.handle(abort, b.channel))
    assert out.state is SenderState.FAILED and entry.state is State.READY


def test_a_stream_is_published_only_after_its_seal():
    a, b, _ = pair()
    layers = [data_of(3000, seed) for seed in range(3)]
    entry = a.store.reserve("stream", [TensorSpec(f"l{i}", "uint8", (3000,)) for i in range(3)], None, None,
                            State.WRITING, None)
    out = push(a, b, entry, sealed=False)
    a.handle(Connected(out.xfer))
    for i, layer in enumerate(layers):  # written layer by layer: each goes at once
        lo, hi = entry.tensor_ranges()[i]
        for offset, length in entry.segments(BLOCK)[i]:
            a.pool[offset:offset + length] = layer[:length]
        a.handle(Written(out.xfer, [(lo, hi - lo)]))
        deliver(a, b)
    arriving = b.store.entries["stream"]
    assert arriving.state is State.RECEIVING and not any(isinstance(e, Published) for e in b.events)
    assert [set(e.indices) for e in b.events if isinstance(e, Progress) and e.indices] == [{0}, {1}, {2}]
    a.store.publish(entry)  # the producer committed
    a.handle(Commit(out.xfer))
    assert a.sent[-1].TYPE == "seal"
    deliver(a, b)
    assert b.store.ready("stream") is arriving and any(isinstance(e, Published) for e in b.events)
    assert out.state is SenderState.DONE


def test_a_seal_before_the_offer_makes_a_sealed_offer_whose_chunks_all_go():
    """A stream committed before its link came up: many small chunks (one per tensor), sealed at
    once; a receiver answers a small sealed offer without accept, so every chunk must go eagerly."""
    a, b, _ = pair()
    entry = a.store.reserve("early", [TensorSpec(f"l{i}", "uint8", (1000,)) for i in range(5)], None, None,
                            State.WRITING, None)
    out = push(a, b, entry, sealed=False)
    for lo, hi in entry.tensor_ranges():
        a.handle(Written(out.xfer, [(lo, hi - lo)]))
    a.store.publish(entry)
    a.handle(Commit(out.xfer))
    assert a.sent == []
    a.handle(Connected(out.xfer))
    offer = a.sent[0]
    assert isinstance(offer, p.Offer) and offer.sealed
    assert types(a.sent[1:]) == ["chunk"] * 5  # more than EAGER_CHUNKS, all at once
    deliver(a, b)
    assert types(b.sent) == ["done"] and out.state is SenderState.DONE
    assert b.store.ready("early") is not None


def test_a_pull_waits_for_its_entry_then_is_served_and_the_holder_drops_its_copy():
    a, b, _ = pair()  # B pulls from A
    inbound, actions = b.machine.start_pull("later", a.channel, timeout=3.0, keep=False)
    b.run(actions)
    deliver(a, b)
    waits = [e for e in a.events if isinstance(e, WaitForEntry)]
    assert len(waits) == 1 and waits[0].transfer.state is SenderState.WAITING
    payload = data_of(3 * CHUNK)
    entry = a.entry("later", payload)  # it arrives on the holder
    a.handle(EntryReady(waits[0].transfer.xfer, entry))
    deliver(a, b)
    assert inbound.state is ReceiverState.DONE and b.read(inbound.entry) == payload
    assert entry.removed  # not keep: the holder's copy is gone once the puller has it
    assert [f.error for f in b.finished()] == [None]


def test_a_pull_of_something_that_never_comes_is_aborted_with_the_holders_error():
    a, b, _ = pair()
    inbound, actions = b.machine.start_pull("never", a.channel, timeout=1.0, keep=False)
    b.run(actions)
    deliver(a, b)
    out = next(e for e in a.events if isinstance(e, WaitForEntry)).transfer
    a.handle(EntryMissing(out.xfer, errors.Timeout("request 'never' did not arrive within the timeout")))
    deliver(a, b)
    assert inbound.state is ReceiverState.FAILED
    error = b.finished()[0].error
    assert isinstance(error, errors.Timeout) and error.remote == "A"


@pytest.mark.parametrize("timeout", [float("nan"), -1.0, 7200.0])
def test_a_pull_with_an_impossible_timeout_is_refused(timeout):
    a, b, _ = pair()
    a.run(a.machine.handle(p.Pull(xfer=9, request_id="x", timeout=timeout), b.channel))
    assert isinstance(a.sent[0], p.Abort) and a.sent[0].code == errors.BadRequest.code
    assert not a.machine.transfers


# --- what ends a transfer early -------------------------------------------------------------------

def test_an_abort_while_connecting_sends_nothing_but_the_abort_and_ends_the_claim():
    a, b, _ = pair()
    entry = a.entry("gone", data_of(CHUNK))
    out = push(a, b, entry)
    a.handle(Cancel(out.xfer, errors.NotFound("request 'gone' was deleted on A")))
    assert out.state is SenderState.FAILED
    assert types(a.sent) == ["abort"] and isinstance(a.finished()[0].error, errors.NotFound)
    assert entry.state is State.READY  # the push's claim ended; only its pin is left to release
    a.handle(Connected(out.xfer))  # the link came up too late: nothing happens
    assert types(a.sent) == ["abort"]


def test_a_link_that_fails_its_handshake_fails_the_push_without_a_word():
    a, b, _ = pair()
    entry = a.entry("unreachable", data_of(CHUNK))
    out = push(a, b, entry)
    a.handle(ConnectFailed(out.xfer, errors.PeerUnavailable("peer B did not answer within 5s")))
    assert a.sent == [] and isinstance(a.finished()[0].error, errors.PeerUnavailable)


@pytest.mark.parametrize("fault", ["duplicate", "out_of_range", "overlap", "bad_digest"])
def test_a_broken_chunk_fails_the_transfer_on_both_sides_and_nothing_is_published(fault):
    a, b, _ = pair()
    entry = a.entry("r", data_of(6 * CHUNK))
    out = push(a, b, entry)
    queue_all(a, out, entry)
    a.handle(Connected(out.xfer))
    offer, first = a.sent[0], a.sent[1]
    b.inbox.clear()
    b.run(b.machine.handle(offer, a.channel))
    b.run(b.machine.handle(first, a.channel))
    bad = {
        "duplicate": first,
        "out_of_range": p.Chunk(xfer=first.xfer, seq=7, offset=6 * CHUNK, lengths=[10], digest=0, payload=[b"x" * 10]),
        "overlap": p.Chunk(xfer=first.xfer, seq=8, offset=100, lengths=[10], digest=0, payload=[b"x" * 10]),
        "bad_digest": p.Chunk(xfer=first.xfer, seq=1, offset=CHUNK, lengths=[CHUNK], digest=first.digest ^ 1,
                              payload=[bytes(CHUNK)]),
    }[fault]
    b.run(b.machine.handle(bad, a.channel))
    abort = b.sent[-1]
    assert isinstance(abort, p.Abort)
    assert abort.code == (errors.ChecksumMismatch.code if fault == "bad_digest" else errors.ProtocolError.code)
    assert "r" not in b.store.entries and b.store.allocator.free_blocks == 64  # dropped, blocks free
    assert any(isinstance(e, Dropped) for e in b.events)
    a.inbox.clear()
    a.run(a.machine.handle(abort, b.channel))
    assert out.state is SenderState.FAILED and a.finished()[0].error.remote == "B"
    assert entry.state is State.READY  # the push failed: the sender still has its entry


def test_a_peer_lost_mid_transfer_fails_both_halves():
    a, b, _ = pair()
    entry = a.entry("r", data_of(6 * CHUNK))
    out = push(a, b, entry)
    queue_all(a, out, entry)
    a.handle(Connected(out.xfer))
    deliver(a, b, drop=lambda side, msg: side is a and isinstance(msg, p.ChunkAck))  # the acks never come
    assert b.store.entries["r"].state is State.RECEIVING
    a.handle(ChannelLost(b.channel.key, "peer B stopped answering"))
    b.handle(ChannelLost(a.channel.key, "peer A stopped answering"))
    assert out.state is SenderState.FAILED and isinstance(a.finished()[0].error, errors.PeerUnavailable)
    assert "r" not in b.store.entries and any(isinstance(e, Dropped) for e in b.events)
    assert not a.machine.transfers and not b.machine.transfers


def test_a_channel_lost_while_connecting_leaves_the_push_to_its_handshake():
    a, b, _ = pair()
    entry = a.entry("r", data_of(CHUNK))
    out = push(a, b, entry)
    a.handle(ChannelLost(b.channel.key, "connection to peer B closed"))
    assert out.state is SenderState.CONNECTING  # the link dials again; its handshake has a deadline


def test_a_transfer_without_progress_fails_at_its_deadline_and_tells_the_peer():
    a, b, clock = pair()
    entry = a.entry("r", data_of(6 * CHUNK))
    out = push(a, b, entry)
    queue_all(a, out, entry)
    a.handle(Connected(out.xfer))
    deliver(a, b, drop=lambda side, msg: side is a)  # B's answers are lost
    a.handle(Tick(clock.now + TIMEOUT / 2))
    assert out.state is SenderState.OFFERED
    a.handle(Tick(clock.now + TIMEOUT + 0.1))
    assert out.state is SenderState.FAILED and a.sent[-1].TYPE == "abort"
    assert "no progress from peer B" in a.finished()[0].error.message
    clock.now += TIMEOUT + 0.1
    b.handle(Tick(clock.now))  # and B, which heard nothing more either
    assert "r" not in b.store.entries


def test_a_stream_waiting_on_its_producer_is_not_failed_for_it():
    a, b, clock = pair()
    entry = a.store.reserve("slow", [TensorSpec(f"l{i}", "uint8", (1000,)) for i in range(2)], None, None,
                            State.WRITING, None)
    out = push(a, b, entry, sealed=False)
    a.handle(Connected(out.xfer))
    lo, hi = entry.tensor_ranges()[0]
    a.handle(Written(out.xfer, [(lo, hi - lo)]))
    deliver(a, b)
    clock.now += 3 * TIMEOUT  # the producer computes its next layer for a long time
    a.handle(Tick(clock.now))
    assert out.state is SenderState.STREAM_SENDING


def test_a_delete_during_a_push_aborts_the_receivers_half():
    a, b, _ = pair()
    entry = a.entry("r", data_of(6 * CHUNK))
    out = push(a, b, entry)
    queue_all(a, out, entry)
    a.handle(Connected(out.xfer))
    deliver(a, b, drop=lambda side, msg: side is a)  # B has the offer and the eager chunks
    a.store.remove(entry)
    a.handle(Cancel(out.xfer, errors.NotFound("request 'r' was deleted on A")))
    deliver(a, b)
    dropped = [e for e in b.events if isinstance(e, Dropped)]
    assert len(dropped) == 1 and isinstance(dropped[0].error, errors.NotFound) and dropped[0].error.remote == "A"
    assert "r" not in b.store.entries


def test_a_message_the_table_does_not_allow_fails_the_transfer():
    a, b, _ = pair()
    entry = a.entry("r", data_of(CHUNK))
    out = push(a, b, entry)
    queue_all(a, out, entry)
    a.handle(Connected(out.xfer))
    a.run(a.machine.handle(p.ChunkAck(xfer=out.xfer, seq=0), b.channel))  # an ack before any accept
    assert out.state is SenderState.FAILED
    assert "unexpected chunk_ack for a transfer that is offered" in a.sent[-1].message


def test_a_transfer_id_in_use_is_refused_and_ends_that_transfer():
    a, b, _ = pair()
    a.run(a.machine.handle(p.Pull(xfer=5, request_id="x", timeout=1.0), b.channel))
    a.run(a.machine.handle(p.Pull(xfer=5, request_id="x", timeout=1.0), b.channel))
    assert a.sent[-1].TYPE == "abort" and a.sent[-1].message == "transfer id in use"
    assert not a.machine.transfers


def test_a_message_from_another_connection_is_ignored():
    a, b, _ = pair()
    entry = a.entry("r", data_of(CHUNK))
    out = push(a, b, entry)
    queue_all(a, out, entry)
    a.handle(Connected(out.xfer))
    stranger = Channel(("router", b"someone-else"), "C", None, lambda: False)
    a.run(a.machine.handle(p.Abort(xfer=out.xfer, code=2, message="spoofed"), stranger))
    assert out.state is SenderState.OFFERED


def test_a_done_before_every_chunk_was_sent_is_a_protocol_error():
    a, b, _ = pair()
    entry = a.entry("r", data_of(6 * CHUNK))
    out = push(a, b, entry)
    queue_all(a, out, entry)
    a.handle(Connected(out.xfer))
    a.run(a.machine.handle(p.Done(xfer=out.xfer), b.channel))
    assert out.state is SenderState.FAILED and "done before every chunk was sent" in a.sent[-1].message
    assert entry.state is State.READY and not entry.removed  # a lying receiver does not consume it


def test_a_pull_for_another_generation_of_the_entry_is_refused_before_a_byte_moves():
    """A registry's hint names the entry's generation: a holder whose entry of that id is another
    one (deleted and put again, the daemon restarted) answers not_found, never the wrong bytes."""
    a, b, _ = pair()
    entry = a.entry("g", data_of(CHUNK))
    for gen, served in ((entry.token + 1, False), (entry.token, True)):
        inbound, actions = b.machine.start_pull("g", a.channel, timeout=0.0, keep=True, expect_gen=gen)
        b.run(actions)
        deliver(a, b)
        wait = next(e for e in reversed(a.events) if isinstance(e, WaitForEntry))
        a.handle(EntryReady(wait.transfer.xfer, entry))
        deliver(a, b)
        if served:
            assert inbound.state is ReceiverState.DONE and b.read(inbound.entry) == data_of(CHUNK)
        else:
            assert inbound.state is ReceiverState.FAILED and isinstance(b.finished()[-1].error, errors.NotFound)
            assert "not the generation asked for" in b.finished()[-1].error.message
            assert not any(isinstance(m, p.Chunk) for m in a.sent)


def test_a_done_before_the_seal_is_a_protocol_error_and_consumes_nothing():
    """A receiver publishes a stream only after its seal, so a done before it is a lie (found by
    test_transfer_properties): taken as success, the push consumed an entry its writer had not
    committed, and the writer's commit then failed with its blocks parked."""
    a, b, _ = pair()
    entry = a.store.reserve("s", [TensorSpec("l0", "uint8", (1000,))], None, None, State.WRITING, None)
    out = push(a, b, entry, sealed=False)
    a.handle(Connected(out.xfer))
    a.handle(Written(out.xfer, [(0, entry.total_bytes)]))  # every byte sent, not yet committed
    assert out.window.all_sent
    a.run(a.machine.handle(p.Done(xfer=out.xfer), b.channel))
    assert out.state is SenderState.FAILED and "done before the seal" in a.sent[-1].message
    assert not entry.removed and entry.state is State.WRITING
