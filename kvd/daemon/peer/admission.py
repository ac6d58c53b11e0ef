"""The ROUTER's side of the peer handshake, as bookkeeping (daemon process): no sockets, no loop.

A connection to our `--listen` socket is accepted (the socket monitor says so, with its fd), must
say peer_hello within connect_timeout, and counts against max_connections until it closes; a
hello admits it (or a refusal is remembered for a while, to answer what it had already sent).
`router.Router` feeds this what its sockets saw and cuts the connections it names. Whether one
hello may be admitted (another user of this host, a CURVE key and the node id it claims) is
decided beside it, in `Router._refusal` and `auth.CurveKeys.admits`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

READMIT_EVERY = 5.0  # seconds between checks that every admitted peer still is (cert expiry)
REMEMBERED_REFUSALS = 1024  # (bounded: anyone can be refused)

E = TypeVar("E")


class Admissions(Generic[E]):
    """Connections by fd: accepted (waiting for a hello, since when) or admitted (their routing id)."""

    def __init__(self, max_connections: int, connect_timeout: float, clock: Callable[[], float]) -> None:
        self.max_connections, self.connect_timeout, self.clock = max_connections, connect_timeout, clock
        self._accepted: dict[int, float] = {}  # fd of a connection not yet known by hello -> when accepted
        self._by_fd: dict[int, bytes] = {}  # fd -> routing id, once it said hello
        self._refused: dict[bytes, E] = {}  # routing id -> why it was refused (recently)
        self._readmitted = 0.0

    def accepted(self, fd: int) -> str | None:
        """A connection was accepted: why to cut it (too many), or None."""
        if fd in self._by_fd:
            return None  # its hello came first (the monitor is another socket: no order between them)
        self._accepted[fd] = self.clock()
        if len(self._accepted) + len(self._by_fd) > self.max_connections:
            return f"more than {self.max_connections} peer connections (--max-peer-connections)"
        return None

    def admitted(self, fd: int | None, rid: bytes) -> None:
        """The connection said a hello that was admitted."""
        if fd is not None:
            self._accepted.pop(fd, None)
            self._by_fd[fd] = rid

    def closed(self, fd: int) -> bytes | None:
        """The connection closed: the routing id of the peer it carried, if it had said hello."""
        self._accepted.pop(fd, None)
        return self._by_fd.pop(fd, None)

    def overdue(self) -> list[tuple[int, str]]:
        """Connections that did not say hello within connect_timeout (forgotten here): cut them."""
        now = self.clock()
        late = [fd for fd, accepted in self._accepted.items() if now - accepted > self.connect_timeout]
        for fd in late:
            del self._accepted[fd]
        return [(fd, f"no peer_hello within {self.connect_timeout:g}s") for fd in late]

    def readmit_due(self) -> bool:
        """Once every READMIT_EVERY: time to check every admitted peer again."""
        now = self.clock()
        if now - self._readmitted < READMIT_EVERY:
            return False
        self._readmitted = now
        return True

    def refuse(self, rid: bytes, refusal: E) -> None:
        if len(self._refused) >= REMEMBERED_REFUSALS:
            self._refused.clear()
        self._refused[rid] = refusal

    def refusal(self, rid: bytes) -> E | None:
        """Why this routing id was refused lately (a message already on its way when it was cut)."""
        return self._refused.get(rid)
