"""Key, cert and deny-list files (the `kvd keygen` process, and the daemon process reading them at start and on SIGHUP).

Formats (text, so that they fit a Kubernetes Secret or a config-management template):
- `ca.key` / `ca.key_secret`: the cluster CA's Ed25519 public key / secret seed, Z85, ZPL-style
  (`ca` section, `sign-public-key = "..."`, `sign-secret-key = "..."`). The secret file is 0600.
- `NODE.key` / `NODE.key_secret`: ZeroMQ's own certificate files (zmq.auth reads them), with the
  node's Ed25519 signing key beside the CURVE pair in the `metadata` section. Old pairs without a
  signing key still work for `--curve-allow`; a cert needs one.
- `NODE.cert`: `cert = "<base64>"` of the cert's encoding, and a comment saying what it says.
- the deny list: one Z85 CURVE public key a line, optionally followed by a `# comment`; a line
  whose first word starts with `#` (and is not a 40-character key: `#` is a Z85 digit) is a comment.
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import datetime
import os
from dataclasses import dataclass

from nacl.signing import SigningKey

from kvd.errors import BadRequest

from .certs import CertError, NodeCert, decode

Z85_KEY_LENGTH = 40  # a 32-byte key in Z85


def _z85(raw: bytes) -> str:
    from zmq.utils import z85

    return z85.encode(raw).decode()


def _unz85(text: str, path: str, name: str) -> bytes:
    from zmq.utils import z85

    if len(text) != Z85_KEY_LENGTH:
        raise BadRequest(f"{path}: {name} is not a Z85 key of {Z85_KEY_LENGTH} characters")
    try:
        return z85.decode(text.encode())
    except (ValueError, KeyError, TypeError):
        raise BadRequest(f"{path}: {name} is not valid Z85") from None


def _fields(path: str) -> dict[str, str]:
    """`name = "value"` lines of a ZPL-style file (sections and comments skipped)."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read(1 << 16)
    except (OSError, UnicodeDecodeError) as exc:
        raise BadRequest(f"cannot read {path}: {exc}") from None
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        name, _, value = line.partition("=")
        out[name.strip()] = value.strip().strip("'\"")
    return out


def _write(path: str, text: str, secret: bool) -> None:
    """Write a new file (0600 for a secret, 0644 else); an existing one is replaced atomically."""
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600 if secret else 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, 0o600 if secret else 0o644)  # (the umask may have narrowed the public one)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _stamp() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def refuse_existing(paths: list[str], why: str) -> None:
    existing = [path for path in paths if os.path.lexists(path)]
    if existing:
        raise BadRequest(f"{' and '.join(existing)} already exist{'s' if len(existing) == 1 else ''}: not "
                         f"overwritten, since {why}; --force replaces {'them' if len(existing) > 1 else 'it'}, "
                         "--if-missing keeps what is there and exits 0")


# ---- the CA -----------------------------------------------------------------------------------

def write_ca(directory: str, *, force: bool = False) -> tuple[str, str]:
    """A new CA: ca.key (public, for every node's --curve-ca) and ca.key_secret (0600)."""
    public, secret = os.path.join(directory, "ca.key"), os.path.join(directory, "ca.key_secret")
    if not force:
        refuse_existing([public, secret], "every node's cert is signed by the old CA and would stop verifying")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    key = SigningKey.generate()
    pub = _z85(bytes(key.verify_key))
    _write(public, f"#   kvd cluster CA, public key ({_stamp()}): give it to every node as --curve-ca\nca\n"
                   f'    sign-public-key = "{pub}"\n', secret=False)
    _write(secret, f"#   kvd cluster CA, SECRET key ({_stamp()}): whoever holds it admits nodes to the cluster.\n"
                   "#   Keep it off the nodes: only the step that signs a node's cert needs it.\nca\n"
                   f'    sign-public-key = "{pub}"\n    sign-secret-key = "{_z85(bytes(key))}"\n', secret=True)
    return public, secret


def load_ca_public(path: str) -> bytes:
    fields = _fields(path)
    if "sign-public-key" not in fields:
        raise BadRequest(f"{path} is not a kvd CA key (no sign-public-key; make one with `kvd keygen --ca`)")
    return _unz85(fields["sign-public-key"], path, "sign-public-key")


def load_ca_secret(path: str) -> bytes:
    fields = _fields(path)
    if "sign-secret-key" not in fields:
        raise BadRequest(f"{path} holds no CA secret (give the ca.key_secret file from `kvd keygen --ca`)")
    seed = _unz85(fields["sign-secret-key"], path, "sign-secret-key")
    if "sign-public-key" in fields and bytes(SigningKey(seed).verify_key) != load_ca_public(path):
        raise BadRequest(f"{path}: its public and secret keys do not belong together")
    return seed


# ---- a node's keys ------------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeKeys:
    curve_public: bytes  # Z85
    curve_secret: bytes | None  # Z85; None in a public .key file
    sign_seed: bytes | None = None  # the Ed25519 secret seed; None in public files and old pairs
    sign_public: bytes | None = None  # raw 32 bytes

    @classmethod
    def generate(cls) -> NodeKeys:
        import zmq

        public, secret = zmq.curve_keypair()
        sign = SigningKey.generate()
        return cls(public, secret, bytes(sign), bytes(sign.verify_key))

    def with_signing_key(self) -> NodeKeys:
        """The same CURVE pair, with a signing key (an old pair gets one, for its first cert)."""
        if self.sign_seed is not None:
            return self
        sign = SigningKey.generate()
        return NodeKeys(self.curve_public, self.curve_secret, bytes(sign), bytes(sign.verify_key))

    @property
    def curve_public_raw(self) -> bytes:
        from zmq.utils import z85

        return z85.decode(self.curve_public)


def write_node_keys(directory: str, name: str, keys: NodeKeys) -> tuple[str, str]:
    """NAME.key (public: CURVE key and signing key) and NAME.key_secret (0600)."""
    assert keys.curve_secret is not None and keys.sign_seed is not None and keys.sign_public is not None
    os.makedirs(directory, mode=0o700, exist_ok=True)
    public, secret = os.path.join(directory, f"{name}.key"), os.path.join(directory, f"{name}.key_secret")
    sign_public = _z85(keys.sign_public)
    head = f"#   ZeroMQ CURVE {{}} Certificate of kvd node {name} ({_stamp()})\n"
    meta = f'metadata\n    sign-public-key = "{sign_public}"\n'
    curve = f'curve\n    public-key = "{keys.curve_public.decode()}"\n'
    _write(public, head.format("Public") + "#   Give it to the peers' --curve-allow (not needed with a CA)\n"
           + meta + curve, secret=False)
    _write(secret, head.format("**** Secret ****") + "#   This node's identity: never share it\n" + meta
           + f'    sign-secret-key = "{_z85(keys.sign_seed)}"\n' + curve
           + f'    secret-key = "{keys.curve_secret.decode()}"\n', secret=True)
    return public, secret


def load_node_keys(path: str) -> NodeKeys:
    fields = _fields(path)
    if "public-key" not in fields:
        raise BadRequest(f"{path} holds no CURVE public key (a file from `kvd keygen`?)")
    curve_public = fields["public-key"].encode()
    _unz85(fields["public-key"], path, "public-key")
    curve_secret = fields["secret-key"].encode() if "secret-key" in fields else None
    if curve_secret is not None:
        _unz85(fields["secret-key"], path, "secret-key")
    seed = _unz85(fields["sign-secret-key"], path, "sign-secret-key") if "sign-secret-key" in fields else None
    sign_public = bytes(SigningKey(seed).verify_key) if seed is not None else (
        _unz85(fields["sign-public-key"], path, "sign-public-key") if "sign-public-key" in fields else None)
    return NodeKeys(curve_public, curve_secret, seed, sign_public)


# ---- certs ----------------------------------------------------------------------------------------

def write_cert(path: str, cert: NodeCert) -> None:
    until = datetime.datetime.fromtimestamp(cert.not_after, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    _write(path, f"#   kvd node cert: node {cert.node_id} of cluster {cert.cluster}, valid until {until}, "
                 "signed by the cluster CA\n"
                 f'cert = "{base64.b64encode(cert.raw).decode()}"\n', secret=False)


def load_cert(path: str) -> NodeCert:
    """A cert file's cert (parsed, not yet verified: the daemon's Authority does that)."""
    fields = _fields(path)
    try:
        raw = base64.b64decode(fields["cert"], validate=True)
    except (KeyError, binascii.Error, ValueError):
        raise BadRequest(f"{path} is not a kvd node cert file (a `cert = \"...\"` line from `kvd keygen`)") from None
    try:
        return decode(raw)
    except CertError as exc:
        raise BadRequest(f"{path}: {exc.message}") from None


def load_deny(path: str) -> frozenset[bytes]:
    """The deny list: Z85 CURVE public keys, one a line (blank lines and # comments skipped)."""
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read(1 << 24).splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise BadRequest(f"cannot read the deny list {path}: {exc}") from None
    keys = set()
    for number, line in enumerate(lines, 1):
        words = line.split()
        if not words or (words[0].startswith("#") and len(words[0]) != Z85_KEY_LENGTH):
            continue  # blank, or a comment ('#' is also a Z85 digit: a key is the 40-character word)
        key = words[0]
        if len(key) != Z85_KEY_LENGTH or (len(words) > 1 and not words[1].startswith("#")):
            raise BadRequest(f"{path}:{number}: not a Z85 CURVE public key ({Z85_KEY_LENGTH} characters, as in a "
                             "NODE.key's public-key line)")
        keys.add(key.encode())
    return frozenset(keys)

