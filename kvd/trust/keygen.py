"""`kvd keygen`: a cluster CA, a node's key pair, and the node's cert (the command's process).

The CA flow is three commands:
    kvd keygen --ca --dir D                                   # D/ca.key, D/ca.key_secret
    kvd keygen NODE --dir D --ca-secret D/ca.key_secret       # D/NODE.key, .key_secret, .cert
    kvd serve --curve-secret-key D/NODE.key_secret --curve-ca D/ca.key
Running the second again renews the cert of the same key pair (no --force needed): that is the
renewal path before a cert expires, followed by SIGHUP. A daemon dials a static `--peer B` under
the key of the CA-verified B.cert beside its own cert: the certs of D are all it needs (across
hosts, copy each node's NODE.cert into the others' D; a registry carries them instead).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from kvd.errors import BadRequest

from .certs import issue
from .files import (
    NodeKeys,
    load_ca_public,
    load_ca_secret,
    load_node_keys,
    refuse_existing,
    write_ca,
    write_cert,
    write_node_keys,
)

DEFAULT_VALIDITY = 30 * 86400.0  # seconds: short enough that an expiry revokes, long enough to renew calmly


@dataclass(frozen=True)
class Written:
    public: str
    secret: str
    cert: str | None = None
    renewed: bool = False  # an existing pair kept, only its cert (re)issued
    kept: bool = False  # if_missing: the files were there already, and nothing was written


def keygen_ca(directory: str, *, force: bool = False, if_missing: bool = False) -> Written:
    """A new CA; with if_missing, an existing one (both halves, belonging together) is kept."""
    public, secret = os.path.join(directory, "ca.key"), os.path.join(directory, "ca.key_secret")
    if if_missing and not force and (os.path.lexists(public) or os.path.lexists(secret)):
        if not (os.path.exists(public) and os.path.exists(secret)):
            raise BadRequest(f"only one half of a CA is in {directory} ({public if os.path.exists(public) else secret}"
                             "): not kept, not replaced; restore the other half, or --force a new CA")
        from nacl.signing import SigningKey

        if load_ca_public(public) != bytes(SigningKey(load_ca_secret(secret)).verify_key):
            raise BadRequest(f"{public} and {secret} are halves of two different CAs: not kept, not replaced")
        return Written(public, secret, kept=True)
    public, secret = write_ca(directory, force=force)
    return Written(public, secret)


def keygen_node(directory: str, name: str, *, force: bool = False, ca_secret: str | None = None,
                cluster: str = "kvd", valid_for: float = DEFAULT_VALIDITY, if_missing: bool = False) -> Written:
    """NAME.key and NAME.key_secret; with ca_secret, also NAME.cert signed by that CA.

    An existing pair is kept unless force: peers that allow its public key would refuse a new one.
    With ca_secret it gets a fresh cert instead (and a signing key, if it is an old pair)."""
    public, secret = os.path.join(directory, f"{name}.key"), os.path.join(directory, f"{name}.key_secret")
    seed = load_ca_secret(ca_secret) if ca_secret else None  # a bad CA file fails before anything is written
    existing = os.path.exists(secret) and not force
    if existing and seed is None and if_missing:  # (with a CA the pair is kept anyway, its cert renewed)
        load_node_keys(secret)
        return Written(public, secret, kept=True)
    if existing and seed is not None:
        keys = load_node_keys(secret)
        if keys.curve_secret is None:
            existing = False
        elif keys.sign_seed is None or not os.path.exists(public):
            keys = keys.with_signing_key()  # an old pair gets a signing key; its CURVE identity stays
            write_node_keys(directory, name, keys)
    if not existing or seed is None:
        if not force:
            refuse_existing([public, secret], "every peer that allows the old key would refuse this node")
        keys = NodeKeys.generate()
        write_node_keys(directory, name, keys)
        existing = False
    if seed is None:
        return Written(public, secret)
    assert keys.sign_public is not None
    cert_path = os.path.join(directory, f"{name}.cert")
    write_cert(cert_path, issue(seed, name, cluster, keys.curve_public_raw, keys.sign_public, valid_for=valid_for))
    return Written(public, secret, cert_path, renewed=existing)
