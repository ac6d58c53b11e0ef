"""Signed registry records (daemon and router processes): a node signs what it writes, readers that
know the cluster CA believe only what verifies.

Pure but for logging. With a CA, a node record carries the node's cert and the node's signature
over the rest of the record; a holder record carries the holder node's signature, checked with the
signing key of that node's (verified) cert. So whoever can write to the registry can delete or
replay records, never make a reader dial an endpoint under a key the CA did not give that node id,
nor believe that a node holds an entry it never said it holds. Replays stay hints: the holder
checks its incarnation and the entry's generation before it serves a byte.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import logging
from collections import Counter

from kvd.throttle import Throttle
from kvd.trust import Authority, CertError, NodeCert, NodeSigner
from kvd.trust.certs import HOLDER_RECORD_DOMAIN, NODE_RECORD_DOMAIN, signature_valid

from .records import HolderRecord, NodeRecord, holder_payload, node_payload

log = logging.getLogger(__name__)
LOG_EVERY = 60.0  # seconds between log lines about dropped records of one kind and reason
_VERIFIED_KEEP = 65536  # node records whose signature was checked (a check costs ~120 us)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _unb64(text: str | None) -> bytes | None:
    if text is None:
        return None
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


class RecordSigner:
    """A node's side: its node record and its holder records, signed."""

    def __init__(self, signer: NodeSigner) -> None:
        self.signer = signer

    def node(self, record: NodeRecord) -> NodeRecord:
        unsigned = dataclasses.replace(record, cert=_b64(self.signer.cert.raw), sig=None, payload=b"",
                                       curve_public=self.signer.cert.curve_z85.decode())
        sig = self.signer.sign(NODE_RECORD_DOMAIN, node_payload(unsigned))
        return dataclasses.replace(unsigned, sig=_b64(sig))

    def holder(self, record: HolderRecord) -> HolderRecord:
        unsigned = dataclasses.replace(record, sig=None, payload=b"")
        return dataclasses.replace(unsigned, sig=_b64(self.signer.sign(HOLDER_RECORD_DOMAIN, holder_payload(unsigned))))


class RecordVerifier:
    """A reader's side: which records to believe. `dropped` counts the rest by (kind, reason) for
    kvd_registry_records_dropped_total; each kind and reason is logged at most once a minute."""

    def __init__(self, authority: Authority) -> None:
        self.authority = authority
        self.dropped: Counter[tuple[str, str]] = Counter()
        self._logged = Throttle(LOG_EVERY)  # by (kind, reason)
        self._verified: dict[tuple[str, bytes, str], NodeCert] = {}  # (node id, payload, sig) -> its cert

    def node(self, record: NodeRecord) -> NodeCert | None:
        """The record's verified cert, or None (dropped) when it does not verify."""
        key = (record.node_id, node_payload(record), record.sig or "")
        cert = self._verified.get(key)
        if cert is not None:
            try:  # (a cached cert may have expired or been denied since)
                return self.authority.verify(cert.raw, record.node_id)
            except CertError as exc:
                self._verified.pop(key, None)
                self._drop("node", exc.reason, f"node {record.node_id!r}: {exc.message}")
                return None
        raw_cert, sig = _unb64(record.cert), _unb64(record.sig)
        if raw_cert is None or sig is None:
            self._drop("node", "unsigned", f"node {record.node_id!r}: its record carries no cert and "
                                           "signature, and this cluster has a CA")
            return None
        try:
            cert = self.authority.verify(raw_cert, record.node_id)
        except CertError as exc:
            self._drop("node", exc.reason, f"node {record.node_id!r}: {exc.message}")
            return None
        if record.curve_public is not None and record.curve_public.encode() != cert.curve_z85:
            self._drop("node", "key_mismatch", f"node {record.node_id!r}: its record names another CURVE "
                                               "key than its cert")
            return None
        if not signature_valid(cert.sign_public, NODE_RECORD_DOMAIN, key[1], sig):
            self._drop("node", "bad_signature", f"node {record.node_id!r}: its record is not signed by "
                                                "the key its cert names")
            return None
        if len(self._verified) >= _VERIFIED_KEEP:
            self._verified.clear()
        self._verified[key] = cert
        return cert

    def holder(self, record: HolderRecord, node: NodeCert) -> bool:
        """Did the node whose verified cert is `node` sign this holder record?"""
        sig = _unb64(record.sig)
        if sig is None:
            self._drop("holder", "unsigned", f"holder of {record.rid!r} on {record.node_id!r}: not signed")
            return False
        if node.node_id != record.node_id or not signature_valid(node.sign_public, HOLDER_RECORD_DOMAIN,
                                                                 holder_payload(record), sig):
            self._drop("holder", "bad_signature", f"holder of {record.rid!r} on {record.node_id!r}: not signed "
                                                  "by that node")
            return False
        return True

    def _drop(self, kind: str, reason: str, message: str) -> None:
        self.dropped[(kind, reason)] += 1
        if self._logged.allow((kind, reason)):
            log.warning("registry: dropped a %s record that does not verify (%s): %s (again at most once a minute; "
                        "counted in kvd_registry_records_dropped_total)", kind, reason, message)
        return None
