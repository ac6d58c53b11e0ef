"""A small asyncio HTTP/1.1 JSON client for etcd's v3 gRPC gateway (POST /v3/...), in whichever
process talks to etcd.

Runs in the daemon and in routers, under etcd.py. Owns the TCP (or TLS) connections to the etcd
endpoints: a few idle keep-alive connections for unary calls, one dedicated connection per stream
(watch). The gateway speaks plain HTTP/1.1 and JSON, so kvd needs neither grpcio nor protobuf (which
vLLM pins) to use etcd.

The HTTP framing is h11's (sans-IO: it parses, we do the I/O). It replaced a hand-written parser
once the registry became something an attacker may answer for: h11 is small, pure Python, widely used
and fuzzed, and gets chunk extensions, trailers, header limits and keep-alive state right, while the
connections, deadlines (the caller's `asyncio.timeout`) and TLS (asyncio's ssl) stay ours. httpx was
not taken: its own pool, timeouts and anyio layer would sit between our deadlines and the socket, for
nothing the gateway needs. What h11 leaves to us is bounding what we keep: a unary answer is capped
in total (`max_body`, not per chunk), a stream per message. A connection that saw an error or a
cancellation mid-request is closed, never reused.
"""
from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

try:
    import h11
except ImportError:  # the etcd extra: pip install 'kvd-daemon[etcd]'
    h11 = None  # type: ignore[assignment]

MAX_BODY = 64 << 20  # one unary answer, in total; a listing pages far below it
MAX_LINE = 64 << 10  # the status line and headers of an answer, together
_READ = 256 << 10
_IDLE_KEEP = 4  # idle keep-alive connections kept per client

Headers = Sequence[tuple[str, str]]


class GatewayError(Exception):
    """etcd answered with an error: `code` is the gRPC status code (5 = not found, ...)."""

    def __init__(self, status: int, code: int, message: str) -> None:
        super().__init__(f"etcd: {message} (HTTP {status}, grpc code {code})")
        self.status, self.code, self.message = status, code, message


class BodyTooLarge(ConnectionError):
    """The answer went past the cap it was read under; its connection is closed."""


class TLSError(ConnectionError):
    """The TLS handshake or session failed: an untrusted certificate, or the server refused ours."""


def _refused(e: BaseException) -> bool:
    """A TLS failure that retrying will not cure (a certificate, an alert), not a session cut short."""
    return isinstance(e, ssl.SSLError) and not isinstance(e, (ssl.SSLEOFError, ssl.SSLZeroReturnError))


def _transport_errors() -> tuple[type[BaseException], ...]:
    # h11.ProtocolError: a malformed answer, or one that would make our next request malformed (a
    # token with a line break in it, say)
    return (OSError, EOFError, asyncio.IncompleteReadError, ValueError, h11.ProtocolError)


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host
        self.h = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_LINE)

    def close(self) -> None:
        self.writer.close()

    async def send(self, path: str, body: bytes, headers: Headers) -> None:
        req = h11.Request(method="POST", target=path, headers=[
            ("Host", self.host), ("Content-Type", "application/json"), ("Content-Length", str(len(body))),
            *headers])
        self.writer.write(self.h.send(req) + self.h.send(h11.Data(data=body)) + self.h.send(h11.EndOfMessage()))
        await self.writer.drain()

    async def _event(self) -> Any:
        while (ev := self.h.next_event()) is h11.NEED_DATA:
            self.h.receive_data(await self.reader.read(_READ))  # b"" at EOF: h11 says what that means
        return ev

    async def head(self) -> tuple[int, dict[str, str]]:
        ev = await self._event()
        while isinstance(ev, h11.InformationalResponse):
            ev = await self._event()
        if not isinstance(ev, h11.Response):
            raise ConnectionError(f"etcd: expected a response, got {type(ev).__name__}")
        return ev.status_code, {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in ev.headers}

    async def chunks(self, cap: float) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive; BodyTooLarge once they add up to more than `cap`."""
        total = 0
        while True:
            ev = await self._event()
            if isinstance(ev, h11.EndOfMessage):
                return
            if not isinstance(ev, h11.Data):
                raise ConnectionError(f"etcd: connection ended mid-body ({type(ev).__name__})")
            total += len(ev.data)
            if total > cap:
                raise BodyTooLarge(f"etcd: answer larger than {int(cap)} bytes")
            yield bytes(ev.data)

    async def body(self, headers: dict[str, str], cap: int) -> bytes:
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise BodyTooLarge(f"etcd: answer of {declared} bytes, over the {cap} read")
        return b"".join([c async for c in self.chunks(cap)])

    def reusable(self) -> bool:
        if self.h.our_state is h11.DONE and self.h.their_state is h11.DONE:
            self.h.start_next_cycle()
            return True
        return False


def _error(status: int, body: bytes) -> GatewayError:
    try:
        obj = json.loads(body)
        return GatewayError(status, int(obj.get("code", 2)), str(obj.get("message") or obj.get("error")))
    except (ValueError, AttributeError):
        return GatewayError(status, 2, body[:200].decode("utf-8", "replace"))


class GatewayClient:
    """JSON calls to one etcd cluster; `endpoints` are tried in turn when one cannot be reached.
    `tls`: the client context for https (etcds://), hostname checked against each endpoint's host."""

    def __init__(self, endpoints: list[tuple[str, int]], tls: ssl.SSLContext | None = None,
                 max_body: int = MAX_BODY) -> None:
        if h11 is None:
            raise RuntimeError("the etcd registry needs h11: pip install 'kvd-daemon[etcd]' (or pip install h11)")
        if not endpoints:
            raise ValueError("etcd: no endpoints")
        self.endpoints = list(endpoints)
        self.tls = tls
        self.max_body = max_body
        self._current = 0
        self._idle: list[_Conn] = []
        self._answered = False  # any answer yet (until then a hang-up may be a TLS server's)

    async def _open(self, host: str, port: int) -> _Conn:
        try:
            reader, writer = await asyncio.open_connection(
                host, port, ssl=self.tls, server_hostname=host if self.tls else None)
        except ssl.SSLError as e:
            if not _refused(e):
                raise ConnectionError(f"etcd {host}:{port}: {e}") from None
            raise TLSError(f"etcd {host}:{port}: {e}") from None
        return _Conn(reader, writer, f"[{host}]:{port}" if ":" in host else f"{host}:{port}")

    async def _connect(self) -> _Conn:
        last: Exception | None = None
        for i in range(len(self.endpoints)):
            host, port = self.endpoints[(self._current + i) % len(self.endpoints)]
            try:
                conn = await self._open(host, port)
            except TLSError as e:
                last = e
                continue
            except OSError as e:
                last = last if isinstance(last, TLSError) else e
                continue
            self._current = (self._current + i) % len(self.endpoints)
            return conn
        if isinstance(last, TLSError):
            raise last
        raise ConnectionError(f"etcd: no endpoint reachable ({last})")

    def _failover(self) -> None:
        self._current = (self._current + 1) % len(self.endpoints)

    async def call(self, path: str, req: dict[str, Any], *, headers: Headers = (),
                   max_body: int | None = None) -> dict[str, Any]:
        """One unary call. Raises GatewayError for an etcd error, TLSError, BodyTooLarge (the answer
        is over `max_body`, default the client's), ConnectionError for other transport trouble; the
        caller bounds it with a deadline."""
        body = json.dumps(req).encode()
        cap = self.max_body if max_body is None else max_body
        # a pooled connection may have been closed by the server while idle: one retry on a fresh
        # one, and only if no byte of the answer came (every request kvd sends is safe to repeat)
        for attempt in (0, 1):
            reused = bool(self._idle) and attempt == 0
            conn = self._idle.pop() if reused else await self._connect()
            got_head = False
            try:
                await conn.send(path, body, headers)
                status, head = await conn.head()
                got_head = self._answered = True
                data = await conn.body(head, cap)
            except BodyTooLarge:
                conn.close()
                raise
            except _transport_errors() as e:
                conn.close()
                if reused and not got_head:
                    continue
                if _refused(e):
                    raise TLSError(f"etcd: {e}") from None
                self._failover()
                raise ConnectionError(f"etcd: {type(e).__name__}: {e}{self._tls_hint(got_head)}") from None
            except BaseException:
                conn.close()  # cancelled (deadline) mid-request: the stream is in an unknown state
                raise
            if conn.reusable() and len(self._idle) < _IDLE_KEEP:
                self._idle.append(conn)
            else:
                conn.close()
            if status != 200:
                raise _error(status, data)
            reply: dict[str, Any] = json.loads(data)
            return reply
        raise AssertionError("unreachable")

    def _tls_hint(self, answered: bool) -> str:
        """A plain etcd:// call that met no HTTP answer: the server may speak TLS (it then hangs up)."""
        if self.tls is not None or answered or self._answered:
            return ""
        return " (no HTTP answer came: if etcd serves TLS, use etcds://)"

    async def stream(self, path: str, req: dict[str, Any], *,
                     headers: Headers = ()) -> AsyncGenerator[dict[str, Any], None]:
        """A streaming call (watch): yields each JSON message's "result" as it arrives; ends when the
        server ends the stream. One message is capped at the client's max_body. Closing the generator
        closes the connection, which cancels the watch."""
        conn = await self._connect()
        got_head = False
        try:
            await conn.send(path, json.dumps(req).encode(), headers)
            status, head = await conn.head()
            got_head = self._answered = True
            if status != 200:
                raise _error(status, await conn.body(head, MAX_LINE))
            # the gateway writes one JSON object per message, newline-delimited; a message may span
            # chunks, which wait in `pending` (joined once, when its end comes: no quadratic copying)
            pending: list[bytes] = []
            size = 0
            async for piece in conn.chunks(float("inf")):
                while (end := piece.find(b"\n")) >= 0:
                    line, piece = b"".join([*pending, piece[:end]]), piece[end + 1:]
                    pending, size = [], 0
                    if line.strip():
                        yield _message(status, line)
                pending.append(piece)
                size += len(piece)
                if size > self.max_body:
                    raise BodyTooLarge(f"etcd stream: a message larger than {self.max_body} bytes")
            if (rest := b"".join(pending)).strip():
                yield _message(status, rest)
        except BodyTooLarge:
            raise
        except _transport_errors() as e:
            if _refused(e):
                raise TLSError(f"etcd stream: {e}") from None
            self._failover()
            raise ConnectionError(f"etcd stream: {type(e).__name__}: {e}{self._tls_hint(got_head)}") from None
        finally:
            conn.close()

    async def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


def _message(status: int, line: bytes) -> dict[str, Any]:
    msg = json.loads(line)
    if "error" in msg:
        err = msg["error"]
        raise GatewayError(status, int(err.get("grpc_code", err.get("code", 2))), str(err.get("message")))
    result: dict[str, Any] = msg.get("result", msg)
    return result
