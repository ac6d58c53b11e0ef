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
from typing import Any

from kvd.wire import protocol as p

NO_REPLY = None  # yield (msg, NO_REPLY): send and do not wait
# a put with dest waits this long for the peer (the daemons' own deadlines end it much sooner)
WAIT_FOREVER = 3600.0

# an operation yields (request, seconds to wait for the reply or NO_REPLY) and gets the reply back
Operation = Generator[tuple[p.Message, float | None], p.Message | None, Any]


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
