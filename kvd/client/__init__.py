"""The client library, imported by inference workers (worker process): `Client` (blocking),
`AsyncClient` (asyncio), their put streams, `Rows` for paged caches, and `Parts` (a KV tier page
given as several tensors).

    from kvd.client import Client      # also kvd.Client

The faces load on first use (they import torch); `kvd.client.connection`, the bare connection
to a daemon that `kvd status` uses, does not.
"""
from __future__ import annotations

__all__ = ["AsyncClient", "AsyncPutStream", "Client", "Parts", "PutStream", "Rows"]


def __getattr__(name: str):
    if name in ("Client", "PutStream"):
        from . import sync

        return getattr(sync, name)
    if name in ("AsyncClient", "AsyncPutStream"):
        from . import aio

        return getattr(aio, name)
    if name == "Rows":
        from .blocks import Rows

        return Rows
    if name == "Parts":
        from .cache import Parts

        return Parts
    raise AttributeError(f"module 'kvd.client' has no attribute {name!r}")
