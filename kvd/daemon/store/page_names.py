"""What a KV tier page may be called and hold (daemon process), pure: the bounds and checks of
namespaces, keys, batches, dtypes and shapes that the page store, the tier's service, its homes
and the disk level's page files all apply, so that each says the same thing the same way.
"""
from __future__ import annotations

import re

from kvd.errors import BadRequest
from kvd.wire.dtypes import DTYPE_ITEMSIZE

MAX_BATCH = 4096  # keys per request: a reply's slots stay far below the 1 MiB header
MAX_KEY_LEN = 256  # a chained SHA-256 hex key is 64
MAX_NAMESPACE_LEN = 256
MAX_DIMS = 8
# keys: printable ASCII without spaces; namespaces: printable ASCII (spaces allowed). Nothing that
# needs escaping in a log line, a status page or a Prometheus label.
KEY_RE = re.compile(rf"[\x21-\x7e]{{1,{MAX_KEY_LEN}}}")
NAMESPACE_RE = re.compile(rf"[\x20-\x7e]{{0,{MAX_NAMESPACE_LEN}}}")


def page_size(dtype: object, shape: object) -> int:
    """Bytes of a page of that dtype and shape, or BadRequest saying what is wrong."""
    if not isinstance(dtype, str) or dtype not in DTYPE_ITEMSIZE:
        raise BadRequest(f"page dtype must be one of {', '.join(DTYPE_ITEMSIZE)}, got {dtype!r}")
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS or not all(
            type(d) is int and 0 <= d < 1 << 40 for d in shape):
        raise BadRequest(f"page shape must be at most {MAX_DIMS} non-negative ints, got {shape!r}")
    count = 1
    for d in shape:
        count *= d
    return count * DTYPE_ITEMSIZE[dtype]


def check_batch(namespace: object, keys: object) -> None:
    if not isinstance(namespace, str) or not NAMESPACE_RE.fullmatch(namespace):
        raise BadRequest(f"a namespace is at most {MAX_NAMESPACE_LEN} printable ASCII characters, got "
                         f"{str(namespace)[:80]!r}")
    if not isinstance(keys, list) or len(keys) > MAX_BATCH:
        raise BadRequest(f"a cache batch is a list of at most {MAX_BATCH} keys"
                         + (f", got {len(keys)}" if isinstance(keys, list) else ""))
    for key in keys:
        if not isinstance(key, str) or not KEY_RE.fullmatch(key):
            raise BadRequest(f"a cache key is 1-{MAX_KEY_LEN} printable ASCII characters without spaces, got "
                             f"{str(key)[:80]!r}")
