"""The dtype table (both processes): wire names and element sizes. No torch here (the daemon never
imports it).

The wire carries dtypes by these exact names; any other name is a BadRequest.
`kvd.client.tensors` maps them to torch dtypes in a worker.
"""
from __future__ import annotations

from kvd.errors import BadRequest

# name on the wire -> bytes per element
DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
}


def itemsize(dtype: str) -> int:
    try:
        return DTYPE_ITEMSIZE[dtype]
    except KeyError:
        raise BadRequest(
            f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPE_ITEMSIZE)}"
        ) from None
