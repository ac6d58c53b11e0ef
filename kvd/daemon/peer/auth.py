"""CurveZMQ authentication and encryption between daemons (daemon process).

With `--curve-secret-key FILE` (a key pair written by `kvd keygen`) the peer listener becomes a
CURVE server and every peer link a CURVE client. Encryption alone is not access control: a
CURVE server without a ZAP handler accepts any client key. Two ways admit a peer, either one:

- `--curve-ca ca.key`: any peer whose cert the cluster CA signed. ZeroMQ's handshake proves the
  peer holds the CURVE key; its peer_hello carries the cert, which must name that key and the node
  id the peer claims (`admits`). To dial a node, its key comes from its cert in the registry record
  (verified) or from a NAME.key file below.
- `--curve-allow`: public key files (NAME.key: that key may only call itself NAME), directories
  of them, or Z85 strings (such a key may call itself anything). A file NAME.key also gives the
  key to dial peer NAME; with a CA, so does a peer's NAME.cert (for static peers, no registry).

`--curve-deny FILE` lists revoked keys: refused by either way, and cut at once on SIGHUP. A key
(or cert) a SIGHUP takes out of `--curve-allow` is cut at once too, and refused from then on even
where the CA would admit it (`revoked`: until it is put back, or a restart; the deny list is the
lasting way). The daemon refuses to start when it cannot enforce any of this.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from kvd.errors import BadRequest, KvdError
from kvd.throttle import Throttle
from kvd.trust import Authority, CertError, NodeCert, NodeSigner, load_ca_public, load_cert, load_deny, load_node_keys

log = logging.getLogger(__name__)

Z85_KEY_LENGTH = 40  # a 32-byte Curve25519 key in Z85
ZAP_DOMAIN = "kvd"  # the authenticator only answers for domains it was configured with


@dataclass
class CurveKeys:
    public: bytes
    secret: bytes
    allowed: set[bytes] = field(default_factory=set)
    peer_keys: dict[str, bytes] = field(default_factory=dict)  # peer name -> its public key (NAME.key)
    names: dict[bytes, str] = field(default_factory=dict)  # allowed key -> the only node id it may claim
    denied: frozenset[bytes] = frozenset()  # revoked keys (--curve-deny)
    # with a CA: keys a SIGHUP took out of --curve-allow, refused until put back (the CA would still
    # admit them; a restart forgets this: --curve-deny is the lasting way)
    revoked: set[bytes] = field(default_factory=set)
    listed: set[bytes] = field(default_factory=set)  # the keys --curve-allow names (not the certs beside ours)
    authority: Authority | None = None  # the cluster CA (--curve-ca)
    signer: NodeSigner | None = None  # our signing key and cert, with a CA
    cert_dir: str = ""  # with a CA: where this node's cert lies, and the certs of static peers beside it
    unusable: dict[str, str] = field(default_factory=dict)  # NAME -> why NAME.cert there gives no key

    @property
    def cert(self) -> NodeCert | None:
        return self.signer.cert if self.signer is not None else None

    def server_key_for(self, peer_name: str, registry_key: Callable[[str], bytes | None] | None = None) -> bytes:
        """The key peer_name must prove it holds: its NAME.key, else (registry_key) a cluster node's key
        from its registry record, once that record's cert verified."""
        key = self.peer_keys.get(peer_name) or (registry_key(peer_name) if registry_key is not None else None)
        if key is not None:
            if key in self.denied:
                raise BadRequest(f"the CURVE key of peer {peer_name!r} is on the deny list (--curve-deny)")
            if key in self.revoked:
                raise BadRequest(f"the CURVE key of peer {peer_name!r} was taken out of --curve-allow")
            return key
        if peer_name.startswith("tcp://"):  # an endpoint that is no configured peer's
            raise BadRequest(
                f"CURVE is on and {peer_name} is not the endpoint of a configured peer, so this daemon has no "
                f"key to check it by: add it as --peer NAME={peer_name} (TOML [peers]) with NAME.key among "
                "--curve-allow, then SIGHUP; with a cluster registry, name the node by its id instead"
            )
        if self.authority is not None:
            beside = self.unusable.get(peer_name) or f"there is no {peer_name}.cert beside this node's cert"
            raise BadRequest(f"CURVE is on and no key of peer {peer_name!r} is known: it is not (yet) in the cluster "
                             f"registry with a cert of this cluster's CA, {beside} (in {self.cert_dir or '.'}: "
                             f"copy {peer_name}'s cert there, then SIGHUP), and {peer_name}.key is not among "
                             "--curve-allow")
        raise BadRequest(
            f"CURVE is on but there is no public key for peer {peer_name!r}: put {peer_name}.key "
            "among --curve-allow (then SIGHUP to reload the allow list)"
        )

    def take_out(self, fresh: CurveKeys) -> set[bytes]:
        """A reload: with a CA, the keys --curve-allow named (as NAME.key, NAME.cert or Z85) and no
        longer names are refused from now on, and those it names again are not. Returns the keys
        newly refused. (Without a CA a key not allowed is refused anyway.)"""
        if self.authority is None:
            return set()
        before, after = self.listed, fresh.listed  # (a cert beside ours is the CA's word, not the list's)
        taken = before - after - fresh.denied - self.revoked
        self.revoked -= after
        self.revoked |= taken
        return taken

    def zap_admits(self, key: bytes) -> bool:
        """ZeroMQ's handshake (the ZAP thread): may this key connect at all? With a CA any key not
        denied may, since the cert it must show comes in its hello (`admits`)."""
        return (key not in self.denied and key not in self.revoked
                and (key in self.allowed or self.authority is not None))

    def admits(self, key: bytes, node_id: str, cert: bytes | None) -> str | None:
        """May the peer that authenticated with `key` call itself `node_id`? None if so, else why not."""
        if key in self.denied:
            return "its CURVE key is on the deny list (--curve-deny)"
        if key in self.revoked:
            return "its CURVE key was taken out of --curve-allow (SIGHUP)"
        if key in self.allowed:
            bound = self.names.get(key)
            if bound is None or bound == node_id:
                return None
            if self.authority is None or cert is None:
                return f"its key is allowed as {bound!r} ({bound}.key among --curve-allow), not as {node_id!r}"
        if self.authority is None:
            return "its CURVE key is not among --curve-allow"
        if cert is None:
            return "it showed no cert, and its key is not among --curve-allow"
        try:
            verified = self.authority.verify(cert, node_id)
        except CertError as exc:
            return exc.message
        if verified.curve_z85 != key:
            return f"its cert for {node_id!r} names another CURVE key than the one it connected with"
        return None


def load_keys(secret_key_file: str, allow: list[str], *, ca_file: str = "", cert_file: str = "",
              deny_file: str = "", cluster: str = "kvd", node_id: str | None = None) -> CurveKeys:
    if not zmq.has("curve"):
        raise BadRequest("--curve-secret-key given, but this libzmq was built without CURVE support")
    own = load_node_keys(secret_key_file)
    if not own.curve_secret:
        raise BadRequest(f"{secret_key_file} holds no secret key (use the .key_secret file from `kvd keygen`)")
    denied = load_deny(deny_file) if deny_file else frozenset()
    authority = Authority(load_ca_public(ca_file), cluster, denied) if ca_file else None
    signer = _own_cert(authority, own, secret_key_file, cert_file, node_id) if authority is not None else None
    cert_dir = (os.path.dirname(os.path.abspath(cert_file or secret_key_file.removesuffix(".key_secret") + ".cert"))
                if authority is not None else "")
    keys = CurveKeys(own.curve_public, own.curve_secret, denied=denied, authority=authority, signer=signer,
                     cert_dir=cert_dir)
    if signer is not None:
        _add_certs_beside(keys, signer.cert.node_id)
    _add_allowed(keys, allow)
    if not keys.allowed and keys.authority is None:
        raise BadRequest("--curve-secret-key without --curve-allow or --curve-ca: no peer could ever connect")
    return keys


def _add_allowed(keys: CurveKeys, allow: list[str]) -> None:
    """--curve-allow: key files (NAME.key, NAME.cert), directories of them, or Z85 public keys."""
    for item in allow:
        if os.path.isdir(item):
            for name in sorted(os.listdir(item)):
                if name.endswith((".key", ".cert")) and name != "ca.key":  # (a CA key beside the nodes' is no node's)
                    _add_key_file(keys, os.path.join(item, name))
        elif os.path.isfile(item):
            _add_key_file(keys, item)
        elif len(item) == Z85_KEY_LENGTH:
            keys.allowed.add(item.encode())
            keys.listed.add(item.encode())
            log.warning("--curve-allow %s... names no node: that key may call itself any node id (a key file "
                        "NAME.key binds it to NAME)", item[:8])
        else:
            raise BadRequest(f"--curve-allow {item!r} is neither a key file, a directory, nor a Z85 public key")


def _own_cert(authority: Authority, own, secret_key_file: str, cert_file: str, node_id: str | None) -> NodeSigner:
    """Our cert, checked as a peer would check it: a daemon whose cert would be refused says so now."""
    path = cert_file or secret_key_file.removesuffix(".key_secret") + ".cert"
    if not os.path.exists(path):
        raise BadRequest(f"--curve-ca needs this node's cert: {path} does not exist (make it with `kvd keygen "
                         f"{node_id or 'NODE'} --dir DIR --ca-secret ca.key_secret`, or name it with --curve-cert)")
    cert = load_cert(path)
    try:
        authority.verify(cert.raw, node_id)
    except CertError as exc:
        raise BadRequest(f"this node's cert {path} would be refused by its peers: {exc.message}") from None
    if cert.curve_z85 != own.curve_public:
        raise BadRequest(f"{path} is the cert of another key pair than {secret_key_file} (re-run kvd keygen with "
                         "--ca-secret to issue one for this pair)")
    if own.sign_seed is None:
        raise BadRequest(f"{secret_key_file} holds no signing key: re-run `kvd keygen` with --ca-secret for it")
    try:
        return NodeSigner(own.sign_seed, cert)
    except KvdError as exc:
        raise BadRequest(f"{path}: {exc.message}") from None


def _add_certs_beside(keys: CurveKeys, own_node: str) -> None:
    """With a CA, the certs beside this node's own (where `kvd keygen` writes every node's) give the
    keys to dial static peers by, as the registry's verified records do for a fleet: the CA vouches
    for each, so the three commands are enough for `--peer B=...` too. Certs the CA does not
    verify (another cluster's, expired, denied) give nothing; the dial error says why."""
    assert keys.authority is not None
    try:
        names = sorted(os.listdir(keys.cert_dir))
    except OSError:
        return
    for name in names:
        if not name.endswith(".cert") or name == f"{own_node}.cert":
            continue
        path = os.path.join(keys.cert_dir, name)
        try:
            cert = keys.authority.verify(load_cert(path).raw)
        except (KvdError, OSError) as exc:
            keys.unusable[name.removesuffix(".cert")] = f"{path} gives no key ({getattr(exc, 'message', exc)})"
            continue
        keys.peer_keys.setdefault(cert.node_id, cert.curve_z85)


def _add_key_file(keys: CurveKeys, path: str) -> None:
    if path.endswith(".cert"):  # a peer's cert: the key to dial it by, as the CA vouches (it admits it anyway)
        if keys.authority is None:
            raise BadRequest(f"--curve-allow {path}: a cert is checked against the cluster CA, and --curve-ca is "
                             "not set")
        try:
            cert = keys.authority.verify(load_cert(path).raw)
        except CertError as exc:
            raise BadRequest(f"--curve-allow {path}: {exc.message}") from None
        keys.peer_keys[cert.node_id] = cert.curve_z85
        keys.listed.add(cert.curve_z85)
        return
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise BadRequest(f"cannot read public key {path}: {exc}") from None
    name = os.path.basename(path).removesuffix(".key").removesuffix(".key_secret")
    keys.allowed.add(public)
    keys.listed.add(public)
    keys.peer_keys[name] = public
    keys.names[public] = name


REFUSAL_LOG_INTERVAL = 60.0  # seconds: a refused peer dials again every 2 s; say so once a minute


class _AllowList:
    def __init__(self, keys: CurveKeys) -> None:
        self.keys = keys  # read on every handshake: a reload changes what it admits at once
        # refused key -> its last line (keys are cheap to make: the memo is bounded); only the ZAP thread logs
        self._logged = Throttle(REFUSAL_LOG_INTERVAL)

    def callback(self, domain: str, key: bytes) -> bool:
        z85 = zmq.utils.z85.encode(key) if len(key) == 32 else key
        ok = self.keys.zap_admits(z85)
        if not ok and self._logged.allow(z85):
            log.warning("refused a peer with %s CURVE key %s (again at most once a minute)",
                        "a denied" if z85 in self.keys.denied else "an unknown", z85.decode(errors="replace"))
        return ok


def start_authenticator(ctx: zmq.Context, keys: CurveKeys) -> ThreadAuthenticator:
    """Run the ZAP handler that enforces the allow list; fail if it does not come up."""
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("kvd.daemon.peer.auth.zap"))
    auth.start()
    auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_AllowList(keys))
    if not auth.is_alive():
        raise BadRequest("the ZAP authenticator did not start: refusing to run CURVE without access control")
    return auth


def make_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()


def make_client(sock: zmq.Socket, keys: CurveKeys, peer_name: str,
                registry_key: Callable[[str], bytes | None] | None = None) -> bytes:
    """Make sock a CURVE client of peer_name; returns the server key it will hold the peer to."""
    server_key = keys.server_key_for(peer_name, registry_key)
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = server_key
    return server_key
