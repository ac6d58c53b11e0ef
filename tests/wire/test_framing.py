"""The local socket's framing, sans I/O: every split of the stream, every limit."""
from __future__ import annotations

import struct

import pytest

from kvd.errors import ProtocolError
from kvd.wire import protocol as p
from kvd.wire.framing import MAX_FRAMES, MAX_MESSAGE_BYTES, MessageReader, encode_message

U32 = struct.Struct("<I")

MESSAGES = [
    [b"x"],
    [b""],
    p.encode(p.Stats(req=7)),
    [b"header", b"", b"\x00" * 1000, bytes(range(256))],
    [b"y" * 70_000],
]


def test_layout_is_count_then_length_prefixed_frames():
    assert encode_message([b"ab", b"", b"c"]) == (
        U32.pack(3) + U32.pack(2) + b"ab" + U32.pack(0) + U32.pack(1) + b"c")


@pytest.mark.parametrize("frames", MESSAGES, ids=range(len(MESSAGES)))
def test_roundtrip_in_every_split(frames):
    wire = encode_message(frames)
    step = max(1, len(wire) // 300)  # every byte boundary for small messages
    for cut in range(0, len(wire) + 1, step):
        reader = MessageReader()
        got = reader.feed(wire[:cut]) + reader.feed(wire[cut:])
        assert got == [list(frames)]
        assert reader.buffered == 0


def test_byte_by_byte_and_many_at_once():
    wire = b"".join(encode_message(m) for m in MESSAGES)
    reader = MessageReader()
    assert reader.feed(wire) == [list(m) for m in MESSAGES]
    reader = MessageReader()
    got = []
    for i in range(len(wire)):
        got += reader.feed(wire[i:i + 1])
    assert got == [list(m) for m in MESSAGES]


def test_memoryview_frames_are_written_whole():
    data = bytearray(range(100))
    assert MessageReader().feed(encode_message([memoryview(data)[10:20]])) == [[bytes(range(10, 20))]]


@pytest.mark.parametrize("wire, why", [
    (U32.pack(0), "0 frames"),
    (U32.pack(MAX_FRAMES + 1), f"{MAX_FRAMES + 1} frames"),
    (U32.pack(1) + U32.pack(MAX_MESSAGE_BYTES + 1), "more than"),
    (U32.pack(2) + U32.pack(1) + b"a" + U32.pack(0xFFFFFFFF), "more than"),
    # each frame within the limit, together over it: refused before the second is buffered
    (U32.pack(2) + U32.pack(MAX_MESSAGE_BYTES // 2 + 1) + b"a" * (MAX_MESSAGE_BYTES // 2 + 1)
     + U32.pack(MAX_MESSAGE_BYTES // 2), "more than"),
])
def test_limits_are_checked_before_buffering(wire, why):
    with pytest.raises(ProtocolError, match=why):
        MessageReader().feed(wire)


def test_partial_message_is_kept_until_complete():
    reader = MessageReader()
    assert reader.feed(U32.pack(1) + U32.pack(10) + b"12345") == []
    assert reader.buffered == 13
    assert reader.feed(b"67890" + U32.pack(1)) == [[b"1234567890"]]
    assert reader.buffered == 4


def test_zeromqs_greeting_is_told_from_a_kvd_message():
    from kvd.wire.framing import zmtp_greeting

    greeting = bytes([0xFF, 0, 0, 0, 0, 0, 0, 0, 1, 0x7F, 3, 1])  # what libzmq sends first (ZMTP 3.1)
    assert zmtp_greeting(greeting) and zmtp_greeting(greeting[:4])
    assert not zmtp_greeting(encode_message([b"x"])) and not zmtp_greeting(b"")
    assert not zmtp_greeting(bytes([0xFF, 0, 0, 0, 0, 0, 0, 0, 1, 0x00]))
