"""kvd.daemon.transfer.machine's story: the log of recent transitions it keeps of every transfer
(`kvd.statetable.Story`), told when `validate()` finds a broken invariant, and holding no
chunk's buffer alive. Two machines through in-memory channels (`pair.py`), no sockets."""
from __future__ import annotations

import gc
import logging
import weakref

import pytest

from kvd import errors
from kvd.daemon.transfer.states import Cancel, Connected, SenderState
from kvd.statetable import InvariantBroken
from kvd.wire import protocol as p

from .pair import CHUNK, data_of, deliver, pair, push


class Buffer(bytearray):
    """A received frame's buffer that a weak reference can watch (bytes and bytearray cannot be)."""


def test_a_transfer_s_story_tells_its_transitions_by_name():
    a, b, clock = pair()
    out = push(a, b, a.entry("r", data_of(5 * CHUNK)))
    clock.now += 0.5
    a.handle(Connected(out.xfer))
    deliver(a, b)
    told = [(t.state, t.event, t.next) for t in a.machine.story.of(out.xfer)]
    assert told[:3] == [("no transfer", "start_push", "connecting"), ("connecting", "Connected", "offered"),
                        ("offered", "Accept", "sending")]
    assert told[-1] == ("sending", "Done", "done") and ("sending", "ChunkAck", "sending") in told
    received = [(t.state, t.event, t.next) for t in b.machine.story.of(out.xfer)]
    assert received[0] == ("no transfer", "Offer", "receiving") and received[-1] == ("receiving", "Chunk", "done")
    assert a.machine.story.show(out.xfer).splitlines()[1] == "  +0.500000s connecting --Connected--> offered"


def test_a_failure_is_in_the_story_with_why_and_what_came_after_it_too():
    a, b, _ = pair()
    out = push(a, b, a.entry("r", data_of(5 * CHUNK)))
    a.handle(Connected(out.xfer))  # (the offer and two chunks are on their way)
    a.handle(Cancel(out.xfer, errors.NotFound("request 'r' was deleted on A")))
    deliver(a, b)  # B takes the offer, accepts, acks, then fails by A's abort; A hears its accept late
    story = a.machine.story.of(out.xfer)
    assert (story[2].state, story[2].event, story[2].next) == ("offered", "Cancel", "failed")
    assert story[2].note == "NotFound: request 'r' was deleted on A"
    assert [(t.state, t.event, t.next) for t in story[3:]] == [("no transfer", "Accept", "no transfer")] + \
        [("no transfer", "ChunkAck", "no transfer")] * 2
    aborted = b.machine.story.of(out.xfer)[-1]
    assert (aborted.event, aborted.next) == ("Abort", "failed") and "deleted on A" in aborted.note


def test_a_transfer_that_fails_by_a_fault_logs_its_story_at_debug_level(caplog):
    a, b, _ = pair()
    out = push(a, b, a.entry("r", data_of(5 * CHUNK)))
    a.handle(Connected(out.xfer))
    with caplog.at_level(logging.DEBUG, logger="kvd.daemon.transfer.machine"):
        a.on_message(b.channel.key, p.Seal(xfer=out.xfer))  # (a sender's message, to a sender)
    assert out.state is SenderState.FAILED
    assert f"the story of transfer {out.xfer:x}:" in caplog.text
    assert "offered --Seal--> failed (ProtocolError: unexpected seal for a transfer that is offered)" in caplog.text


def test_validate_tells_the_story_of_the_transfer_whose_invariant_broke(caplog):
    a, b, _ = pair()
    out = push(a, b, a.entry("r", data_of(5 * CHUNK)))
    a.handle(Connected(out.xfer))
    a.machine.validate()
    out.lease_token = 12345  # (a lease the store never gave)
    with caplog.at_level(logging.ERROR, logger="kvd.daemon.transfer.machine"), \
            pytest.raises(InvariantBroken, match="its lease is not the store's") as broken:
        a.machine.validate()
    assert broken.value.key == out.xfer
    assert "connecting --Connected--> offered" in str(broken.value)
    assert f"transfer {out.xfer:x}" in caplog.text and "connecting --Connected--> offered" in caplog.text
    assert out.state is SenderState.OFFERED


def test_the_story_holds_no_received_chunk_alive():
    """The machine logs every chunk's transition, but keeps none of the chunk: once a transfer is
    over, no buffer it received is alive (a story that kept events would keep each chunk's payload,
    4 MiB a chunk in a daemon)."""
    a, b, _ = pair()
    out = push(a, b, a.entry("r", data_of(5 * CHUNK)))
    a.handle(Connected(out.xfer))
    watched: list[weakref.ref] = []

    def receive(side, key):
        msg = side.inboxes[key].popleft()
        if isinstance(msg, p.Chunk):  # the frames the wire handed us, as buffers we can watch
            msg.payload = [Buffer(piece) for piece in msg.payload]
            watched.extend(weakref.ref(piece) for piece in msg.payload)
        side.on_message(key, msg)

    while any(inbox for side in (a, b) for inbox in side.inboxes.values()):
        for side in (a, b):
            for key, inbox in side.inboxes.items():
                if inbox:
                    receive(side, key)
    assert b.read(b.store.entries["r"]) == data_of(5 * CHUNK) and out.state is SenderState.DONE
    assert len(watched) >= 4 and sum(t.event == "Chunk" for t in b.machine.story.of(out.xfer)) == len(watched)
    a.sent.clear()  # (the harness's own record of what went on the wire: the message B received is there)
    gc.collect()
    assert [ref() for ref in watched if ref() is not None] == []
