"""The disk level's page files (daemon process), pure: names, and the header every page file carries.

A page file is a 4 KiB header and then the page's bytes, as the client put them (its logical bytes:
no pool blocks, so a daemon with another block size reads it the same). The header names what the
bytes are and how to check them:

| offset | size | field |
|---|---|---|
| 0 | 8 | magic `KVDPAGE\\0` |
| 8 | 2 | format version (`VERSION`) |
| 10 | 2 | header size (4096) |
| 12 | 4 | block size of the daemon that wrote it (for the record: the bytes are the page's own) |
| 16 | 8 | page bytes |
| 24 | 8 | digest of the page bytes (xxh3_64) |
| 32 | 8 | digest of the header, this field read as 0 (xxh3_64) |
| 40 | 2, 2, 2 | lengths of the namespace, the key, the dtype name |
| 46 | 1, 1 | dims, digest algorithm (1: xxh3_64) |
| 48 | 64 | the shape, 8 dims of 8 bytes |
| 112 | ... | namespace, key, dtype (ASCII), then zeros to 4096 |

A file is found by name: `pages/<namespace hash>/<2 hex>/<page hash>.kvp`, hashes of BLAKE2b-128
(the namespace, and namespace + NUL + key): one directory per namespace, so that a clear is one rename.
The name only finds the file: what it holds is what its header says, checked against the question.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import xxhash

from kvd.wire.dtypes import DTYPE_ITEMSIZE

from ...store.page_names import KEY_RE, MAX_DIMS, NAMESPACE_RE

MAGIC = b"KVDPAGE\x00"
VERSION = 1
HEADER_SIZE = 4096  # the page's bytes start on a 4 KiB boundary of the file
ALGORITHM_XXH3 = 1
SUFFIX = ".kvp"
FS_BLOCK = 4096  # the budget counts a file's size rounded up to this
_FIXED = struct.Struct("<8sHHIQQQHHHBB")  # magic .. algorithm (48 bytes)
_SHAPE = struct.Struct(f"<{MAX_DIMS}Q")
_DIGEST_AT = 32  # the header digest's offset


class BadPage(Exception):
    """What a page file holds is not the page asked for, or not a page: `reason` says which."""

    def __init__(self, reason: str, stale: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.stale = stale  # another format version: not corrupt, only not ours to read


@dataclass(frozen=True, slots=True)
class Header:
    namespace: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    digest: int  # of the page bytes
    block_size: int = 0
    version: int = VERSION


def name_hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def namespace_dir(namespace: str) -> str:
    """The directory of a namespace's pages, under pages/."""
    return name_hash(namespace)


def page_path(namespace: str, key: str) -> str:
    """Where a page's file lives, relative to the tier's directory."""
    page = name_hash(namespace + "\x00" + key)
    return f"pages/{namespace_dir(namespace)}/{page[:2]}/{page}{SUFFIX}"


def file_size(nbytes: int) -> int:
    return HEADER_SIZE + nbytes


def disk_bytes(nbytes: int) -> int:
    """What a page's file costs of the disk budget: header and bytes, in whole file-system blocks."""
    return -(-file_size(nbytes) // FS_BLOCK) * FS_BLOCK


def payload_digest(pieces) -> int:
    running = xxhash.xxh3_64()
    for piece in pieces:
        running.update(piece)
    return running.intdigest()


def encode(header: Header) -> bytes:
    """The header's 4096 bytes, its own digest filled in."""
    ns, key, dtype = header.namespace.encode(), header.key.encode(), header.dtype.encode()
    shape = list(header.shape) + [0] * (MAX_DIMS - len(header.shape))
    buf = bytearray(HEADER_SIZE)
    _FIXED.pack_into(buf, 0, MAGIC, header.version, HEADER_SIZE, header.block_size, header.nbytes, header.digest, 0,
                     len(ns), len(key), len(dtype), len(header.shape), ALGORITHM_XXH3)
    _SHAPE.pack_into(buf, _FIXED.size, *shape)
    at = _FIXED.size + _SHAPE.size
    buf[at:at + len(ns) + len(key) + len(dtype)] = ns + key + dtype
    struct.pack_into("<Q", buf, _DIGEST_AT, xxhash.xxh3_64_intdigest(bytes(buf)))
    return bytes(buf)


def decode(buf) -> Header:
    """The header at the start of a page file, checked (its digest, its fields); BadPage if it is
    not a page header this kvd can read."""
    view = memoryview(buf)
    if len(view) < HEADER_SIZE:
        raise BadPage(f"{len(view)} bytes, shorter than a page header")
    (magic, version, size, block_size, nbytes, digest, header_digest, ns_len, key_len, dtype_len, ndims,
     algorithm) = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise BadPage("not a kvd page file (no magic)")
    if version != VERSION:
        raise BadPage(f"format version {version}, this kvd reads {VERSION}", stale=True)
    if size != HEADER_SIZE:
        raise BadPage(f"header size {size}")
    check = bytearray(view[:HEADER_SIZE])
    check[_DIGEST_AT:_DIGEST_AT + 8] = bytes(8)
    if xxhash.xxh3_64_intdigest(bytes(check)) != header_digest:
        raise BadPage("the header fails its digest")
    if algorithm != ALGORITHM_XXH3 or ndims > MAX_DIMS:
        raise BadPage(f"digest algorithm {algorithm}, {ndims} dims")
    shape = _SHAPE.unpack_from(view, _FIXED.size)[:ndims]
    at = _FIXED.size + _SHAPE.size
    try:
        ns = bytes(view[at:at + ns_len]).decode("ascii")
        key = bytes(view[at + ns_len:at + ns_len + key_len]).decode("ascii")
        dtype = bytes(view[at + ns_len + key_len:at + ns_len + key_len + dtype_len]).decode("ascii")
    except UnicodeDecodeError:
        raise BadPage("a name is not ASCII") from None
    if not NAMESPACE_RE.fullmatch(ns) or not KEY_RE.fullmatch(key) or dtype not in DTYPE_ITEMSIZE:
        raise BadPage("a namespace, key or dtype no page can have")
    count = DTYPE_ITEMSIZE[dtype]
    for d in shape:
        count *= d
    if count != nbytes:
        raise BadPage(f"{nbytes} bytes for a {dtype} page of shape {list(shape)}")
    return Header(ns, key, dtype, tuple(shape), nbytes, digest, block_size, version)


def check_is(header: Header, namespace: str, key: str, nbytes: int | None = None) -> None:
    """The header is of the page asked for (its namespace, key and size), or BadPage."""
    if header.namespace != namespace:
        raise BadPage(f"the file holds a page of namespace {header.namespace[:64]!r}")
    if header.key != key:
        raise BadPage(f"the file holds the page of key {header.key[:80]!r}")
    if nbytes is not None and header.nbytes != nbytes:
        raise BadPage(f"the file holds {header.nbytes} bytes, the index {nbytes}")
