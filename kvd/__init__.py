"""kvd: a KV-cache transfer daemon for disaggregated LLM inference, and its client library
(imported by worker processes; the daemon process imports only what it needs, never torch).

    import kvd
    with kvd.Client() as c:
        c.put("req-1", {"layer.0.k": k0, "layer.0.v": v0})
        kv = c.get("req-1")
"""
from .errors import (
    AlreadyExists,
    BadRequest,
    ChecksumMismatch,
    InternalError,
    KvdError,
    LayoutMismatch,
    NotFound,
    PeerUnavailable,
    PoolFull,
    ProtocolError,
    ShuttingDown,
    Timeout,
    Unauthorized,
    VersionMismatch,
)

__version__ = "0.1.0"

__all__ = [
    "AlreadyExists",
    "AsyncClient",
    "BadRequest",
    "ChecksumMismatch",
    "Client",
    "InternalError",
    "KvdError",
    "LayoutMismatch",
    "NotFound",
    "Parts",
    "PeerUnavailable",
    "PoolFull",
    "ProtocolError",
    "Rows",
    "ShuttingDown",
    "Timeout",
    "Unauthorized",
    "VersionMismatch",
    "__version__",
]


def __getattr__(name: str):
    # the client pulls in torch; the daemon never needs it, so import it only on demand
    if name == "Client":
        from .client import Client

        return Client
    if name == "AsyncClient":
        from .client import AsyncClient

        return AsyncClient
    if name == "Rows":
        from .client import Rows

        return Rows
    if name == "Parts":
        from .client import Parts

        return Parts
    raise AttributeError(f"module 'kvd' has no attribute {name!r}")
