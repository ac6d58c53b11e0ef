"""Node certs and the Authority, without I/O: what admits a bearer, and every way a cert fails."""
from __future__ import annotations

import msgpack
import pytest
import zmq
from nacl.signing import SigningKey

from kvd.trust import Authority, CertError, NodeSigner, issue
from kvd.trust.certs import (
    CERT_DOMAIN,
    HOLDER_RECORD_DOMAIN,
    MAX_CERT_BYTES,
    NODE_RECORD_DOMAIN,
    decode,
    signature_valid,
)

NOW = 1_800_000_000.0


class Node:
    def __init__(self) -> None:
        self.curve_public, self.curve_secret = zmq.curve_keypair()
        self.sign = SigningKey.generate()

    def cert(self, ca: SigningKey, node_id: str = "n1", cluster: str = "prod", valid_for: float = 3600, now=NOW):
        from zmq.utils import z85

        return issue(bytes(ca), node_id, cluster, z85.decode(self.curve_public), bytes(self.sign.verify_key),
                     valid_for=valid_for, now=now)


@pytest.fixture
def ca():
    return SigningKey.generate()


def authority(ca: SigningKey, cluster: str = "prod", now: float = NOW, denied=()) -> Authority:
    return Authority(bytes(ca.verify_key), cluster, denied, clock=lambda: now)


def test_a_cert_the_ca_signed_admits_its_node(ca):
    node = Node()
    cert = node.cert(ca)
    got = authority(ca).verify(cert.raw, "n1")
    assert got == cert and got.curve_z85 == node.curve_public and got.sign_public == bytes(node.sign.verify_key)
    assert authority(ca).verify(cert.raw) == cert  # without a node id to check against
    assert len(cert.raw) < 400 and decode(cert.raw) == cert


@pytest.mark.parametrize("case, reason", [
    ("another CA", "bad_signature"),
    ("another node id", "wrong_node"),
    ("another cluster", "wrong_cluster"),
    ("expired", "expired"),
    ("denied", "denied"),
])
def test_a_cert_is_refused_for_what_it_does_not_say(ca, case, reason):
    node = Node()
    cert = node.cert(ca)
    check = {
        "another CA": lambda: authority(SigningKey.generate()).verify(cert.raw, "n1"),
        "another node id": lambda: authority(ca).verify(cert.raw, "n2"),
        "another cluster": lambda: authority(ca, cluster="dev").verify(cert.raw, "n1"),
        "expired": lambda: authority(ca, now=NOW + 3600).verify(cert.raw, "n1"),
        "denied": lambda: authority(ca, denied={node.curve_public}).verify(cert.raw, "n1"),
    }[case]
    with pytest.raises(CertError) as err:
        check()
    assert err.value.reason == reason


def test_a_cert_verified_once_is_still_checked_for_expiry_and_denial(ca):
    node = Node()
    cert = node.cert(ca)
    now = [NOW]
    auth = Authority(bytes(ca.verify_key), "prod", clock=lambda: now[0])
    auth.verify(cert.raw, "n1")  # cached from here
    now[0] = NOW + 7200
    with pytest.raises(CertError, match="expired"):
        auth.verify(cert.raw, "n1")
    now[0] = NOW
    auth.denied = frozenset({node.curve_public})  # (a SIGHUP's new deny list)
    with pytest.raises(CertError, match="deny list"):
        auth.verify(cert.raw, "n1")


def test_a_tampered_cert_does_not_verify(ca):
    node, other = Node(), Node()
    cert = node.cert(ca)
    version, body, sig = msgpack.unpackb(cert.raw, raw=False)
    fields = msgpack.unpackb(body, raw=False)
    from zmq.utils import z85
    for change in ({"node_id": "n2"}, {"curve": z85.decode(other.curve_public)}, {"not_after": int(NOW) + 10**9}):
        forged = msgpack.packb([version, msgpack.packb({**fields, **change}, use_bin_type=True), sig],
                               use_bin_type=True)
        with pytest.raises(CertError) as err:
            authority(ca).verify(forged)
        assert err.value.reason == "bad_signature"


@pytest.mark.parametrize("raw", [b"", b"\x00" * (MAX_CERT_BYTES + 1), b"not msgpack \xc1", msgpack.packb([1, 2, 3]),
                                 msgpack.packb([1, msgpack.packb({"v": 1}), b"s" * 64], use_bin_type=True),
                                 msgpack.packb({"a": 1})])
def test_garbage_is_a_malformed_cert(ca, raw):
    with pytest.raises(CertError) as err:
        authority(ca).verify(raw)
    assert err.value.reason == "malformed"


def test_signatures_are_domain_separated(ca):
    node = Node()
    signer = NodeSigner(bytes(node.sign), node.cert(ca))
    sig = signer.sign(NODE_RECORD_DOMAIN, b"payload")
    public = bytes(node.sign.verify_key)
    assert signature_valid(public, NODE_RECORD_DOMAIN, b"payload", sig)
    assert not signature_valid(public, HOLDER_RECORD_DOMAIN, b"payload", sig)
    assert not signature_valid(public, CERT_DOMAIN, b"payload", sig)
    assert not signature_valid(public, NODE_RECORD_DOMAIN, b"payloaD", sig)
    assert not signature_valid(b"short", NODE_RECORD_DOMAIN, b"payload", sig)


def test_a_signer_refuses_a_cert_of_another_signing_key(ca):
    node, other = Node(), Node()
    with pytest.raises(CertError, match="another signing key"):
        NodeSigner(bytes(other.sign), node.cert(ca))


def test_issue_refuses_nonsense(ca):
    node = Node()
    with pytest.raises(ValueError):
        node.cert(ca, valid_for=0)
    with pytest.raises(ValueError):
        issue(bytes(ca), "n1", "prod", b"short", bytes(node.sign.verify_key), valid_for=10)
