"""The messages of transfers whose bytes ride a one-sided data plane (both processes; proto/PROTOCOL.md
2.2b): plain data like `messages.py`, which `protocol.py` adds to its table of types.

A push on such a link: `offer` (plane set) -> `grant` (the receiver's ranges) -> the sender's plane
writes a slice, then `placed` says so, with the slice's digest -> `chunk_ack` -> ... -> `done`. A pull:
`pull` (plane set) -> `offer` (plane, the holder's ranges and each slice's digest) -> the puller's
plane reads the slices -> `done`. `released` ends what the plane may still do to a transfer's memory
after the transfer itself ended."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .messages import Message


@dataclass(slots=True)
class Grant(Message):
    """Receiver -> sender, answering an offer with a plane: room reserved; the sender's plane writes
    the entry into these ranges of our pool ([offset from our plane's base, length], in the entry's
    byte order). Takes the place of accept."""

    TYPE: ClassVar[str] = "grant"
    xfer: int
    regions: list[Any]


@dataclass(slots=True)
class Placed(Message):
    """Sender -> receiver: bytes [offset, +length) of the entry are in your granted ranges (the plane
    wrote and flushed them); `digest` is theirs, under the offer's checksum. Answered as a chunk is."""

    TYPE: ClassVar[str] = "placed"
    xfer: int
    seq: int
    offset: int
    length: int
    digest: int


@dataclass(slots=True)
class Released(Message):
    """Either way, after a transfer on a plane ended without its done: the sender of this has no
    plane operation on the other's memory for xfer any more (the granted or lent blocks can go)."""

    TYPE: ClassVar[str] = "released"
    xfer: int


PLANE_MESSAGES: dict[str, type[Message]] = {cls.TYPE: cls for cls in (Grant, Placed, Released)}

__all__ = ['PLANE_MESSAGES', 'Grant', 'Placed', 'Released']
