"""Message framing for the local client socket, a byte stream (both processes): pure encode/decode, no I/O.

Peers talk ZeroMQ, which keeps message boundaries. Local clients talk to their daemon over a
unix stream socket instead (one kernel hop each way; ZeroMQ adds an I/O thread on both ends,
which costs 2-3x the latency of a small round trip), so each message — the same frames
`kvd.wire.protocol` encodes — is written as:

    u32 frame count, then for each frame: u32 length and the frame's bytes   (little-endian)

At most MAX_FRAMES frames and MAX_MESSAGE_BYTES of them in all. Limits are checked as each
length is read, so a bad or hostile stream is refused before anything is buffered for it;
after a framing error the stream cannot be resynchronized and the connection must be closed.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence

from kvd.errors import ProtocolError

from .protocol import MAX_HEADER_BYTES, MAX_PAYLOAD_FRAMES, Frame

MAX_FRAMES = 1 + MAX_PAYLOAD_FRAMES
# all frames of one message together (local messages carry no payload: tensor bytes go through
# the pool). Above the header cap on purpose: an oversized header still reaches
# protocol.decode, whose error is answered in-band; only beyond this is the stream refused.
MAX_MESSAGE_BYTES = 4 * MAX_HEADER_BYTES

_U32 = struct.Struct("<I")
# ZeroMQ speaks first: its greeting opens with the signature 0xFF, 8 bytes of padding, 0x7F (ZMTP 3)
PEER_PORT = ("the other end speaks ZeroMQ: this is a kvd peer port (--listen), not a client socket (give the "
             "daemon's --socket, e.g. unix:///run/kvd/kvd.sock)")


def zmtp_greeting(data: bytes | bytearray) -> bool:
    """Do these first bytes of a stream look like ZeroMQ's greeting (a peer port, not a client socket)?"""
    return len(data) >= 1 and data[0] == 0xFF and (len(data) < 10 or data[9] == 0x7F)


def encode_message(frames: Sequence[Frame]) -> bytes:
    """Frames -> one framed message, ready to write to the stream."""
    parts: list[Frame] = [_U32.pack(len(frames))]
    for frame in frames:
        parts.append(_U32.pack(memoryview(frame).nbytes))
        parts.append(frame)
    return b"".join(parts)


class MessageReader:
    """Bytes in (as they arrive, in any pieces), complete messages out.

    While a message is known to need more bytes than have come (a frame's length was read), the
    pieces that come are kept as they are and joined once, when there are enough: a buffer grown
    piece by piece would be copied to a bigger block at every step, and the holes those copies
    leave in the heap make an unfinished 4 MiB message cost more than 4 MiB of RSS."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._pieces: list[bytes] = []  # received after the buffer, not joined to it yet
        self._pending = 0  # their bytes
        self._need = 0  # bytes the buffer must hold before parsing can go on

    @property
    def buffered(self) -> int:
        """Bytes of a message not yet complete."""
        return len(self._buffer) + self._pending

    def feed(self, data: Frame) -> list[list[bytes]]:
        """Add received bytes; return every message they complete. Raises ProtocolError."""
        if len(self._buffer) + self._pending + len(data) < self._need:
            self._pieces.append(bytes(data))  # (a copy only of a view or bytearray: its owner may reuse it)
            self._pending += len(data)
            return []
        if self._pieces:
            self._buffer += b"".join(self._pieces)
            self._pieces.clear()
            self._pending = 0
        self._buffer += data
        messages: list[list[bytes]] = []
        start = 0
        while True:
            parsed = self._parse(start)
            if isinstance(parsed, int):
                self._need = parsed - start
                break
            frames, start = parsed
            messages.append(frames)
        if start:
            del self._buffer[:start]
        return messages

    def _parse(self, start: int) -> tuple[list[bytes], int] | int:
        """The message at start and where the next begins; or, if it is not all here yet, how
        long the buffer must be before more of it can be parsed."""
        buf = self._buffer
        if len(buf) - start < 4:
            return start + 4
        (count,) = _U32.unpack_from(buf, start)
        if not 1 <= count <= MAX_FRAMES:
            raise ProtocolError(f"message declares {count} frames (1 to {MAX_FRAMES} allowed)")
        pos = start + 4
        frames: list[bytes] = []
        size = 0
        for _ in range(count):
            if len(buf) - pos < 4:
                return pos + 4
            length: int = _U32.unpack_from(buf, pos)[0]
            size += length
            if size > MAX_MESSAGE_BYTES:
                raise ProtocolError(f"message of more than {MAX_MESSAGE_BYTES} bytes (the local socket's limit)")
            pos += 4
            if len(buf) - pos < length:
                return pos + length
            frames.append(bytes(buf[pos:pos + length]))
            pos += length
        return frames, pos
