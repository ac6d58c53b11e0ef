"""CurveZMQ authentication and encryption between daemons (daemon process; `kvd keygen` too).

With `--curve-secret-key FILE` (a key pair written by `kvd keygen`) the peer listener becomes a
CURVE server and every peer link a CURVE client. Encryption alone is not access control: a
CURVE server without a ZAP handler accepts any client key. So a ZAP authenticator thread
checks each connecting key against `--curve-allow` (public key files, directories of them, or
Z85 strings), and the daemon refuses to start when it cannot enforce that.

To dial a named peer we need its public key: a key file named `<peer name>.key` among the
allowed keys provides it (the same file that lets that peer connect to us).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from kvd.errors import BadRequest

log = logging.getLogger(__name__)

Z85_KEY_LENGTH = 40  # a 32-byte Curve25519 key in Z85
ZAP_DOMAIN = "kvd"  # the authenticator only answers for domains it was configured with


@dataclass
class CurveKeys:
    public: bytes
    secret: bytes
    allowed: set[bytes] = field(default_factory=set)
    peer_keys: dict[str, bytes] = field(default_factory=dict)  # peer name -> its public key

    def server_key_for(self, peer_name: str) -> bytes:
        try:
            return self.peer_keys[peer_name]
        except KeyError:
            if peer_name.startswith("tcp://"):  # an endpoint that is no configured peer's
                raise BadRequest(
                    f"CURVE is on and {peer_name} is not the endpoint of a configured peer, so this daemon has no "
                    f"key to check it by: add it as --peer NAME={peer_name} (TOML [peers]) with NAME.key among "
                    "--curve-allow, then SIGHUP; with a cluster registry, name the node by its id instead"
                ) from None
            raise BadRequest(
                f"CURVE is on but there is no public key for peer {peer_name!r}: put {peer_name}.key "
                "among --curve-allow (then SIGHUP to reload the allow list)"
            ) from None


def load_keys(secret_key_file: str, allow: list[str]) -> CurveKeys:
    if not zmq.has("curve"):
        raise BadRequest("--curve-secret-key given, but this libzmq was built without CURVE support")
    try:
        public, secret = zmq.auth.load_certificate(secret_key_file)
    except (OSError, ValueError) as exc:
        raise BadRequest(f"cannot read the CURVE key pair {secret_key_file}: {exc}") from None
    if not secret:
        raise BadRequest(f"{secret_key_file} holds no secret key (use the .key_secret file from `kvd keygen`)")
    keys = CurveKeys(public, secret)
    for item in allow:
        if os.path.isdir(item):
            for name in sorted(os.listdir(item)):
                if name.endswith(".key"):
                    _add_key_file(keys, os.path.join(item, name))
        elif os.path.isfile(item):
            _add_key_file(keys, item)
        elif len(item) == Z85_KEY_LENGTH:
            keys.allowed.add(item.encode())
        else:
            raise BadRequest(f"--curve-allow {item!r} is neither a key file, a directory, nor a Z85 public key")
    if not keys.allowed:
        raise BadRequest("--curve-secret-key without --curve-allow: no peer could ever connect")
    return keys


def _add_key_file(keys: CurveKeys, path: str) -> None:
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise BadRequest(f"cannot read public key {path}: {exc}") from None
    keys.allowed.add(public)
    keys.peer_keys[os.path.basename(path).removesuffix(".key").removesuffix(".key_secret")] = public


REFUSAL_LOG_INTERVAL = 60.0  # seconds: a refused peer dials again every 2 s; say so once a minute


class _AllowList:
    def __init__(self, allowed: set[bytes]) -> None:
        self.allowed = allowed
        self._logged: dict[bytes, float] = {}  # refused key -> when it was last logged

    def callback(self, domain: str, key: bytes) -> bool:
        z85 = zmq.utils.z85.encode(key) if len(key) == 32 else key
        ok = z85 in self.allowed
        if not ok:
            now = time.monotonic()
            if now - self._logged.get(z85, -REFUSAL_LOG_INTERVAL) >= REFUSAL_LOG_INTERVAL:
                if len(self._logged) > 1024:  # (keys are cheap to make: the memo stays bounded)
                    self._logged.clear()
                self._logged[z85] = now
                log.warning("refused a peer with an unknown CURVE key %s (again at most once a minute)",
                            z85.decode(errors="replace"))
        return ok


def start_authenticator(ctx: zmq.Context, keys: CurveKeys) -> ThreadAuthenticator:
    """Run the ZAP handler that enforces the allow list; fail if it does not come up."""
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("kvd.daemon.peer.auth.zap"))
    auth.start()
    auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_AllowList(keys.allowed))
    if not auth.is_alive():
        raise BadRequest("the ZAP authenticator did not start: refusing to run CURVE without access control")
    return auth


def make_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()


def make_client(sock: zmq.Socket, keys: CurveKeys, peer_name: str) -> None:
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server_key_for(peer_name)


def keygen(directory: str, name: str, *, force: bool = False) -> tuple[str, str]:
    """Write NAME.key (public, share it) and NAME.key_secret (0600, keep it) into directory.

    Refuses (BadRequest) when either file exists, unless force: the peers' --curve-allow hold the
    old public key, so a new pair would lock this node out of every one of them."""
    files = (os.path.join(directory, f"{name}.key"), os.path.join(directory, f"{name}.key_secret"))
    existing = [path for path in files if os.path.lexists(path)]
    if existing and not force:
        raise BadRequest(f"{' and '.join(existing)} already exist{'s' if len(existing) == 1 else ''}: not "
                         "overwritten, since every peer that allows the old key would refuse this node; "
                         "--force replaces the pair")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    old_umask = os.umask(0o077)
    try:
        public_file, secret_file = zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old_umask)
    os.chmod(secret_file, 0o600)
    return public_file, secret_file
