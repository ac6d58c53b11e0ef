"""Registry URLs (`etcd://H:P[,H:P...]`, `redis://H:P[/DB]`) and the backend each one opens (any process).

Pure parsing plus a factory; runs wherever a registry is configured (daemon config, routers). The
backend modules are imported only here, on demand, so `import kvd.cluster` needs neither redis-py
nor anything for etcd.
"""
from __future__ import annotations

from dataclasses import dataclass

from .backend import DEFAULT_OP_TIMEOUT, Backend
from .records import check_cluster

DEFAULT_PORTS = {"etcd": 2379, "redis": 6379}


@dataclass(frozen=True)
class RegistryURL:
    scheme: str  # etcd | redis
    endpoints: tuple[tuple[str, int], ...]
    db: int = 0  # redis only

    def __str__(self) -> str:
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)
        return f"{self.scheme}://{hosts}" + (f"/{self.db}" if self.scheme == "redis" and self.db else "")


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


def parse_url(url: str) -> RegistryURL:
    """Raises ValueError naming the URL and what is wrong with it."""
    if not isinstance(url, str):
        raise ValueError(f"registry URL must be a string, not {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in DEFAULT_PORTS:
        raise ValueError(f"registry URL {url!r}: expected etcd://HOST:PORT[,HOST:PORT...] or redis://HOST:PORT[/DB]")
    if "?" in rest or "#" in rest:
        raise ValueError(f"registry URL {url!r}: query strings and fragments are not supported")
    hosts, _, path = rest.partition("/")
    if "@" in hosts:
        raise ValueError(f"registry URL {url!r}: credentials in the URL are not supported")
    parts = hosts.split(",")
    if not hosts or any(not p for p in parts):
        raise ValueError(f"registry URL {url!r}: missing host")
    endpoints = tuple(_endpoint(p, scheme, url) for p in parts)
    db = 0
    if scheme == "etcd":
        if path:
            raise ValueError(f"registry URL {url!r}: etcd URLs take no path (the cluster is --cluster)")
    else:
        if len(endpoints) != 1:
            raise ValueError(f"registry URL {url!r}: a redis URL names one server")
        if path:
            if not path.isdigit():
                raise ValueError(f"registry URL {url!r}: the path must be a database number")
            db = int(path)
    return RegistryURL(scheme, endpoints, db)


def redact(url: str) -> str:
    """The URL as logs, metrics, status and errors may show it: a password becomes ***."""
    scheme, sep, rest = url.partition("://")
    hosts, slash, path = rest.partition("/")
    if not sep or "@" not in hosts:
        return url
    userinfo, _, where = hosts.rpartition("@")
    user = userinfo.partition(":")[0]
    return f"{scheme}://{user}:***@{where}{slash}{path}"


def open_backend(url: str | RegistryURL, cluster: str = "kvd", op_timeout: float = DEFAULT_OP_TIMEOUT, *,
                 password_file: str = "", ca_file: str = "", cert_file: str = "", key_file: str = "") -> Backend:
    """The backend for a URL. Connects lazily: constructing it does no I/O."""
    u = parse_url(url) if isinstance(url, str) else url
    check_cluster(cluster)
    if u.scheme == "etcd":
        from .etcd import EtcdBackend
        return EtcdBackend(list(u.endpoints), cluster=cluster, op_timeout=op_timeout)
    from .redis import RedisBackend
    (host, port), = u.endpoints
    return RedisBackend(host, port, u.db, cluster=cluster, op_timeout=op_timeout)
