"""A minimal HTTP endpoint on the daemon process's own event loop: /metrics, /healthz, /readyz,
and with a cluster registry /cluster/nodes and /cluster/locate?rid= (JSON, for routers in any
language: they need no etcd or Redis client).

Served from the loop (no thread), so a stuck loop shows up as a failing health check rather than
a cheerful one. A scrape reads every value at once and writes the page out in slices
(`Metrics.render`): it never holds the loop, and the daemon's clients, for the whole page. (Not
in a thread: a thread writing text holds the GIL, and every system call of the loop then waits
for it, which cost clients more than the render it saved.)

Bounded whatever the clients do, on plain non-blocking sockets (no transport or task per
connection, so that refusing a connection costs a few system calls):
- at most MAX_WAITING connections are held while their request head comes; a new one past that
  pushes out the oldest (answered if its head came meanwhile, else told 503 and closed), once that
  is PUSH_OUT_AGE old: a slowloris holds no slot a newcomer needs, and /healthz is answered
  however many there are;
- a head not complete HEAD_DEADLINE after the connection is closed;
- /healthz, /readyz and errors are answered at once, in the callback that read the head;
- at most MAX_SERVING answers that take a render or a registry call are in progress; past that a
  request is answered `503 Service Unavailable` with Retry-After, never closed without a word;
- an answer not taken by the client within WRITE_DEADLINE is cut.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import inspect
import json
import logging
import socket
import struct
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from kvd.errors import KvdError
from kvd.throttle import Throttle

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8192  # a request head (the request line and headers), with its blank line
MAX_WAITING = 48  # connections held while their request head comes; a newcomer pushes out the oldest
MAX_SERVING = 16  # /metrics and /cluster answers in progress; past it: 503 with Retry-After
# a connection this young is not pushed out: accepting waits instead (the kernel holds the
# connections, and the requests they send meanwhile); while more than MAX_WAITING wait to be
# accepted (a flood, or a burst), for FLOOD_PUSH_OUT_AGE only: what waits behind, /healthz among
# it, is let in at MAX_WAITING / FLOOD_PUSH_OUT_AGE connections a second at least
PUSH_OUT_AGE = 0.05  # seconds
FLOOD_PUSH_OUT_AGE = 0.005  # seconds
BUSY = 4  # answers in progress from which a recent rendering of /metrics is served again
HEAD_DEADLINE = 2.0  # seconds from the connection to the end of its request head
WRITE_DEADLINE = 5.0  # seconds an answer may take to be read; a scraper that never reads is cut
RETRY_AFTER = 1  # seconds, in the 503 of a request past the caps
BACKLOG = 1024  # connections the kernel queues before they are accepted (bursts of scrapers, probes)
ACCEPT_BATCH = 128  # connections accepted in one go before other callbacks get their turn
SWEEP_INTERVAL = 0.25  # seconds between checks of the head deadline
ACCEPT_PAUSE = 0.5  # seconds without accepting once the process is out of file descriptors

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def response(status: str, ctype: str, body: bytes, head_only: bool = False, extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n{extra}"
            f"Connection: close\r\n\r\n".encode() + (b"" if head_only else body))


BUSY_ANSWER = response("503 Service Unavailable", "text/plain", b"too many requests at once: retry shortly\n",
                       extra=f"Retry-After: {RETRY_AFTER}\r\n")


def queued(listener: socket.socket) -> int:
    """Connections waiting in a listening socket's backlog (Linux: tcpi_unacked of a listener; 0
    where that cannot be read)."""
    try:
        return struct.unpack_from("I", listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 32), 24)[0]
    except (OSError, AttributeError, struct.error):
        return 0


class ClusterView(Protocol):
    def nodes(self) -> list[dict[str, Any]]: ...
    async def locate(self, request_id: str) -> list[dict[str, Any]]: ...


class _Conn:
    __slots__ = ("buf", "fd", "out", "reading", "since", "sock", "task", "timer", "writing")

    def __init__(self, sock: socket.socket, now: float) -> None:
        self.sock, self.fd, self.since = sock, sock.fileno(), now
        self.buf = bytearray()
        self.out: memoryview | None = None  # what is left to write of the answer
        self.reading = self.writing = False  # registered with the loop for reading, writing
        self.timer: asyncio.TimerHandle | None = None  # the write deadline
        self.task: asyncio.Task[None] | None = None  # producing the answer (/metrics, /cluster)


class HttpEndpoint:
    def __init__(self, host: str, port: int, metrics: Callable[[bool], Awaitable[bytes] | bytes],
                 ready: Callable[[], bool], cluster: ClusterView | None = None) -> None:
        self.host, self.port = host, port
        self._metrics, self._ready, self._cluster = metrics, ready, cluster
        self._started_on: asyncio.AbstractEventLoop | None = None  # the loop that start() ran on
        self._listeners: list[socket.socket] = []
        self._waiting: dict[_Conn, None] = {}  # reading their head, oldest first
        self._serving: set[_Conn] = set()  # producing or writing an answer
        self._sweeper: asyncio.TimerHandle | None = None
        self._paused: asyncio.TimerHandle | None = None  # accepting resumes then
        self._accept_errors = Throttle()  # out of descriptors: said once a minute
        self._closed = False

    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        """The loop every callback runs on; set by start(), before any socket is registered."""
        if self._started_on is None:
            raise RuntimeError("HttpEndpoint used before start()")
        return self._started_on

    async def start(self) -> None:
        loop = self._started_on = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.host or None, self.port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        port = self.port
        try:
            for family, kind, proto, _, address in dict.fromkeys(infos):  # (each address once)
                sock = socket.socket(family, kind, proto)
                self._listeners.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((address[0], port, *address[2:]))
                port = port or sock.getsockname()[1]  # (port 0: every address on the one port chosen)
                sock.listen(BACKLOG)
                sock.setblocking(False)
        except OSError:
            for sock in self._listeners:
                sock.close()
            self._listeners.clear()
            raise
        self.port = port
        for sock in self._listeners:
            loop.add_reader(sock.fileno(), self._accept, sock)

    async def close(self) -> None:
        self._closed = True
        for sock in self._listeners:
            self._loop.remove_reader(sock.fileno())
            sock.close()
        self._listeners.clear()
        for timer in (self._sweeper, self._paused):
            if timer is not None:
                timer.cancel()
        self._sweeper = self._paused = None
        for conn in [*self._waiting, *self._serving]:
            if conn.task is not None:
                conn.task.cancel()
            self._close(conn)

    # --- connections ---------------------------------------------------------------------------

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(ACCEPT_BATCH):
            if len(self._waiting) >= MAX_WAITING:  # the oldest may still be sending its request
                age = time.monotonic() - next(iter(self._waiting)).since
                grace = PUSH_OUT_AGE if queued(listener) <= MAX_WAITING else FLOOD_PUSH_OUT_AGE
                if age < grace:
                    self._pause_accepting(min(grace - age, FLOOD_PUSH_OUT_AGE))  # (then a look at the backlog again)
                    return
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # out of descriptors: the ones queued wait in the backlog (not closed unanswered)
                    if self._accept_errors.allow():
                        log.warning("metrics endpoint: cannot accept connections (%s): pausing %gs (again at "
                                    "most once a minute)", exc.strerror, ACCEPT_PAUSE)
                    self._pause_accepting(ACCEPT_PAUSE)
                    return
                continue  # (ECONNABORTED and the like: that one is gone)
            self._admit(sock)

    def _pause_accepting(self, seconds: float) -> None:
        """Stop accepting for a while: the connections not accepted wait in the kernel's backlog
        (not closed unanswered)."""
        if self._paused is None:
            for listener in self._listeners:
                self._loop.remove_reader(listener.fileno())
        else:
            self._paused.cancel()
        self._paused = self._loop.call_later(seconds, self._resume_accepting)

    def _resume_accepting(self) -> None:
        if self._paused is not None:
            self._paused.cancel()
            self._paused = None
            for listener in self._listeners:
                self._loop.add_reader(listener.fileno(), self._accept, listener)

    def _admit(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        while len(self._waiting) >= MAX_WAITING:
            self._push_out(next(iter(self._waiting)))
        conn = _Conn(sock, time.monotonic())
        self._waiting[conn] = None
        self._readable(conn)  # a request that came with the connection is answered at once
        if conn in self._waiting:
            conn.reading = True
            self._loop.add_reader(conn.fd, self._readable, conn)
            if self._sweeper is None:
                self._sweeper = self._loop.call_later(SWEEP_INTERVAL, self._sweep)

    def _push_out(self, conn: _Conn) -> None:
        """Make room: the oldest connection still without a whole request head is answered if its
        head came meanwhile, else told 503 (Retry-After) and closed."""
        self._readable(conn)
        if conn in self._waiting:
            self._send_and_close(conn, BUSY_ANSWER)

    def _sweep(self) -> None:
        """Close the connections whose head did not come within HEAD_DEADLINE (oldest first: the
        dict is in the order they came)."""
        self._sweeper = None
        deadline = time.monotonic() - HEAD_DEADLINE
        while self._waiting:
            conn = next(iter(self._waiting))
            if conn.since > deadline:
                break
            self._readable(conn)  # (the last of it may have come just now)
            if conn in self._waiting:
                self._close(conn)
        if self._waiting and not self._closed:
            self._sweeper = self._loop.call_later(SWEEP_INTERVAL, self._sweep)

    def _readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(MAX_REQUEST_BYTES + 1 - len(conn.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not data:  # the client gave up
            self._close(conn)
            return
        conn.buf += data
        end = conn.buf.find(b"\r\n\r\n", max(0, len(conn.buf) - len(data) - 3))
        if end < 0:
            if len(conn.buf) > MAX_REQUEST_BYTES:
                self._send_and_close(conn, response("431 Request Header Fields Too Large", "text/plain",
                                                    b"request head too large\n"))
            return
        self._stop_reading(conn)
        try:
            self._request(conn, bytes(conn.buf[:end]))
        except Exception:
            log.exception("metrics endpoint failed")
            self._close(conn)

    def _stop_reading(self, conn: _Conn) -> None:
        self._waiting.pop(conn, None)
        if conn.reading:
            conn.reading = False
            self._loop.remove_reader(conn.fd)

    def _send_and_close(self, conn: _Conn, data: bytes) -> None:
        """A short answer, written at once (a fresh connection's send buffer takes it), then closed."""
        self._stop_reading(conn)
        with contextlib.suppress(OSError):
            conn.sock.send(data)
        self._close(conn)

    def _close(self, conn: _Conn, reset: bool = False) -> None:
        self._stop_reading(conn)
        self._serving.discard(conn)
        if conn.writing:
            conn.writing = False
            self._loop.remove_writer(conn.fd)
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        if reset:  # an answer never read: drop what the kernel still holds of it
            with contextlib.suppress(OSError):
                conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.sock.close()

    # --- requests ------------------------------------------------------------------------------

    def _request(self, conn: _Conn, head: bytes) -> None:
        method, target, *_ = [*head.split(b"\r\n", 1)[0].decode("latin-1").split(" "), "", ""]
        path, _, query = target.partition("?")
        head_only = method == "HEAD"
        if method not in ("GET", "HEAD"):
            self._send_and_close(conn, response("405 Method Not Allowed", "text/plain", b"GET only\n"))
        elif path == "/healthz":
            self._send_and_close(conn, response("200 OK", "text/plain", b"ok\n", head_only))
        elif path == "/readyz":
            ok = self._ready()
            self._send_and_close(conn, response("200 OK" if ok else "503 Service Unavailable", "text/plain",
                                                b"ready\n" if ok else b"not ready\n", head_only))
        elif len(self._serving) >= MAX_SERVING and (path == "/metrics" or path.startswith("/cluster/")):
            # (decided before a byte of a page is written: one the kernel does not take at once
            # needs a slot until it is read, and a page cut halfway would be a bare close)
            self._send_and_close(conn, BUSY_ANSWER)
        elif path == "/metrics":
            page = self._metrics(len(self._serving) >= BUSY)
            if inspect.isawaitable(page):
                self._answer_later(conn, self._page(page), head_only)
            else:  # a recent rendering, served again
                self._respond(conn, "200 OK", PROMETHEUS_TEXT, page, head_only)
        elif path.startswith("/cluster/"):
            self._answer_later(conn, self._cluster_page(path, urllib.parse.parse_qs(query)), head_only)
        else:
            self._send_and_close(conn, response("404 Not Found", "text/plain",
                                                b"try /metrics, /healthz or /readyz\n", head_only))

    def _answer_later(self, conn: _Conn, answer: Awaitable[tuple[str, str, bytes]], head_only: bool) -> None:
        self._serving.add(conn)
        conn.task = self._loop.create_task(self._answer(conn, answer, head_only))

    async def _answer(self, conn: _Conn, answer: Awaitable[tuple[str, str, bytes]], head_only: bool) -> None:
        try:
            status, ctype, body = await answer
        except Exception:
            log.exception("metrics endpoint failed")
            status, ctype, body = "500 Internal Server Error", "text/plain", b"internal error: see the daemon's log\n"
        conn.task = None
        if conn in self._serving:  # (not closed meanwhile)
            self._respond(conn, status, ctype, body, head_only)

    @staticmethod
    async def _page(page: Awaitable[bytes]) -> tuple[str, str, bytes]:
        return "200 OK", PROMETHEUS_TEXT, await page

    def _respond(self, conn: _Conn, status: str, ctype: str, body: bytes, head_only: bool) -> None:
        """Write the answer: what the kernel does not take at once is written as the client reads,
        for WRITE_DEADLINE at most."""
        conn.out = memoryview(response(status, ctype, body, head_only))
        self._flush(conn)
        if conn.out is not None:  # (a slot was free when the request was taken: _request)
            self._serving.add(conn)
            conn.writing = True
            self._loop.add_writer(conn.fd, self._flush, conn)
            conn.timer = self._loop.call_later(WRITE_DEADLINE, self._close, conn, True)

    def _flush(self, conn: _Conn) -> None:
        try:
            while conn.out:
                conn.out = conn.out[conn.sock.send(conn.out):]
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # (the client is gone)
            pass
        conn.out = None
        self._close(conn)  # (everything written: the kernel sends it, then the FIN)

    async def _cluster_page(self, path: str, query: dict[str, list[str]]) -> tuple[str, str, bytes]:
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
