"""Registry URLs (`etcd[s]://[USER:PASS@]H:P[,H:P...]`, `redis[s]://[[USER]:PASS@]H:P[/DB]`), the
credentials and TLS files that go with them, and the backend each one opens (any process).

Pure parsing plus a factory; runs wherever a registry is configured (daemon config, routers). The
backend modules are imported only here, on demand, so `import kvd.cluster` needs neither redis-py
nor anything for etcd. A password never leaves this module in text: `str(RegistryURL)`, `redact()`
and every error message show it as `***`.
"""
from __future__ import annotations

import dataclasses
import ssl
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote

from .backends.backend import DEFAULT_OP_TIMEOUT, Backend
from .records import check_cluster

DEFAULT_PORTS = {"etcd": 2379, "redis": 6379}
_TLS_SCHEMES = {"etcds": "etcd", "rediss": "redis"}
_FORMS = "expected etcd[s]://[USER:PASS@]HOST:PORT[,HOST:PORT...] or redis[s]://[[USER]:PASS@]HOST:PORT[/DB]"


@dataclass(frozen=True)
class RegistryURL:
    scheme: str  # etcd | redis (over TLS when `tls`: etcds://, rediss://)
    endpoints: tuple[tuple[str, int], ...]
    db: int = 0  # redis only
    username: str = ""  # "" with a password: Redis's default user
    password: str = field(default="", repr=False)  # never printed: str() shows ***
    tls: bool = False

    def __str__(self) -> str:
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)
        user = quote(self.username, safe="") + (":***" if self.password else "")
        return (f"{self.scheme}{'s' if self.tls else ''}://{user + '@' if user else ''}{hosts}"
                + (f"/{self.db}" if self.scheme == "redis" and self.db else ""))


@dataclass(frozen=True)
class TLSFiles:
    """--registry-ca / --registry-cert / --registry-key, checked and loaded into one client context."""

    ca_file: str = ""  # "" = the system's CA store
    cert_file: str = ""  # mutual TLS: both or neither
    key_file: str = ""

    def context(self) -> ssl.SSLContext:
        """Hostname verification on, the CA bundle in place of the system's when one is given.
        Raises ValueError naming the flag whose file is missing or unusable."""
        for flag, path in (("--registry-ca", self.ca_file), ("--registry-cert", self.cert_file),
                           ("--registry-key", self.key_file)):
            if path:
                _readable(flag, path)
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("--registry-cert and --registry-key go together (mutual TLS needs both)")
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file or None)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"--registry-ca {self.ca_file}: not a PEM CA bundle ({e})") from None
        if self.cert_file:
            try:
                ctx.load_cert_chain(self.cert_file, self.key_file)
            except (ssl.SSLError, OSError) as e:
                raise ValueError(f"--registry-cert {self.cert_file} / --registry-key {self.key_file}: not a PEM "
                                 f"certificate and its private key ({e})") from None
        return ctx


def _readable(flag: str, path: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None


def _endpoint(text: str, scheme: str, url: str) -> tuple[str, int]:
    if text.startswith("["):  # [::1]:2379
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"registry URL {url!r}: bad IPv6 address {text!r}")
        port_text = rest[1:]
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ValueError(f"registry URL {url!r}: missing host in {text!r}")
    if not port_text:
        return host, DEFAULT_PORTS[scheme]
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"registry URL {url!r}: bad port {port_text!r}")
    return host, int(port_text)


def _userinfo(text: str, scheme: str, shown: str) -> tuple[str, str]:
    """USER:PASS, :PASS (Redis's default user) or USER (its password from --registry-password-file)."""
    user, _, password = text.partition(":")
    user, password = unquote(user), unquote(password)
    if scheme == "etcd" and password and not user:
        raise ValueError(f"registry URL {shown!r}: etcd needs a user name with the password (USER:PASS@)")
    return user, password


def parse_url(url: str) -> RegistryURL:
    """Raises ValueError naming the URL (its password redacted) and what is wrong with it."""
    if not isinstance(url, str):
        raise ValueError(f"registry URL must be a string, not {type(url).__name__}")
    shown = redact(url)
    scheme, sep, rest = url.partition("://")
    tls = scheme in _TLS_SCHEMES
    scheme = _TLS_SCHEMES.get(scheme, scheme)
    if not sep or scheme not in DEFAULT_PORTS:
        raise ValueError(f"registry URL {shown!r}: {_FORMS}")
    userinfo, at, where = rest.rpartition("@")  # a path never holds '@'; a password may
    username, password = _userinfo(userinfo, scheme, shown) if at else ("", "")
    if "?" in where or "#" in where:
        raise ValueError(f"registry URL {shown!r}: query strings and fragments are not supported")
    hosts, _, path = where.partition("/")
    parts = hosts.split(",")
    if not hosts or any(not p for p in parts):
        raise ValueError(f"registry URL {shown!r}: missing host")
    endpoints = tuple(_endpoint(p, scheme, shown) for p in parts)
    db = 0
    if scheme == "etcd":
        if path:
            raise ValueError(f"registry URL {shown!r}: etcd URLs take no path (the cluster is --cluster)")
    else:
        if len(endpoints) != 1:
            raise ValueError(f"registry URL {shown!r}: a redis URL names one server")
        if path:
            if not path.isdigit():
                raise ValueError(f"registry URL {shown!r}: the path must be a database number")
            db = int(path)
    return RegistryURL(scheme, endpoints, db, username, password, tls)


def redact(url: str) -> str:
    """The URL as logs, metrics, status and errors may show it: a password becomes ***."""
    if "@" not in url:
        return url
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    userinfo, _, where = rest.rpartition("@")
    user = userinfo.partition(":")[0]
    return f"{scheme}{sep}{user}:***@{where}"


def _read_password(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            password = f.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--registry-password-file {path}: cannot read it "
                         f"({getattr(e, 'strerror', None) or type(e).__name__})") from None
    if not password:
        raise ValueError(f"--registry-password-file {path}: its first line is empty")
    return password


def with_options(u: RegistryURL, *, password_file: str = "", ca_file: str = "", cert_file: str = "",
                 key_file: str = "") -> tuple[RegistryURL, ssl.SSLContext | None]:
    """The URL with the password file's password (it overrides one in the URL; the user still comes
    from the URL), and the TLS context for etcds:// or rediss://. ValueError for anything wrong."""
    if password_file:
        u = dataclasses.replace(u, password=_read_password(password_file))
        if u.scheme == "etcd" and not u.username:
            raise ValueError(f"registry URL {str(u)!r}: --registry-password-file needs the etcd user in the URL "
                             "(etcd://USER@HOST:PORT)")
    if u.username and not u.password:
        raise ValueError(f"registry URL {str(u)!r}: user {u.username!r} without a password (give USER:PASS@ "
                         "or --registry-password-file)")
    files = TLSFiles(ca_file, cert_file, key_file)
    if not u.tls:
        if ca_file or cert_file or key_file:
            raise ValueError(f"registry URL {str(u)!r}: --registry-ca/--registry-cert/--registry-key need TLS: "
                             f"use {u.scheme}s://")
        return u, None
    return u, files.context()


def open_backend(url: str | RegistryURL, cluster: str = "kvd", op_timeout: float = DEFAULT_OP_TIMEOUT, *,
                 password_file: str = "", ca_file: str = "", cert_file: str = "", key_file: str = "") -> Backend[Any]:
    """The backend for a URL. Connects lazily: constructing it does no I/O (it reads the password and
    TLS files, so that a bad path fails here, with the flag's name)."""
    u = parse_url(url) if isinstance(url, str) else url
    check_cluster(cluster)
    u, tls = with_options(u, password_file=password_file, ca_file=ca_file, cert_file=cert_file, key_file=key_file)
    if u.scheme == "etcd":
        from .backends.etcd import EtcdBackend
        return EtcdBackend(list(u.endpoints), cluster=cluster, op_timeout=op_timeout, username=u.username,
                           password=u.password, tls=tls, name=str(u))
    from .backends.redis import RedisBackend
    (host, port), = u.endpoints
    return RedisBackend(host, port, u.db, cluster=cluster, op_timeout=op_timeout, username=u.username,
                        password=u.password, tls=tls, name=str(u), client_cert=bool(cert_file))
