"""Node certificates and the Authority that verifies them (daemon and router processes, `kvd keygen`).

Pure: no I/O. A cert is the cluster CA's Ed25519 signature over a small msgpack map (node id,
cluster, the node's CURVE public key, the node's Ed25519 signing key, issue time, expiry). It
travels as bytes (`NodeCert.raw`): in the peer hello, in the node's registry record, in NODE.cert.
Whoever shows a cert proves nothing by it alone; the proof is holding the secret half of a key it
names: CurveZMQ proves the CURVE key, a record signature proves the signing key.

Every signature is domain-separated (a cert, a node record and a holder record are signed over
different prefixes), so one kind can never be replayed as another.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgpack
from nacl.exceptions import BadSignatureError
from nacl.exceptions import ValueError as NaclValueError
from nacl.signing import SigningKey, VerifyKey

from kvd.errors import Unauthorized

CERT_VERSION = 1
MAX_CERT_BYTES = 1024  # a cert is ~300 bytes; the peer protocol's bin limit is 1 KiB
KEY_BYTES = 32
CERT_DOMAIN = b"kvd-cert-v1\0"
NODE_RECORD_DOMAIN = b"kvd-node-record-v1\0"
HOLDER_RECORD_DOMAIN = b"kvd-holder-record-v1\0"
_VERIFIED_KEEP = 4096  # certs whose CA signature was checked already (a verify costs ~60 us)


class CertError(Unauthorized):
    """A cert (or a signature under one) that does not admit its bearer. `reason` is a short word
    for metrics and logs: malformed, bad_signature, wrong_cluster, wrong_node, expired, denied,
    unsigned."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class NodeCert:
    node_id: str
    cluster: str
    curve_public: bytes  # 32 raw bytes: the key CurveZMQ authenticates
    sign_public: bytes  # 32 raw bytes: the Ed25519 key the node signs its registry records with
    issued_at: int  # unix seconds
    not_after: int  # unix seconds: expired from then on
    raw: bytes = field(default=b"", compare=False, repr=False)  # the encoding that travels

    @property
    def curve_z85(self) -> bytes:
        from zmq.utils import z85

        encoded: bytes = z85.encode(self.curve_public)
        return encoded


def _body(node_id: str, cluster: str, curve_public: bytes, sign_public: bytes, issued_at: int,
          not_after: int) -> bytes:
    body: bytes = msgpack.packb({"v": CERT_VERSION, "node_id": node_id, "cluster": cluster, "curve": curve_public,
                                 "sign": sign_public, "issued_at": issued_at, "not_after": not_after},
                                use_bin_type=True)
    return body


def issue(ca_seed: bytes, node_id: str, cluster: str, curve_public: bytes, sign_public: bytes, *,
          valid_for: float, now: float | None = None) -> NodeCert:
    """The CA signs a cert for node_id (ca_seed: the CA's 32-byte Ed25519 secret seed)."""
    if len(curve_public) != KEY_BYTES or len(sign_public) != KEY_BYTES:
        raise ValueError("a cert names two 32-byte public keys")
    if valid_for <= 0:
        raise ValueError("a cert must be valid for a positive time")
    issued = int(time.time() if now is None else now)
    body = _body(node_id, cluster, curve_public, sign_public, issued, issued + int(valid_for))
    sig = SigningKey(ca_seed).sign(CERT_DOMAIN + body).signature
    raw = msgpack.packb([CERT_VERSION, body, sig], use_bin_type=True)
    return decode(raw)


def decode(raw: bytes) -> NodeCert:
    """Parse a cert's encoding (its CA signature is not checked here: Authority.verify does)."""
    cert, _, _ = _parse(raw)
    return cert


def _parse(raw: bytes) -> tuple[NodeCert, bytes, bytes]:
    if not isinstance(raw, (bytes, bytearray)) or not 0 < len(raw) <= MAX_CERT_BYTES:
        raise CertError("malformed", f"a node cert is 1-{MAX_CERT_BYTES} bytes")
    raw = bytes(raw)
    try:
        outer = msgpack.unpackb(raw, raw=False, max_bin_len=MAX_CERT_BYTES, max_str_len=256,
                                max_array_len=8, max_map_len=16)
        version, body, sig = outer
        fields = msgpack.unpackb(body, raw=False, max_bin_len=64, max_str_len=256, max_array_len=0,
                                 max_map_len=16)
        cert = NodeCert(node_id=fields["node_id"], cluster=fields["cluster"], curve_public=fields["curve"],
                        sign_public=fields["sign"], issued_at=fields["issued_at"], not_after=fields["not_after"],
                        raw=raw)
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise CertError("malformed", f"not a kvd node cert ({type(exc).__name__})") from None
    ok = (version == CERT_VERSION and isinstance(body, bytes) and isinstance(sig, bytes) and len(sig) == 64
          and fields.get("v") == CERT_VERSION and isinstance(cert.node_id, str) and cert.node_id
          and isinstance(cert.cluster, str) and isinstance(cert.curve_public, bytes)
          and len(cert.curve_public) == KEY_BYTES and isinstance(cert.sign_public, bytes)
          and len(cert.sign_public) == KEY_BYTES
          and all(type(t) is int for t in (cert.issued_at, cert.not_after)))
    if not ok:
        raise CertError("malformed", "not a kvd node cert (a field is missing or of the wrong type)")
    return cert, body, sig


def signature_valid(public: bytes, domain: bytes, payload: bytes, signature: bytes) -> bool:
    try:
        VerifyKey(public).verify(domain + payload, signature)
        return True
    except (BadSignatureError, NaclValueError, TypeError, ValueError):
        return False


class Authority:
    """The cluster CA's public half: which certs admit their bearer, here and now.

    `denied` (CURVE public keys in Z85, from --curve-deny) can be replaced while running (SIGHUP);
    a denied key is refused even with a valid cert. `clock` gives unix time (tests step it)."""

    def __init__(self, ca_public: bytes, cluster: str, denied: Iterable[bytes] = (),
                 clock: Callable[[], float] = time.time) -> None:
        if len(ca_public) != KEY_BYTES:
            raise ValueError("the CA public key is 32 bytes")
        self.ca_public = bytes(ca_public)
        self.cluster = cluster
        self.denied: frozenset[bytes] = frozenset(denied)
        self.clock = clock
        self._verified: dict[bytes, NodeCert] = {}  # raw -> cert whose CA signature holds

    def verify(self, raw: bytes, node_id: str | None = None) -> NodeCert:
        """The cert in `raw`, if the CA signed it for this cluster (and for node_id, when given),
        it has not expired and its key is not denied; else CertError saying which."""
        cert = self._verified.get(raw) if isinstance(raw, bytes) else None
        if cert is None:
            cert, body, sig = _parse(raw)
            if not signature_valid(self.ca_public, CERT_DOMAIN, body, sig):
                raise CertError("bad_signature", f"the cert of {cert.node_id!r} is not signed by this cluster's CA")
            if len(self._verified) >= _VERIFIED_KEEP:
                self._verified.clear()
            self._verified[cert.raw] = cert
        if cert.cluster != self.cluster:
            raise CertError("wrong_cluster", f"the cert of {cert.node_id!r} is for cluster {cert.cluster!r}, "
                                             f"not {self.cluster!r}")
        if node_id is not None and cert.node_id != node_id:
            raise CertError("wrong_node", f"a cert for node {cert.node_id!r} cannot speak for {node_id!r}")
        if self.clock() >= cert.not_after:
            raise CertError("expired", f"the cert of {cert.node_id!r} expired at "
                                       f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(cert.not_after))}")
        if cert.curve_z85 in self.denied:
            raise CertError("denied", f"the key of {cert.node_id!r} is on the deny list (--curve-deny)")
        return cert


class NodeSigner:
    """A node's own signing key and cert: what it signs its registry records with."""

    def __init__(self, sign_seed: bytes, cert: NodeCert) -> None:
        self._key = SigningKey(sign_seed)
        if bytes(self._key.verify_key) != cert.sign_public:
            raise CertError("wrong_node", f"the cert of {cert.node_id!r} names another signing key than this "
                                          "node's secret key file holds (re-run kvd keygen with --ca-secret)")
        self.cert = cert

    def sign(self, domain: bytes, payload: bytes) -> bytes:
        return self._key.sign(domain + payload).signature
