"""How both ends spell the daemon's local endpoint (daemon and client processes).

The daemon listens for local clients on `unix://PATH` (also written `ipc://PATH`, the older
spelling) or `tcp://HOST:PORT` (for a client in another network namespace of the same host: it
still maps the pool). Clients find the default socket by the same rules as the daemon, so a
bare `kvd serve` and a bare `kvd.Client()` meet without configuration.
"""
from __future__ import annotations

import os

from kvd.errors import BadRequest

LOCAL_SCHEMES = ("unix://", "ipc://", "tcp://")


def unix_path(endpoint: str) -> str | None:
    """The socket file of a unix:// or ipc:// endpoint; None for tcp://."""
    for scheme in ("unix://", "ipc://"):
        if endpoint.startswith(scheme):
            return endpoint[len(scheme):]
    return None


def tcp_address(endpoint: str) -> tuple[str, int]:
    """(host, port) of a tcp://HOST:PORT endpoint (IPv6 hosts in brackets)."""
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit():
        raise BadRequest(f"local socket must be unix://PATH or tcp://HOST:PORT, got {endpoint!r}")
    return host.strip("[]"), int(port)


def default_runtime_dir() -> str:
    """Where the client socket lives by default; clients compute the same path."""
    if os.environ.get("KVD_RUNTIME_DIR"):
        return os.environ["KVD_RUNTIME_DIR"]
    if os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.join(os.environ["XDG_RUNTIME_DIR"], "kvd")
    return f"/tmp/kvd-{os.getuid()}"


def default_socket() -> str:
    return os.environ.get("KVD_SOCKET") or f"unix://{default_runtime_dir()}/kvd.sock"


def is_loopback_endpoint(endpoint: str) -> bool:
    """tcp://127.0.0.1:7470, tcp://[::1]:7470, tcp://localhost:7470 (a wildcard or a name is not)."""
    import ipaddress

    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
