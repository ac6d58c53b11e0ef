"""The client library, imported by inference workers (worker process): `Client` (blocking),
`AsyncClient` (asyncio), their put streams, and `Rows` for paged caches.

    from kvd.client import Client      # also kvd.Client
"""
from .aio import AsyncClient, AsyncPutStream
from .paged import Rows
from .sync import Client, PutStream

__all__ = ["AsyncClient", "AsyncPutStream", "Client", "PutStream", "Rows"]
