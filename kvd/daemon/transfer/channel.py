"""The channel a transfer talks through (daemon process): where its messages go, and the TCP
connection under it. A ROUTER routing id and a DEALER link look the same from here; the
transfer state machine sees only `key` and `peer_name`. No ZeroMQ here."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from kvd.wire import protocol as p


class Sending(Protocol):
    """What a send returns: an asyncio.Future, or one of loopsocket's done-already stand-ins for
    one (`Sent`, `NotSent`), which have the part of a Future's interface that callers use."""

    def done(self) -> bool: ...
    def cancelled(self) -> bool: ...
    def cancel(self) -> bool: ...
    def exception(self) -> BaseException | None: ...
    def result(self) -> Any: ...
    def add_done_callback(self, callback: Callable[[Any], object], /) -> None: ...


ChannelKey = tuple[str, str | bytes]  # (the socket's kind, the peer's endpoint or routing id)


class Channel:
    def __init__(self, key: ChannelKey, peer_name: str, sender: Callable[[list[p.Frame], bool], Sending],
                 cutter: Callable[[], bool]) -> None:
        self.key = key  # identifies the connection, so a message on another one is refused
        self.peer_name = peer_name
        self.features: frozenset[str] = frozenset()  # what the peer said it speaks, at its handshake
        # a one-sided data plane both ends took at the handshake (kvd.daemon.plane), and the peer's
        # agent on it; None: the transfers' bytes go as chunk frames on this connection
        self.plane: str | None = None
        self.plane_agent: str | None = None
        self._sender = sender
        self._cutter = cutter

    def send(self, msg: p.Message, track: bool = False) -> Sending:
        """Queue a message; the future resolves (to a MessageTracker if track) once ZeroMQ took it."""
        return self._sender(p.encode(msg), track)

    def cut(self) -> bool:
        """Cut the TCP connection under this channel: ZeroMQ drops what it still had queued on it
        (and reconnects, for a link). False if there was no connection to cut."""
        return self._cutter()
