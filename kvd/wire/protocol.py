"""Wire protocol v1, sans I/O (both processes): pure encode/decode of the messages in `messages.py`
(re-exported here, so `protocol.Hello`, `protocol.encode`, ... is the one name to use).

A message is a list of frames (ZeroMQ's between peers, `kvd.wire.framing`'s on the local socket):
frame 0 is a msgpack map (the header) with the protocol version "v", the message type "t",
and the message's fields by name; any further frames are raw payload bytes, used only by CHUNK (and an
OFFER that carries its entry's only chunk). Decoding is bounded (header size cap,
msgpack length limits) and validates every field's type before returning a message.
This module imports neither zmq nor asyncio; `proto/PROTOCOL.md` is its specification.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

import msgpack

from kvd.errors import InternalError, KvdError, ProtocolError, VersionMismatch

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 1 << 20  # a 4096-tensor put with its slot list fits comfortably
MAX_PAYLOAD_FRAMES = 64
MAX_CHUNK_BYTES = 64 << 20  # largest chunk a receiver accepts (and largest ZeroMQ frame)
# msgpack limits: nothing in a header needs more, and a hostile header cannot make us allocate more
UNPACK_LIMITS = dict(
    max_bin_len=64 << 10,  # a cert, a plane's connection info (UCX's grows with its devices)
    max_str_len=1 << 16,
    max_array_len=1 << 17,
    max_map_len=1 << 12,
    max_ext_len=0,
)

Frame = bytes | bytearray | memoryview
from .messages import *  # noqa: E402,F403  (every message type, as p.Hello, p.Chunk, ...)
from .messages import MESSAGE_TYPES, Chunk, Error, Offer  # noqa: E402
from .messages import Message as Message  # noqa: E402  (re-exported: the base of every message, p.Message)
from .plane import *  # noqa: E402,F403  (a one-sided plane's transfer messages, as p.Grant, ...)
from .plane import PLANE_MESSAGES  # noqa: E402
from .tier_messages import *  # noqa: E402,F403  (the KV tier's messages, as p.CachePut, ...)
from .tier_messages import TIER_MESSAGES  # noqa: E402

MESSAGE_TYPES = {**MESSAGE_TYPES, **TIER_MESSAGES, **PLANE_MESSAGES}


# ---- field validation ---------------------------------------------------------------------

# the exact types msgpack decodes each field type to (msgpack makes no subclasses; a bool is
# not an int here, and an int is a float): one set lookup per field, the hot path of every message
_TYPES: dict[str, frozenset[type] | None] = {
    "str": frozenset({str}),
    "int": frozenset({int}),
    "float": frozenset({int, float}),
    "bool": frozenset({bool}),
    "list": frozenset({list}),
    "dict": frozenset({dict}),
    "bytes": frozenset({bytes}),
    "Any": None,
}


def _field_table(cls: type[Message]) -> list[tuple[str, str, bool, bool]]:
    """(name, type name, optional, required) for each header field of a message class."""
    table: list[tuple[str, str, bool, bool]] = []
    for f in dataclasses.fields(cls):
        if f.name == "payload":
            continue
        annotation = str(f.type)
        optional = annotation.endswith("| None")
        # the container alone: a header field is checked for its type, never for what it holds
        base = annotation.removesuffix("| None").strip().partition("[")[0]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        table.append((f.name, base, optional, required))
    return table


# (name, type name, allowed types or None for any, optional, required, to float) per message type
_DECODE = {name: [(n, base, _TYPES[base], optional, required, base == "float")
                  for n, base, optional, required in table]
           for name, table in ((k, _field_table(c)) for k, c in MESSAGE_TYPES.items())}
_ABSENT = object()


_FIELDS = {name: _field_table(cls) for name, cls in MESSAGE_TYPES.items()}
# extension fields and their defaults, per message type (see EXTENSION)
_EXTENSIONS = {
    name: {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
           for f in dataclasses.fields(cls) if f.metadata.get("extension")}
    for name, cls in MESSAGE_TYPES.items()
}


# ---- encode / decode ----------------------------------------------------------------------

_packer_options = dict(use_bin_type=True)
_unpackb = functools.partial(msgpack.unpackb, raw=False, strict_map_key=True, **UNPACK_LIMITS)


def packed_size(value: Any) -> int:
    """Bytes `value` takes in a header (what a daemon checks before it accepts what it must answer)."""
    return len(msgpack.packb(value, **_packer_options))


def encode(msg: Message) -> list[Frame]:
    """Message -> frames. Payload frames (CHUNK only) are passed through untouched."""
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": msg.TYPE}
    extensions = _EXTENSIONS[msg.TYPE]
    for name, _base, _optional, _required in _FIELDS[msg.TYPE]:
        value = getattr(msg, name)
        if name in extensions and value == extensions[name]:
            continue
        header[name] = value
    payload = msg.payload if isinstance(msg, (Chunk, Offer)) else ()
    if payload:
        header["n"] = len(payload)
    return [msgpack.packb(header, **_packer_options), *payload]


def request_number(head: Frame) -> int:
    """Best effort: the `req` of a header that did not decode (a string or the whole header over
    the limits), so that the error reaches the request that caused it; 0 if it cannot be read.

    Reads only the first keys (an encoder writes v, t, req first), with the same limits."""
    try:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, **UNPACK_LIMITS)
        unpacker.feed(head)
        for _ in range(min(unpacker.read_map_header(), 4)):
            key, value = unpacker.unpack(), unpacker.unpack()
            if key == "req":
                return value if type(value) is int and 0 <= value < 1 << 63 else 0
    except Exception:  # msgpack raises several unrelated types on bad input
        pass
    return 0


def decode(frames: typing.Sequence[Frame]) -> Message:
    """Frames -> message, or ProtocolError saying exactly what is wrong. Never trusts sizes."""
    if not frames:
        raise ProtocolError("empty message")
    head = frames[0]
    if len(head) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(head)} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    try:
        header = _unpackb(head)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise ProtocolError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a msgpack map")
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise VersionMismatch(f"protocol version {version!r} not supported (this side speaks {PROTOCOL_VERSION})")
    kind = header.get("t")
    if not isinstance(kind, str) or (cls := MESSAGE_TYPES.get(kind)) is None:
        raise ProtocolError(f"unknown message type {kind!r}")
    values: dict[str, Any] = {}
    for name, base, allowed, optional, required, to_float in _DECODE[kind]:
        value = header.get(name, _ABSENT)
        if value is _ABSENT:
            if required:
                raise ProtocolError(f"{kind}: missing field {name!r}")
            continue
        if value is None and optional:
            values[name] = None
            continue
        if allowed is not None and type(value) not in allowed:
            raise ProtocolError(f"{kind}: field {name!r} must be {base}, got {type(value).__name__}")
        values[name] = float(value) if to_float else value
    msg = cls(**values)
    if isinstance(msg, (Chunk, Offer)) and msg.lengths is not None:  # (a chunk's always are)
        msg.payload = _payload(kind, header.get("n", 0), msg.lengths, frames)
    elif len(frames) != 1:
        raise ProtocolError(f"{kind} carries no payload, but {len(frames) - 1} extra frames arrived")
    return msg


def _payload(kind: str, n_payload: Any, lengths: list[Any], frames: typing.Sequence[Frame]) -> list[Frame]:
    """The payload frames of a chunk (or of an offer carrying its chunk), checked against the header."""
    if type(n_payload) is not int or n_payload != len(frames) - 1:
        raise ProtocolError(f"{kind} declares {n_payload!r} payload frames, {len(frames) - 1} arrived")
    if len(frames) - 1 > MAX_PAYLOAD_FRAMES:
        raise ProtocolError(f"{kind} has {len(frames) - 1} payload frames (limit {MAX_PAYLOAD_FRAMES})")
    if len(lengths) != len(frames) - 1 or not all(
        type(n) is int and n == len(f) for n, f in zip(lengths, frames[1:], strict=True)
    ):
        raise ProtocolError(f"{kind} payload frame sizes disagree with the header's lengths")
    return list(frames[1:])


def error_reply(req: int, exc: Exception, origin: str | None) -> Error:
    """Any exception -> the Error message a client can turn back into the same class."""
    if isinstance(exc, KvdError):
        return Error(req=req, code=exc.code, message=exc.message, origin=exc.remote or origin)
    return Error(req=req, code=InternalError.code, message=f"{type(exc).__name__}: {exc}", origin=origin)
