"""A small asyncio HTTP/1.1 JSON client for etcd's v3 gRPC gateway (POST /v3/...), in whichever
process talks to etcd.

Runs in the daemon and in routers, under etcd.py. Owns the TCP connections to the etcd endpoints:
a few idle keep-alive connections for unary calls, one dedicated connection per stream (watch).
Standard library only: the gateway speaks plain HTTP/1.1 and JSON, so kvd needs neither grpcio nor
protobuf (which vLLM pins) to use etcd. Deadlines are the caller's (`asyncio.timeout`); a connection
that saw an error or a cancellation mid-request is closed, never reused.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

MAX_BODY = 64 << 20  # a range of every key in a big cluster stays well under this
MAX_LINE = 64 << 10
_IDLE_KEEP = 4  # idle keep-alive connections kept per client


class GatewayError(Exception):
    """etcd answered with an error: `code` is the gRPC status code (5 = not found, ...)."""

    def __init__(self, status: int, code: int, message: str) -> None:
        super().__init__(f"etcd: {message} (HTTP {status}, grpc code {code})")
        self.status, self.code, self.message = status, code, message


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    def close(self) -> None:
        self.writer.close()

    async def send(self, path: str, body: bytes) -> None:
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        await self.writer.drain()

    async def _line(self) -> bytes:
        line = await self.reader.readuntil(b"\r\n")
        if len(line) > MAX_LINE:
            raise ConnectionError("etcd: header line too long")
        return line[:-2]

    async def head(self) -> tuple[int, dict[str, str]]:
        status_line = await self._line()
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise ConnectionError(f"etcd: not an HTTP response: {status_line[:80]!r}")
        headers: dict[str, str] = {}
        while line := await self._line():
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return int(parts[1]), headers

    async def chunks(self, headers: dict[str, str]) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive (chunked transfer) or all of it (Content-Length)."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await self._line()).split(b";")[0], 16)
                if size > MAX_BODY:
                    raise ConnectionError("etcd: chunk too large")
                if size == 0:
                    await self._line()  # no trailers from the gateway; the empty line ends the body
                    return
                data = await self.reader.readexactly(size)
                await self._line()
                yield data
        else:
            n = int(headers.get("content-length", "0"))
            if n > MAX_BODY:
                raise ConnectionError("etcd: response too large")
            yield await self.reader.readexactly(n)


def _error(status: int, body: bytes) -> GatewayError:
    try:
        obj = json.loads(body)
        return GatewayError(status, int(obj.get("code", 2)), str(obj.get("message") or obj.get("error")))
    except (ValueError, AttributeError):
        return GatewayError(status, 2, body[:200].decode("utf-8", "replace"))


class GatewayClient:
    """JSON calls to one etcd cluster; `endpoints` are tried in turn when one cannot be reached."""

    def __init__(self, endpoints: list[tuple[str, int]]) -> None:
        if not endpoints:
            raise ValueError("etcd: no endpoints")
        self.endpoints = list(endpoints)
        self._current = 0
        self._idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        last: Exception | None = None
        for i in range(len(self.endpoints)):
            host, port = self.endpoints[(self._current + i) % len(self.endpoints)]
            try:
                reader, writer = await asyncio.open_connection(host, port, limit=MAX_LINE * 2)
            except OSError as e:
                last = e
                continue
            self._current = (self._current + i) % len(self.endpoints)
            return _Conn(reader, writer, f"{host}:{port}")
        raise ConnectionError(f"etcd: no endpoint reachable ({last})")

    def _failover(self) -> None:
        self._current = (self._current + 1) % len(self.endpoints)

    async def call(self, path: str, req: dict[str, Any]) -> dict[str, Any]:
        """One unary call. Raises GatewayError for an etcd error, OSError/ConnectionError/
        IncompleteReadError for transport trouble; the caller bounds it with a deadline."""
        body = json.dumps(req).encode()
        # a pooled connection may have been closed by the server while idle: one retry on a fresh
        # one, and only if no byte of the answer came (every request kvd sends is safe to repeat)
        for attempt in (0, 1):
            reused = bool(self._idle) and attempt == 0
            conn = self._idle.pop() if reused else await self._connect()
            got_head = False
            try:
                await conn.send(path, body)
                status, headers = await conn.head()
                got_head = True
                data = b"".join([c async for c in conn.chunks(headers)])
            except (OSError, EOFError, asyncio.IncompleteReadError, ValueError) as e:
                conn.close()
                if reused and not got_head:
                    continue
                self._failover()
                raise ConnectionError(f"etcd: {type(e).__name__}: {e}") from None
            except BaseException:
                conn.close()  # cancelled (deadline) mid-request: the stream is in an unknown state
                raise
            if headers.get("connection", "").lower() == "close" or len(self._idle) >= _IDLE_KEEP:
                conn.close()
            else:
                self._idle.append(conn)
            if status != 200:
                raise _error(status, data)
            return json.loads(data)
        raise AssertionError("unreachable")

    async def stream(self, path: str, req: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """A streaming call (watch): yields each JSON message's "result" as it arrives; ends when the
        server ends the stream. Closing the generator closes the connection, which cancels the watch."""
        conn = await self._connect()
        try:
            await conn.send(path, json.dumps(req).encode())
            status, headers = await conn.head()
            if status != 200:
                raise _error(status, b"".join([c async for c in conn.chunks(headers)]))
            buf = b""
            async for piece in conn.chunks(headers):
                buf += piece
                # the gateway writes one JSON object per message, newline-delimited; a message may
                # span chunks
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.strip():
                        msg = json.loads(line)
                        if "error" in msg:
                            err = msg["error"]
                            raise GatewayError(status, int(err.get("grpc_code", err.get("code", 2))),
                                               str(err.get("message")))
                        yield msg.get("result", msg)
            if buf.strip():
                yield json.loads(buf).get("result", {})
        except (OSError, EOFError, asyncio.IncompleteReadError, ValueError) as e:
            self._failover()
            raise ConnectionError(f"etcd stream: {type(e).__name__}: {e}") from None
        finally:
            conn.close()

    async def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
