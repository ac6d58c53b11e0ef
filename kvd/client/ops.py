"""The client's operation protocol (worker process): how an operation talks to its driver.

Each operation (put, get, streams, paged blocks) is a generator with no I/O inside. It yields
what it needs done and gets the answer back: `(request, seconds to wait for the reply)` or
`(request, NO_REPLY)` to send and go on, `Receive(req, wait)` to wait for the next message on
an earlier request (a stream of replies), `Emit(value)` to hand a value to its caller (an
iterator step) and go on. Two drivers run operations: `Client` over a blocking socket in the
caller's thread (`sync.py`) and `AsyncClient` on the event loop (`aio.py`).
"""
from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from kvd.errors import ProtocolError
from kvd.wire import protocol as p

NO_REPLY = None  # yield (msg, NO_REPLY): send and do not wait
# a put with dest waits this long for the peer (the daemons' own deadlines end it much sooner)
WAIT_FOREVER = 3600.0

# an operation yields (request, seconds to wait for the reply or NO_REPLY) and gets the reply back
# (None after NO_REPLY), or a Receive (gets the next message) or an Emit (gets None)
Operation = Generator["tuple[p.Message, float | None] | Receive | Emit", p.Message | None, Any]
M = TypeVar("M", bound=p.Message)


def reply_as(kind: type[M], reply: p.Message | None) -> M:
    """The reply an operation waited for, as the type its request is answered with (the driver has
    raised an error reply already): any other is the daemon's protocol error."""
    if not isinstance(reply, kind):
        raise ProtocolError(f"expected {kind.TYPE}, got {reply.TYPE if reply is not None else 'no reply'}")
    return reply


def req_of(msg: p.Message) -> int:
    """The request id a client <-> daemon message carries (`req`: every one has it; a daemon's
    notice not about a request says 0, and a requests's ids start at 1)."""
    req = getattr(msg, "req", 0)
    return req if type(req) is int else 0


@dataclass
class Emit:
    """An operation hands a value to its caller (an iterator step), then continues."""

    value: Any


@dataclass
class Receive:
    """An operation waits for the next message on an earlier request (a stream of replies)."""

    req: int
    wait: float


class StreamClosed(Exception):
    """Thrown into a reading operation when its caller stops iterating early."""
