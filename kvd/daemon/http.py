"""A minimal HTTP endpoint on the daemon process's own event loop: /metrics, /healthz, /readyz.

Served from the loop (no thread), so a scrape sees a consistent snapshot of the daemon's
state, and a stuck loop shows up as a failing health check rather than a cheerful one.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8192


class HttpEndpoint:
    def __init__(self, host: str, port: int, metrics: Callable[[], bytes], ready: Callable[[], bool]) -> None:
        self.host, self.port = host, port
        self._metrics, self._ready = metrics, ready
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            if len(head) > MAX_REQUEST_BYTES:
                raise ValueError("request too large")
            method, path, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            path = path.split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
            elif path == "/metrics":
                status, ctype, body = "200 OK", "text/plain; version=0.0.4; charset=utf-8", self._metrics()
            elif path == "/healthz":
                status, ctype, body = "200 OK", "text/plain", b"ok\n"
            elif path == "/readyz":
                ok = self._ready()
                status, ctype, body = ("200 OK" if ok else "503 Service Unavailable"), "text/plain", \
                    (b"ready\n" if ok else b"not ready\n")
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"try /metrics, /healthz or /readyz\n"
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + (body if method == "GET" else b""))
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError,
                ConnectionError):
            pass
        except Exception:
            log.exception("metrics endpoint failed")
        finally:
            writer.close()
