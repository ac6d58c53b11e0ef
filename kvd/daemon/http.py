"""A minimal HTTP endpoint on the daemon process's own event loop: /metrics, /healthz, /readyz,
and with a cluster registry /cluster/nodes and /cluster/locate?rid= (JSON, for routers in any
language: they need no etcd or Redis client).

Served from the loop (no thread), so a scrape sees a consistent snapshot of the daemon's
state, and a stuck loop shows up as a failing health check rather than a cheerful one.
"""
from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
from typing import Callable, Protocol

from kvd.errors import KvdError

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8192
MAX_CONNECTIONS = 64  # scrapes at once; more are closed at once (a slowloris holds one fd, not all)
BUSY = 4  # scrapes in flight from which a recent rendering is served again
READ_DEADLINE = WRITE_DEADLINE = 5.0  # seconds: a scraper that never sends, or never reads, is dropped


class ClusterView(Protocol):
    def nodes(self) -> list[dict]: ...
    async def locate(self, request_id: str) -> list[dict]: ...


class HttpEndpoint:
    def __init__(self, host: str, port: int, metrics: Callable[[bool], bytes], ready: Callable[[], bool],
                 cluster: ClusterView | None = None) -> None:
        self.host, self.port = host, port
        self._metrics, self._ready, self._cluster = metrics, ready, cluster
        self._server: asyncio.base_events.Server | None = None
        self._open = 0  # connections being served

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= MAX_CONNECTIONS:
            writer.transport.abort()
            return
        self._open += 1
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_DEADLINE)
            if len(head) > MAX_REQUEST_BYTES:
                raise ValueError("request too large")
            method, target, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            path, _, query = target.partition("?")
            if method not in ("GET", "HEAD"):
                status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
            elif path == "/metrics":
                status, ctype, body = ("200 OK", "text/plain; version=0.0.4; charset=utf-8",
                                       self._metrics(self._open > BUSY))
            elif path == "/healthz":
                status, ctype, body = "200 OK", "text/plain", b"ok\n"
            elif path == "/readyz":
                ok = self._ready()
                status, ctype, body = ("200 OK" if ok else "503 Service Unavailable"), "text/plain", \
                    (b"ready\n" if ok else b"not ready\n")
            elif path.startswith("/cluster/"):
                status, ctype, body = await self._cluster_page(path, urllib.parse.parse_qs(query))
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"try /metrics, /healthz or /readyz\n"
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + (body if method == "GET" else b""))
            await asyncio.wait_for(writer.drain(), WRITE_DEADLINE)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError,
                ConnectionError):
            writer.transport.abort()  # (what it did not read goes with it)
        except Exception:
            log.exception("metrics endpoint failed")
        finally:
            self._open -= 1
            writer.close()


    async def _cluster_page(self, path: str, query: dict) -> tuple[str, str, bytes]:
        if self._cluster is None:
            return "404 Not Found", "text/plain", b"this daemon has no cluster registry (--registry)\n"
        try:
            if path == "/cluster/nodes":
                value = self._cluster.nodes()
            elif path == "/cluster/locate" and query.get("rid"):
                value = await self._cluster.locate(query["rid"][0])
            else:
                return "404 Not Found", "text/plain", b"try /cluster/nodes or /cluster/locate?rid=REQUEST_ID\n"
        except KvdError as exc:  # the registry is down: say so, at once
            return "503 Service Unavailable", "application/json", json.dumps({"error": exc.message}).encode() + b"\n"
        return "200 OK", "application/json", json.dumps(value).encode() + b"\n"
