"""Exception classes with wire status codes (every process: the one shared leaf).

Every error that can cross a socket has a numeric code, so a client raises the
same class whether the fault happened in its local daemon or on a remote peer.
`remote` tells which side detected it.
"""
from __future__ import annotations


class KvdError(Exception):
    """Base class of every kvd error."""

    code: int = 1  # generic/internal

    def __init__(self, message: str = "", *, remote: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        # node id of the daemon that raised it, when it did not happen in this process
        self.remote = remote

    def __str__(self) -> str:
        where = f" (reported by {self.remote})" if self.remote else ""
        return f"{self.message}{where}"


class InternalError(KvdError):
    code = 1


class NotFound(KvdError):
    """No entry with that request id (or it expired)."""

    code = 2


class PoolFull(KvdError):
    """The staging pool has no room for the request."""

    code = 3


class Timeout(KvdError, TimeoutError):
    """A wait ran past its deadline."""

    code = 4


class PeerUnavailable(KvdError):
    """A peer daemon is unknown, unreachable, or died mid-transfer."""

    code = 5


class ProtocolError(KvdError):
    """A message could not be decoded or broke the protocol rules."""

    code = 6


class BadRequest(KvdError):
    """The request itself is invalid: bad dtype, shape, name, size or argument."""

    code = 7


class AlreadyExists(BadRequest):
    """An entry with that request id is already held."""

    code = 8


class ChecksumMismatch(KvdError):
    """Received bytes do not match the checksum the sender computed."""

    code = 9


class ShuttingDown(KvdError):
    """The daemon is draining and accepts no new work."""

    code = 10


class VersionMismatch(ProtocolError):
    """The other side speaks a protocol version we do not."""

    code = 11


class LayoutMismatch(BadRequest):
    """Source and destination KV layouts describe different models."""

    code = 12


class Unauthorized(KvdError):
    """The peer is not allowed to talk to this daemon."""

    code = 13


ERROR_CLASSES: dict[int, type[KvdError]] = {
    cls.code: cls
    for cls in (
        InternalError, NotFound, PoolFull, Timeout, PeerUnavailable, ProtocolError,
        BadRequest, AlreadyExists, ChecksumMismatch, ShuttingDown, VersionMismatch,
        LayoutMismatch, Unauthorized,
    )
}

ERROR_NAMES: dict[int, str] = {
    1: "internal", 2: "not_found", 3: "pool_full", 4: "timeout", 5: "peer_unavailable",
    6: "protocol", 7: "bad_request", 8: "already_exists", 9: "checksum", 10: "shutting_down",
    11: "version", 12: "layout_mismatch", 13: "unauthorized",
}


def error_from_code(code: int, message: str, remote: str | None = None) -> KvdError:
    """Rebuild the exception a daemon reported; unknown codes become InternalError."""
    cls = ERROR_CLASSES.get(code, InternalError)
    return cls(message, remote=remote)
