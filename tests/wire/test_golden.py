"""Golden wire vectors (proto/golden.json): the exact bytes of protocol v1 must not drift.

Each vector is {"name", "message": {"t": type, field: value, ...}, "frames_hex": [...]}.
A chunk's payload frames are given in the message as "payload_hex" (hex of each frame).
If an encoding change is intended, it is a protocol change: bump the version, regenerate.
"""
from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest

from kvd.wire import protocol as p

GOLDEN_PATH = Path(__file__).resolve().parents[2] / "proto" / "golden.json"
VECTORS = json.loads(GOLDEN_PATH.read_text())


def build(message: dict) -> p.Message:
    fields = dict(message)
    cls = p.MESSAGE_TYPES[fields.pop("t")]
    payload_hex = fields.pop("payload_hex", None)
    if payload_hex is not None:
        fields["payload"] = [bytes.fromhex(h) for h in payload_hex]
    return cls(**fields)


def test_golden_file_is_well_formed():
    assert len(VECTORS) >= 8
    names = [v["name"] for v in VECTORS]
    assert len(set(names)) == len(names)
    types = {v["message"]["t"] for v in VECTORS}
    assert {"hello", "put_alloc", "put_slots", "get", "error", "peer_hello", "offer", "chunk",
            "chunk_ack", "abort"} <= types
    for vector in VECTORS:
        assert set(vector) == {"name", "message", "frames_hex"}
        assert vector["message"]["t"] in p.MESSAGE_TYPES
        assert vector["frames_hex"], vector["name"]


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_encode_matches_golden_bytes(vector):
    frames = p.encode(build(vector["message"]))
    assert [bytes(f).hex() for f in frames] == vector["frames_hex"]


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_decode_of_golden_bytes(vector):
    frames = [bytes.fromhex(h) for h in vector["frames_hex"]]
    decoded = p.decode(frames)
    expected = build(vector["message"])
    assert type(decoded) is type(expected)
    assert decoded == expected


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_golden_header_is_the_documented_map(vector):
    """Frame 0 is a msgpack map of v, t and the fields by name (plus n for a chunk's payload)."""
    message = dict(vector["message"])
    payload_hex = message.pop("payload_hex", [])
    header = msgpack.unpackb(bytes.fromhex(vector["frames_hex"][0]), raw=False)
    expected = {"v": p.PROTOCOL_VERSION, **message}
    if payload_hex:
        expected["n"] = len(payload_hex)
    assert header == expected
    assert list(header)[:2] == ["v", "t"]
    assert vector["frames_hex"][1:] == payload_hex


def test_golden_chunk_payload_and_checksum():
    (chunk,) = [v for v in VECTORS if v["message"]["t"] == "chunk"]
    payload = [bytes.fromhex(h) for h in chunk["message"]["payload_hex"]]
    assert sum(len(x) for x in payload) == 5
    assert chunk["message"]["lengths"] == [len(x) for x in payload]
    import zlib

    assert chunk["message"]["digest"] == zlib.crc32(b"".join(payload))
