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
    if not endpoint.startswith("tcp://"):
        raise BadRequest(f"local socket must be unix://PATH or tcp://HOST:PORT, got {endpoint!r}")
    problem = tcp_endpoint_problem(endpoint)
    if problem is not None:
        raise BadRequest(f"local socket {problem}")
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    return host.strip("[]"), int(port)


def tcp_endpoint_problem(endpoint: str) -> str | None:
    """What is wrong with a tcp://HOST:PORT endpoint, as words that follow its name; None if nothing.
    (ZeroMQ would read a port past 65535 modulo 65536, and a missing one as some other failure.)"""
    if not endpoint.startswith("tcp://"):
        return f"must be a tcp://HOST:PORT endpoint, got {endpoint!r}"
    rest = endpoint[len("tcp://"):]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port or (rest.startswith("[") and not host.endswith("]")):
        return f"{endpoint!r} has no port: write tcp://HOST:PORT"
    if not port.isdigit():
        return f"{endpoint!r}: the port must be a number 1-65535, got {port!r}"
    if not 1 <= int(port) <= 65535:
        return f"{endpoint!r}: port {int(port)} is out of range (1-65535)"
    return None


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
