"""kvd.trust: who a cluster admits (any process that deals in node identities: the daemon, `kvd
keygen`, routers that read the registry).

One cluster CA (an Ed25519 key pair) signs a certificate per node: its node id, cluster, CURVE
public key (what CurveZMQ authenticates) and signing key (what its registry records are signed
with), until an expiry. Whoever holds a cert the CA signed is trusted as that node id, and only as
that one. Pure except for files.py (key files on disk); imports only PyNaCl, msgpack and kvd.errors.

Modules: certs (certificates, the Authority that verifies them), files (CA, node and cert files,
the deny list).
"""
from .certs import Authority, CertError, NodeCert, NodeSigner, issue
from .files import (
    NodeKeys,
    load_ca_public,
    load_ca_secret,
    load_cert,
    load_deny,
    load_node_keys,
    write_ca,
    write_cert,
    write_node_keys,
)

__all__ = [
    "Authority", "CertError", "NodeCert", "NodeKeys", "NodeSigner", "issue", "load_ca_public", "load_ca_secret",
    "load_cert", "load_deny", "load_node_keys", "write_ca", "write_cert", "write_node_keys",
]
