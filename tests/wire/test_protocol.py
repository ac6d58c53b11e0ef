"""Wire protocol v1 (kvd.wire.protocol), sans I/O: encode/decode round trips and bounded rejection."""
from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.errors import ProtocolError, VersionMismatch
from kvd.wire import protocol as p

# One example per message type, with every field set to something non-default where possible.
EXAMPLES: dict[str, p.Message] = {
    "hello": p.Hello(req=1, client="pid-1234"),
    "hello_ok": p.HelloOk(req=1, node_id="A", incarnation=77, pool_path="/proc/42/fd/7",
                          pool_size=1 << 30, block_size=65536, device="cpu"),
    "put_alloc": p.PutAlloc(req=2, request_id="req-1",
                            tensors=[["layer.0.k", "bfloat16", [8, 16, 64]], ["layer.0.v", "bfloat16", [8, 16, 64]]],
                            ttl=30.5, meta={"model": "llama", "layers": 2}, stream=True, dest="B", give_back=4),
    "put_slots": p.PutSlots(req=2, token=5, segments=[[[0, 16384]], [[16384, 8192], [65536, 8192]]]),
    "put_commit": p.PutCommit(req=3, request_id="req-1", token=5, dest="B", lend=True),
    "put": p.Put(req=3, request_id="req-2", tensors=[["k", "float8_e4m3fn", [2, 8]]], scratch=6, ttl=1.5,
                 meta={"m": 1}, dest="B"),
    "put_ok": p.PutOk(req=3, scratch=7, extents=[[0, 2], [9, 1]]),
    "put_part": p.PutPart(req=3, request_id="req-1", token=5, tensors=[0, 1]),
    "get_stream": p.GetStream(req=4, request_id="req-1", timeout=0.75),
    "tensors_ready": p.TensorsReady(req=4, tensors=[1], complete=True),
    "get": p.Get(req=4, request_id="req-1", timeout=2.5, source="tcp://10.0.0.2:7470", keep=True),
    "get_slots": p.GetSlots(req=4, token=9, tensors=[["x", "float32", [4]]], segments=[[[0, 16]]],
                            meta={"k": [1, 2, 3]}),
    "get_done": p.GetDone(req=5, request_id="req-1", token=9, consume=False, reply=True),
    "delete": p.Delete(req=6, request_id="req-1"),
    "stats": p.Stats(req=7),
    "list": p.ListEntries(req=8),
    "cluster_nodes": p.ClusterNodes(req=8),
    "cluster_locate": p.ClusterLocate(req=8, request_id="req-1"),
    "ok": p.Ok(req=9, value={"pool": {"used_bytes": 0}, "entries": ["a", "b"], "flag": True}),
    "error": p.Error(req=10, code=3, message="pool full: need 4 blocks", origin="B"),
    "cache_put": p.CachePut(req=11, namespace="model=m;tp=0/2", keys=["ab12", "cd34"],
                            pages=[["bfloat16", [2, 64, 8]], ["uint8", [4096]]]),
    "cache_slots": p.CacheSlots(req=11, token=3, slots=[[[0, 4096]], True, None]),
    "cache_commit": p.CacheCommit(req=12, token=3, ok=False),
    "cache_get": p.CacheGet(req=13, namespace="", keys=["ab12"], sizes=[2048]),
    "cache_release": p.CacheRelease(req=14, token=4),
    "cache_exists": p.CacheExists(req=15, namespace="t", keys=["ab12", "cd34"]),
    "cache_clear": p.CacheClear(req=16, namespace="t"),
    "cache_stats": p.CacheStats(req=17, namespace="t"),
    "cache_events": p.CacheEvents(req=17, namespace="t", epoch=123456789, since=42),
    "tier_store": p.TierStore(xfer=18, seq=0, offset=0, lengths=[4], digest=7, payload=[b"abcd"], checksum="crc32",
                              namespace="t", keys=["ab12"], pages=[["uint8", [4]]]),
    "tier_fetch": p.TierFetch(xfer=19, namespace="t", keys=["ab12", "cd34"], sizes=[4, 8]),
    "tier_pages": p.TierPages(xfer=19, seq=0, offset=0, lengths=[4], digest=7, payload=[b"abcd"], checksum="crc32",
                              found=[0], pages=[["uint8", [4]]]),
    "tier_ask": p.TierAsk(xfer=20, namespace="t", keys=["ab12"]),
    "tier_held": p.TierHeld(xfer=20, held=[True, False]),
    "tier_clear": p.TierClear(xfer=21, namespace="t"),
    "grant": p.Grant(xfer=22, regions=[[0, 4096], [65536, 8192]]),
    "placed": p.Placed(xfer=22, seq=0, offset=0, length=12288, digest=(1 << 64) - 1),
    "released": p.Released(xfer=22),
    "tier_cleared": p.TierCleared(xfer=21, dropped=3),
    "peer_hello": p.PeerHello(node_id="A", incarnation=123456789),
    "peer_hello_ok": p.PeerHelloOk(node_id="B", incarnation=987654321),
    "offer": p.Offer(xfer=11, request_id="req-1", tensors=[["x", "int8", [3, 3]]], total_bytes=9,
                     chunk_size=4 << 20, checksum="xxh3_64", ttl=60.0, meta={"layout": "paged"}),
    "seal": p.Seal(xfer=11),
    "accept": p.Accept(xfer=11),
    "chunk": p.Chunk(xfer=11, seq=0, offset=0, lengths=[5, 3], digest=(1 << 64) - 1,
                     payload=[b"hello", b"abc"]),
    "chunk_ack": p.ChunkAck(xfer=11, seq=0),
    "done": p.Done(xfer=11),
    "abort": p.Abort(xfer=11, code=9, message="checksum mismatch on chunk 3"),
    "pull": p.Pull(xfer=12, request_id="req-2", timeout=1.25, keep=True, expect_gen=41),
    "ping": p.Ping(nonce=42),
    "pong": p.Pong(nonce=42),
}


def header_of(frames) -> dict:
    return msgpack.unpackb(frames[0], raw=False)


def pack(header: dict) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def test_examples_cover_every_message_type():
    assert set(EXAMPLES) == set(p.MESSAGE_TYPES)
    for name, msg in EXAMPLES.items():
        assert type(msg) is p.MESSAGE_TYPES[name]
        assert name == msg.TYPE


@pytest.mark.parametrize("name", sorted(p.MESSAGE_TYPES))
def test_every_message_type_round_trips(name):
    msg = EXAMPLES[name]
    frames = p.encode(msg)
    header = header_of(frames)
    assert header["v"] == p.PROTOCOL_VERSION
    assert header["t"] == name
    decoded = p.decode(frames)
    assert type(decoded) is type(msg)
    assert decoded == msg
    # and the decoded message encodes to the very same bytes
    assert [bytes(f) for f in p.encode(decoded)] == [bytes(f) for f in frames]


@pytest.mark.parametrize("name", sorted(p.MESSAGE_TYPES))
def test_defaults_round_trip(name):
    """Only required fields given: optional ones (None / False / defaults) survive the trip."""
    cls = p.MESSAGE_TYPES[name]
    full = EXAMPLES[name]
    required = {
        f.name: getattr(full, f.name)
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    if name in ("chunk", "tier_store", "tier_pages"):
        required["lengths"] = []  # no payload frames by default, so no lengths either
    msg = cls(**required)
    assert p.decode(p.encode(msg)) == msg


def test_extension_fields_are_sent_only_when_set():
    # fields added to a v1 message later leave its v1 bytes unchanged while unset
    plain = header_of(p.encode(p.PutCommit(req=3, request_id="r", token=5)))
    assert "lend" not in plain and plain["token"] == 5
    assert header_of(p.encode(p.PutCommit(req=3, request_id="r", token=5, lend=True)))["lend"] is True
    assert "give_back" not in header_of(p.encode(p.PutAlloc(req=1, request_id="r", tensors=[])))
    assert "token" not in header_of(p.encode(p.Delete(req=1, request_id="r")))
    assert header_of(p.encode(p.Delete(req=1, request_id="r", token=7)))["token"] == 7
    assert "expect_gen" not in header_of(p.encode(p.Pull(xfer=1, request_id="r", timeout=1.0)))
    assert header_of(p.encode(p.Pull(xfer=1, request_id="r", timeout=1.0, expect_gen=3)))["expect_gen"] == 3
    # and a v1 peer's message, without them, decodes to the defaults
    assert p.decode([pack(plain)]) == p.PutCommit(req=3, request_id="r", token=5, lend=False)


def test_chunk_with_two_payload_frames():
    msg = EXAMPLES["chunk"]
    frames = p.encode(msg)
    assert len(frames) == 3
    assert frames[1] == b"hello" and frames[2] == b"abc"
    header = header_of(frames)
    assert header["n"] == 2
    assert "payload" not in header
    decoded = p.decode(frames)
    assert decoded.payload == [b"hello", b"abc"]
    assert decoded.lengths == [5, 3]


def test_chunk_payload_may_be_memoryviews():
    data = bytearray(b"0123456789")
    frames = p.encode(p.Chunk(xfer=1, seq=2, offset=10, lengths=[4, 6], digest=0,
                              payload=[memoryview(data)[:4], memoryview(data)[4:]]))
    decoded = p.decode(frames)
    assert [bytes(f) for f in decoded.payload] == [b"0123", b"456789"]


def test_chunk_without_payload_has_no_n():
    msg = p.Chunk(xfer=1, seq=0, offset=0, lengths=[], digest=0)
    frames = p.encode(msg)
    assert len(frames) == 1
    assert "n" not in header_of(frames)
    assert p.decode(frames) == msg


def test_float_fields_accept_ints_and_come_back_as_float():
    frames = [pack({"v": 1, "t": "get", "req": 1, "request_id": "r", "timeout": 3})]
    msg = p.decode(frames)
    assert msg.timeout == 3.0 and isinstance(msg.timeout, float)


def test_decode_accepts_memoryview_and_bytearray_header():
    frames = p.encode(EXAMPLES["ping"])
    assert p.decode([memoryview(frames[0])]) == EXAMPLES["ping"]
    assert p.decode([bytearray(frames[0])]) == EXAMPLES["ping"]


def test_error_reply_keeps_code_and_origin():
    from kvd.errors import InternalError, PoolFull

    reply = p.error_reply(3, PoolFull("pool full: x", remote="B"), origin="A")
    assert (reply.code, reply.message, reply.origin) == (PoolFull.code, "pool full: x", "B")
    reply = p.error_reply(4, PoolFull("nope"), origin="A")
    assert reply.origin == "A"
    reply = p.error_reply(5, KeyError("k"), origin="A")
    assert reply.code == InternalError.code and reply.message.startswith("KeyError")
    assert p.decode(p.encode(reply)) == reply


# ---- rejection ----------------------------------------------------------------------------

def valid_ping() -> dict:
    return {"v": 1, "t": "ping", "nonce": 7}


def test_sanity_valid_ping_decodes():
    assert p.decode([pack(valid_ping())]) == p.Ping(nonce=7)


def test_rejects_empty_frame_list():
    with pytest.raises(ProtocolError, match="empty"):
        p.decode([])


@pytest.mark.parametrize("junk", [b"", b"\xc1", b"\xc1\xc1\xc1", b"hello world", b"\xff" * 10,
                                  b"\x81\xa1v"])  # reserved byte, trailing data, map missing its value
def test_rejects_non_msgpack_bytes(junk):
    with pytest.raises(ProtocolError):
        p.decode([junk])


def test_rejects_truncated_msgpack():
    full = p.encode(EXAMPLES["put_alloc"])[0]
    for cut in (1, 2, len(full) // 2, len(full) - 1):
        with pytest.raises(ProtocolError, match="msgpack"):
            p.decode([full[:cut]])


def test_rejects_array_instead_of_map():
    with pytest.raises(ProtocolError, match="map"):
        p.decode([msgpack.packb([1, "ping", 7])])


@pytest.mark.parametrize("scalar", [1, "ping", None, 3.5, b"bytes"])
def test_rejects_scalar_header(scalar):
    with pytest.raises(ProtocolError, match="map"):
        p.decode([msgpack.packb(scalar, use_bin_type=True)])


def test_rejects_missing_version():
    header = valid_ping()
    del header["v"]
    with pytest.raises(VersionMismatch):
        p.decode([pack(header)])


@pytest.mark.parametrize("version", [2, 0, "1", None])
def test_rejects_wrong_version(version):
    header = {**valid_ping(), "v": version}
    with pytest.raises(VersionMismatch) as info:
        p.decode([pack(header)])
    assert isinstance(info.value, ProtocolError)
    assert "version" in str(info.value)


@pytest.mark.parametrize("kind", ["nope", "", "PING", 5, None, ["ping"]])
def test_rejects_unknown_type(kind):
    header = {**valid_ping(), "t": kind}
    with pytest.raises(ProtocolError, match="unknown message type"):
        p.decode([pack(header)])


def test_rejects_missing_type():
    header = valid_ping()
    del header["t"]
    with pytest.raises(ProtocolError, match="unknown message type"):
        p.decode([pack(header)])


@pytest.mark.parametrize("name", sorted(p.MESSAGE_TYPES))
def test_rejects_each_missing_required_field(name):
    frames = p.encode(EXAMPLES[name])
    header = header_of(frames)
    cls = p.MESSAGE_TYPES[name]
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    assert required, name
    for field_name in required:
        broken = {k: v for k, v in header.items() if k != field_name}
        with pytest.raises(ProtocolError, match=f"missing field '{field_name}'"):
            p.decode([pack(broken), *frames[1:]])


@pytest.mark.parametrize("bad", ["7", True, False, 1.5, None, [7], {"n": 7}])
def test_rejects_wrong_type_for_int_field(bad):
    with pytest.raises(ProtocolError, match="nonce"):
        p.decode([pack({**valid_ping(), "nonce": bad})])


@pytest.mark.parametrize("field_name, bad", [
    ("request_id", 5), ("request_id", None), ("timeout", "1s"), ("timeout", True),
    ("keep", 1), ("keep", "yes"), ("req", 1.0), ("source", 3),
])
def test_rejects_wrong_field_types_in_get(field_name, bad):
    header = header_of(p.encode(EXAMPLES["get"]))
    header[field_name] = bad
    with pytest.raises(ProtocolError, match=field_name):
        p.decode([pack(header)])


@pytest.mark.parametrize("field_name, bad", [
    ("tensors", {"a": 1}), ("tensors", "x"), ("meta", [1]), ("ttl", "30s"), ("meta", 3),
])
def test_rejects_wrong_container_types_in_put_alloc(field_name, bad):
    header = header_of(p.encode(EXAMPLES["put_alloc"]))
    header[field_name] = bad
    with pytest.raises(ProtocolError, match=field_name):
        p.decode([pack(header)])


def test_optional_fields_accept_none_and_absence():
    header = header_of(p.encode(EXAMPLES["put_alloc"]))
    header["ttl"] = None
    del header["meta"]
    msg = p.decode([pack(header)])
    assert msg.ttl is None and msg.meta is None


def test_rejects_header_bigger_than_limit():
    big = p.Ok(req=1, value=["x" * 60000] * 20)  # each str within max_str_len; total > 1 MiB
    frames = p.encode(big)
    assert len(frames[0]) > p.MAX_HEADER_BYTES
    with pytest.raises(ProtocolError, match="exceeds"):
        p.decode(frames)


def test_rejects_oversized_raw_header_before_parsing():
    with pytest.raises(ProtocolError, match="exceeds"):
        p.decode([b"\xc1" * (p.MAX_HEADER_BYTES + 1)])


def test_header_at_limit_is_parsed():
    # a header exactly at the limit is not rejected for its size (it fails later for other reasons or not at all)
    msg = p.Ok(req=1, value=["y" * 50000] * 20)
    frames = p.encode(msg)
    assert len(frames[0]) <= p.MAX_HEADER_BYTES
    assert p.decode(frames) == msg


def test_rejects_str_longer_than_msgpack_limit():
    limit = p.UNPACK_LIMITS["max_str_len"]
    ok = p.Error(req=1, code=1, message="m" * limit)
    assert p.decode(p.encode(ok)) == ok
    too_long = p.Error(req=1, code=1, message="m" * (limit + 1))
    frames = p.encode(too_long)
    assert len(frames[0]) < p.MAX_HEADER_BYTES
    with pytest.raises(ProtocolError, match="msgpack"):
        p.decode(frames)


def test_rejects_bin_longer_than_msgpack_limit():
    limit = p.UNPACK_LIMITS["max_bin_len"]
    frames = p.encode(p.Ok(req=1, value=b"b" * (limit + 1)))
    with pytest.raises(ProtocolError, match="msgpack"):
        p.decode(frames)


def test_rejects_ext_types():
    header = pack({**valid_ping(), "extra": msgpack.ExtType(5, b"abc")})
    with pytest.raises(ProtocolError, match="msgpack"):
        p.decode([header])


def test_rejects_non_string_map_keys():
    header = msgpack.packb({"v": 1, "t": "ok", "req": 1, "value": {1: 2}})
    with pytest.raises(ProtocolError, match="msgpack"):
        p.decode([header])


def test_rejects_chunk_whose_n_disagrees_with_frame_count():
    frames = p.encode(EXAMPLES["chunk"])  # n = 2
    with pytest.raises(ProtocolError, match="payload frames"):
        p.decode(frames[:2])
    with pytest.raises(ProtocolError, match="payload frames"):
        p.decode([*frames, b"x"])
    header = header_of(frames)
    header["n"] = "2"
    with pytest.raises(ProtocolError, match="payload frames"):
        p.decode([pack(header), *frames[1:]])


def test_rejects_chunk_with_frames_but_no_n():
    frames = p.encode(p.Chunk(xfer=1, seq=0, offset=0, lengths=[3], digest=0))
    assert len(frames) == 1
    with pytest.raises(ProtocolError, match="payload frames"):
        p.decode([frames[0], b"abc"])


def test_rejects_chunk_whose_lengths_disagree_with_frames():
    good = EXAMPLES["chunk"]  # lengths [5, 3], payload hello/abc
    frames = p.encode(good)
    # frame sizes differ from the lengths
    with pytest.raises(ProtocolError, match="lengths"):
        p.decode([frames[0], b"hell", b"abc"])
    with pytest.raises(ProtocolError, match="lengths"):
        p.decode([frames[0], b"abc", b"hello"])
    # lengths list of the wrong size, or with non-int entries
    for lengths in ([5], [5, 3, 0], [5.0, 3], [True, 3], ["5", 3]):
        header = header_of(frames)
        header["lengths"] = lengths
        with pytest.raises(ProtocolError, match="lengths"):
            p.decode([pack(header), *frames[1:]])


def test_rejects_chunk_with_too_many_payload_frames():
    count = p.MAX_PAYLOAD_FRAMES + 1
    msg = p.Chunk(xfer=1, seq=0, offset=0, lengths=[1] * count, digest=0, payload=[b"z"] * count)
    with pytest.raises(ProtocolError, match="limit"):
        p.decode(p.encode(msg))
    at_limit = p.Chunk(xfer=1, seq=0, offset=0, lengths=[1] * (count - 1), digest=0, payload=[b"z"] * (count - 1))
    assert p.decode(p.encode(at_limit)) == at_limit


@pytest.mark.parametrize("name", sorted(set(p.MESSAGE_TYPES) - {"chunk", "tier_store", "tier_pages"}))
def test_rejects_extra_frames_on_non_chunk(name):  # (the tier's page messages carry frames as a chunk does)
    frames = p.encode(EXAMPLES[name])
    assert len(frames) == 1
    with pytest.raises(ProtocolError, match="no payload"):
        p.decode([*frames, b"extra"])
    with pytest.raises(ProtocolError, match="no payload"):
        p.decode([*frames, b"", b""])


# ---- fuzzing: decode never raises anything but ProtocolError ---------------------------------

def decode_or_protocol_error(frames):
    try:
        msg = p.decode(frames)
    except ProtocolError:
        return None
    assert isinstance(msg, p.Message)
    assert type(msg) in p.MESSAGE_TYPES.values()
    return msg


FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_decode_single_frame(data):
    decode_or_protocol_error([data])


@FUZZ
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=3))
def test_fuzz_decode_frame_lists(frames):
    decode_or_protocol_error(frames)


@FUZZ
@given(st.sampled_from(sorted(p.MESSAGE_TYPES)), st.binary(max_size=64), st.lists(st.binary(max_size=16), max_size=2))
def test_fuzz_mutated_valid_headers(name, noise, extra):
    """Valid headers with bytes flipped, truncated or extended, plus arbitrary extra frames."""
    head = p.encode(EXAMPLES[name])[0]
    variants = [head[: len(noise) % (len(head) + 1)], head + noise, noise + head]
    if noise:
        i = noise[0] % len(head)
        variants.append(head[:i] + bytes([head[i] ^ (noise[-1] or 1)]) + head[i + 1:])
    for variant in variants:
        decode_or_protocol_error([variant, *extra])


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False) | st.text(max_size=8) | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)


@FUZZ
@given(st.sampled_from(sorted(p.MESSAGE_TYPES)), st.data())
def test_fuzz_structured_headers(name, data):
    """Right version and type, arbitrary values for the real field names: a Message or ProtocolError."""
    cls = p.MESSAGE_TYPES[name]
    names = [f.name for f in dataclasses.fields(cls) if f.name != "payload"] + ["n"]
    header = {"v": 1, "t": name}
    for field_name in names:
        if data.draw(st.booleans()):
            header[field_name] = data.draw(msgpack_values)
    extra = data.draw(st.lists(st.binary(max_size=8), max_size=2))
    msg = decode_or_protocol_error([pack(header), *extra])
    if msg is not None:
        # whatever got through has the declared field types
        for f in dataclasses.fields(cls):
            if f.name in header and f.name != "payload":
                assert getattr(msg, f.name) == header[f.name]


def test_the_request_number_of_a_header_over_the_limits_is_still_found():
    # so that the daemon's error reaches the request that caused it, not a req 0 nobody waits on
    too_long = p.encode(p.PutAlloc(req=41, request_id="r", tensors=[["n" * 70000, "uint8", [1]]]))[0]
    with pytest.raises(ProtocolError):
        p.decode([too_long])
    assert p.request_number(too_long) == 41
    too_big = p.encode(p.Stats(req=7))[0] + b"\xc0" * p.MAX_HEADER_BYTES  # (what follows the map is not read)
    with pytest.raises(ProtocolError, match="exceeds"):
        p.decode([too_big])
    assert p.request_number(too_big) == 7
    for garbage in (b"", b"\x93\x01\x02\x03", b"\xde\xff\xff", b"\x81\xa3req\xa1x", b"\x81\xa3req\xff"):
        assert p.request_number(garbage) == 0


def test_list_pages_end_at_a_short_page_or_one_that_does_not_move_on():
    full = [{"request_id": f"r{i:05d}"} for i in range(p.LIST_PAGE)]
    assert p.next_page_after(full, None) == full[-1]["request_id"]
    assert p.next_page_after(full[:-1], None) is None  # short: the last
    assert p.next_page_after([], "r00010") is None
    # a daemon that ignores `after` sends the first page again: stop, do not loop
    assert p.next_page_after(full, full[-1]["request_id"]) is None
    later = [{"request_id": f"s{i:05d}"} for i in range(p.LIST_PAGE)]
    assert p.next_page_after(later, full[-1]["request_id"]) == later[-1]["request_id"]
