"""Records, their JSON and the key schema: pure, no registry."""
from __future__ import annotations

import json

import pytest

from kvd.cluster.records import (
    EtcdKeys,
    HolderRecord,
    NodeRecord,
    RecordError,
    RedisKeys,
    decode_holder,
    decode_node,
    encode_holder,
    encode_node,
    rid_key,
    vet_holder,
    vet_node,
)
from kvd.errors import KvdError, ProtocolError

NODE = NodeRecord("pf-1", 0x1A2B, "tcp://10.0.0.1:7700", role="prefill", pool_bytes=1 << 30, block_size=1 << 20,
                  protocol=(1, 2), curve_public=None, labels={"zone": "a", "host": "h1"}, started_at=1700000000.5)
HOLDER = HolderRecord("req-1", "pf-1", 0x1A2B, gen=7, nbytes=4096, state="complete", expires_at=1700000600.0)


def test_node_roundtrip_and_golden_json():
    raw = encode_node(NODE)
    assert decode_node(raw) == NODE
    assert json.loads(raw) == {
        "v": 1, "node_id": "pf-1", "incarnation": "1a2b", "endpoint": "tcp://10.0.0.1:7700", "role": "prefill",
        "pool_bytes": 1 << 30, "block_size": 1 << 20, "protocol": [1, 2], "curve_public": None,
        "labels": {"zone": "a", "host": "h1"}, "started_at": 1700000000.5, "device": "cpu"}
    assert encode_node(decode_node(raw)) == raw  # one record, one encoding (conditional deletes rely on it)


def test_holder_roundtrip_and_golden_json():
    raw = encode_holder(HOLDER)
    assert raw == (b'{"expires_at":1700000600.0,"gen":7,"incarnation":"1a2b","nbytes":4096,"node_id":"pf-1",'
                   b'"rid":"req-1","state":"complete","v":1}')
    assert decode_holder(raw) == HOLDER


def test_unknown_fields_are_ignored_and_optional_ones_default():
    obj = json.loads(encode_node(NODE)) | {"events_endpoint": "tcp://x:1", "future": {"a": 1}}
    assert decode_node(json.dumps(obj)) == NODE
    minimal = decode_node('{"v":1,"node_id":"d","incarnation":"ff","endpoint":"tcp://h:1"}')
    assert (minimal.role, minimal.protocol, minimal.labels, minimal.curve_public) == ("any", (1, 1), {}, None)
    h = decode_holder('{"v":1,"rid":"r","node_id":"d","incarnation":"1","gen":1,"nbytes":0,"x":1}')
    assert (h.state, h.expires_at) == ("complete", None)


@pytest.mark.parametrize("raw, words", [
    (b"not json", "not JSON"),
    (b"[1,2]", "not a JSON object"),
    (b'{"v":2,"node_id":"a","incarnation":"1","endpoint":"tcp://h:1"}', "version 2"),
    (b'{"node_id":"a","incarnation":"1","endpoint":"tcp://h:1"}', "version None"),
    (b'{"v":1,"incarnation":"1","endpoint":"tcp://h:1"}', "'node_id'"),
    (b'{"v":1,"node_id":"a","incarnation":"xyz","endpoint":"tcp://h:1"}', "'incarnation' must be a hex"),
    (b'{"v":1,"node_id":"a","incarnation":"1","endpoint":"tcp://h:1","role":"boss"}', "'role' must be one of"),
    (b'{"v":1,"node_id":"a","incarnation":"1","endpoint":"tcp://h:1","pool_bytes":-1}', "'pool_bytes'"),
    (b'{"v":1,"node_id":"a","incarnation":"1","endpoint":"tcp://h:1","pool_bytes":true}', "'pool_bytes'"),
    (b'{"v":1,"node_id":"a","incarnation":"1","endpoint":"tcp://h:1","protocol":[2,1]}', "'protocol'"),
    (b'{"v":1,"node_id":"a","incarnation":"1","endpoint":"tcp://h:1","labels":{"a":1}}', "'labels'"),
    (b'\xff\xfe', "not JSON"),
])
def test_bad_node_records_say_what_is_wrong(raw, words):
    with pytest.raises(RecordError, match=words.replace("[", r"\[").replace("(", r"\(")) as e:
        decode_node(raw)
    assert isinstance(e.value, ProtocolError) and isinstance(e.value, KvdError)
    assert "node record" in str(e.value)


def test_bad_holder_records():
    ok = json.loads(encode_holder(HOLDER))
    for field, bad in [("gen", "7"), ("nbytes", None), ("state", "partial"), ("rid", ""), ("expires_at", "soon")]:
        with pytest.raises(RecordError, match=f"holder record: field '{field}'"):
            decode_holder(json.dumps(ok | {field: bad}))


def test_rid_key_plain_escaped_and_hashed():
    assert rid_key("req-1.a_b") == "req-1.a_b"
    assert rid_key("a/b:c d%") == "a%2Fb%3Ac%20d%25"
    assert rid_key("~x") == "%7Ex"  # so a plain key never looks like a hashed one
    long = "r" * 129
    assert rid_key(long).startswith("~") and len(rid_key(long)) == 33
    assert rid_key("r" * 128) == "r" * 128
    assert rid_key("é").startswith("~") and rid_key("tab\t").startswith("~")
    assert rid_key(long) != rid_key(long + "x")


def test_key_schema():
    e, r = EtcdKeys("prod"), RedisKeys("prod")
    assert e.node("pf/1") == "/kvd/prod/nodes/pf%2F1"
    assert e.holder("req-1", "pf-1") == "/kvd/prod/req/req-1/pf-1"
    assert e.holders("req-1") == "/kvd/prod/req/req-1/"
    assert r.node("pf-1") == "kvd:prod:node:pf-1"
    assert r.nodes == "kvd:prod:nodes"
    assert r.holders("a:b") == "kvd:prod:req:a%3Ab"
    for bad in ("", "a/b", "a:b", "x" * 65, "-a"):
        with pytest.raises(ValueError, match="cluster name"):
            _ = EtcdKeys(bad).prefix


# --- vetting: what a reader of either backend believes

def _skips() -> tuple[list[tuple[str, str, str]], object]:
    seen: list[tuple[str, str, str]] = []
    return seen, lambda kind, reason, detail: seen.append((kind, reason, detail))


def test_vet_node_believes_a_record_under_its_own_key_and_skips_the_rest():
    seen, skip = _skips()
    assert vet_node(lambda: encode_node(NODE), "k/pf-1", lambda node_id: node_id == "pf-1", skip) == NODE
    assert seen == []
    assert vet_node(lambda: encode_node(NODE), "k/pf-2", lambda node_id: node_id == "pf-2", skip) is None
    assert vet_node(lambda: b"{not json", "k/x", lambda node_id: True, skip) is None

    def bad_base64() -> bytes:
        raise ValueError("Incorrect padding")

    assert vet_node(bad_base64, "k/y", lambda node_id: True, skip) is None
    assert [(kind, reason) for kind, reason, _ in seen] == [("node", "key_mismatch"), ("node", "undecodable"),
                                                           ("node", "undecodable")]
    assert seen[0][2] == "k/pf-2 holds node 'pf-1'" and seen[2][2] == "k/y: Incorrect padding"


def test_vet_holder_ignores_other_requests_and_expired_records_without_counting_them():
    seen, skip = _skips()
    raw = encode_holder(HOLDER)
    mine = lambda node_id: node_id == "pf-1"  # noqa: E731
    assert vet_holder(lambda: raw, "h", "req-1", mine, 1700000000.0, skip) == HOLDER
    assert vet_holder(lambda: raw, "h", "req-2", mine, 1700000000.0, skip) is None  # (a hashed key's other id)
    assert vet_holder(lambda: raw, "h", "req-1", mine, 1700000601.0, skip) is None  # expired
    assert seen == []
    assert vet_holder(lambda: raw, "h", "req-1", lambda node_id: False, 1700000000.0, skip) is None
    assert vet_holder(lambda: b"[]", "h", "req-1", mine, 1700000000.0, skip) is None
    assert [(kind, reason) for kind, reason, _ in seen] == [("holder", "key_mismatch"), ("holder", "undecodable")]
