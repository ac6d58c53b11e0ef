"""`AsyncClient`: the client library for asyncio workers (worker process), same operations as `Client`.

The operations (put, get, streams, paged blocks) are written once in `core.py` as I/O-free
generators; this face runs them on the event loop over one connection to the daemon's local
socket, so any number of tasks can have requests in flight on it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvd.errors import KvdError, ProtocolError, Timeout, error_from_code
from kvd.wire import protocol as p

from .blocks import get_blocks, put_blocks
from .cache import Parts, cache_exists, cache_get, cache_put
from .connection import StreamConnection, peer_port_error
from .core import CONNECT_TIMEOUT, REPLY_GRACE, ConnectionLost, _ClientCore
from .ops import NO_REPLY, Emit, Operation, Receive, StreamClosed, req_of
from .streaming import StreamState, abort_stream, commit_stream, open_stream, read_stream, specs_from, write_stream

log = logging.getLogger(__name__)
_NO_RESULT = object()


class AsyncClient(_ClientCore):
    """Talks to the local kvd daemon from asyncio. Safe for concurrent use by tasks of one loop."""

    def __init__(self, socket: str | None = None, *, reply_timeout: float = REPLY_GRACE,
                 connect_timeout: float = CONNECT_TIMEOUT) -> None:
        super().__init__(socket, reply_timeout, connect_timeout)
        self._sock: StreamConnection | None = None
        self._lost: KvdError | None = None  # why the connection ended; the next call reconnects
        self._pending: dict[int, asyncio.Future[p.Message]] = {}
        self._streams: dict[int, asyncio.Queue[p.Message | KvdError]] = {}  # get_stream req -> its later messages
        self._connecting: asyncio.Lock | None = None

    async def _steps(self, op: Operation):
        """Run an operation: do its I/O, yield what it emits; the last item is ("result", value)."""
        streams: list[int] = []  # this operation's get_stream requests: their queues go with it
        try:
            reply = None
            while True:
                try:
                    step = op.send(reply)
                except StopIteration as stop:
                    for req in streams:  # (now: a caller that stops at the result never resumes us)
                        self._streams.pop(req, None)
                    yield "result", stop.value
                    return
                reply = None
                if isinstance(step, Emit):
                    try:
                        yield "emit", step.value
                    except GeneratorExit:
                        self._unwind(op, StreamClosed("iteration stopped early"), reraise=False)
                        raise
                    continue
                try:
                    if isinstance(step, Receive):
                        reply = await self._receive(step.req, step.wait)
                    else:
                        msg, wait = step
                        if wait is NO_REPLY:
                            self._send_nowait(msg)
                            continue
                        if isinstance(msg, p.GetStream):
                            self._streams[msg.req] = asyncio.Queue()
                            streams.append(msg.req)
                        reply = await self._call(msg, wait)
                except BaseException as exc:
                    self._unwind(op, exc, reraise=True)
        finally:
            for req in streams:
                self._streams.pop(req, None)

    def _read_notices(self) -> None:
        pass  # _on_reply takes every message in as it arrives

    def _send_nowait(self, msg: p.Message) -> None:
        if self._sock is None:
            return  # reconnecting: the daemon that lost us gives back what we held by itself
        with contextlib.suppress(KvdError):  # clean-up only: a daemon that lost us gives back what we held by itself
            self._sock.send_now(p.encode(msg))

    async def _drive(self, op: Operation) -> Any:
        # run _steps to its end rather than return from inside the loop: an async generator left
        # suspended is closed by the event loop's finalizer hook, which costs a task and a
        # self-pipe wake-up per operation (measured: a fifth of a small put's client CPU)
        result: Any = _NO_RESULT
        async for kind, value in self._steps(op):
            if kind == "result":
                result = value
        if result is _NO_RESULT:
            raise ProtocolError("operation ended without a result")
        return result

    async def _receive(self, req: int, wait: float) -> p.Message:
        try:
            reply = await asyncio.wait_for(self._streams[req].get(), wait + self.reply_timeout)
        except TimeoutError:
            raise Timeout(f"daemon at {self.endpoint} went silent during a stream") from None
        if isinstance(reply, KvdError):
            raise reply
        return self._raise_if_error(reply)

    async def _call(self, msg: p.Message, wait: float) -> p.Message:
        fut: asyncio.Future[p.Message] = asyncio.get_running_loop().create_future()
        req = req_of(msg)
        self._pending[req] = fut
        try:
            if self._sock is None:  # closed under the operation (close() from another task)
                raise ConnectionLost(f"the connection to the kvd daemon at {self.endpoint} was lost")
            self._sock.send_now(p.encode(msg))
            reply = await asyncio.wait_for(fut, wait + self.reply_timeout)
        except TimeoutError:
            self._abandon(msg)
            raise Timeout(f"daemon at {self.endpoint} did not answer {msg.TYPE} in time") from None
        except asyncio.CancelledError:  # (asyncio.wait_for around a call, task.cancel())
            self._abandon(msg)
            raise
        finally:
            self._pending.pop(req, None)
        return self._raise_if_error(reply)

    def _on_reply(self, frames: list) -> None:
        try:
            msg = p.decode(frames)
        except KvdError as exc:
            log.warning("undecodable reply from the daemon: %s", exc)
            return
        req = getattr(msg, "req", 0)
        fut = self._pending.pop(req, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)
        elif req in self._streams:
            self._streams[req].put_nowait(msg)
        elif self._stream_notice(msg):
            pass
        elif isinstance(msg, p.Error) and req == 0:  # the daemon says why it closes this connection
            self._on_lost(error_from_code(msg.code, msg.message, remote=msg.origin))
        elif isinstance(msg, p.Error):
            self._abandoned.pop(req, None)
            log.warning("daemon reported: %s", msg.message)
        else:  # the reply to a request given up on: give back what it holds
            give_back = self._late_reply(msg)
            if give_back is not None:
                self._send_nowait(give_back)

    def _on_lost(self, error: KvdError) -> None:
        """The daemon closed the connection: every request waiting on it fails now."""
        if self._lost is None:
            self._lost = error
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(error)
        self._pending.clear()
        for queue in self._streams.values():
            queue.put_nowait(error)

    async def connect(self) -> None:
        """Connect and map the pool. Every operation calls it; explicit use is optional."""
        if not self._forked() and self._pool is not None and self._lost is None:
            return
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._pool is not None and self._lost is None:
                return
            self._close_transport()  # a lost connection: the daemon restarted? map its new pool
            self._lost = None
            self._check_endpoint()
            self._sock = await StreamConnection.open(self.endpoint, self._on_reply, self._on_lost,
                                                     self.connect_timeout)
            try:
                await self._drive(self._hello())
            except KvdError as exc:
                self._close_transport()
                if not isinstance(exc, ProtocolError) and exc.remote is None:  # (dropped before an answer)
                    wrong = await asyncio.get_running_loop().run_in_executor(None, peer_port_error, self.endpoint)
                    if wrong is not None:
                        raise wrong from None
                raise
            except BaseException:
                self._close_transport()
                raise

    async def put(self, request_id: str, kv: Mapping[str, Any], *, dest: str | None = None,
                  ttl: float | None = None, meta: dict | None = None) -> None:
        """See Client.put."""
        await self.connect()
        await self._drive(self._put(request_id, kv, dest, ttl, meta))

    async def get(self, request_id: str, *, source: str | None = None, timeout: float = 30.0,
                  out: Mapping[str, torch.Tensor] | None = None, keep: bool = False, with_meta: bool = False):
        """See Client.get."""
        await self.connect()
        return await self._drive(self._get(request_id, source, timeout, out, keep, with_meta))

    async def put_stream(self, request_id: str, layout: Mapping[str, Any], *, dest: str | None = None,
                         ttl: float | None = None, meta: dict | None = None) -> AsyncPutStream:
        """See Client.put_stream; use as `async with await c.put_stream(...) as s: await s.write(...)`."""
        await self.connect()
        state = StreamState(request_id, specs_from(layout), dest)
        await self._drive(open_stream(self, state, ttl, meta))
        return AsyncPutStream(self, state)

    async def get_stream(self, request_id: str, *, source: str | None = None, timeout: float = 30.0,
                         out: Mapping[str, torch.Tensor] | None = None, keep: bool = False):
        """See Client.get_stream; an async iterator of {name: tensor} groups."""
        await self.connect()
        steps = self._steps(read_stream(self, request_id, timeout, out, keep, source))
        try:
            async for kind, value in steps:
                if kind == "emit":
                    yield value
        finally:
            await steps.aclose()

    async def put_blocks(self, request_id: str, caches: Mapping[str, torch.Tensor], block_ids, *,
                         dest: str | None = None, ttl: float | None = None, meta: dict | None = None) -> None:
        """See Client.put_blocks."""
        await self.connect()
        await self._drive(put_blocks(self, request_id, caches, block_ids, dest, ttl, meta))

    async def get_blocks(self, request_id: str, caches: Mapping[str, torch.Tensor], block_ids, *,
                         source: str | None = None, timeout: float = 30.0, keep: bool = False) -> None:
        """See Client.get_blocks."""
        await self.connect()
        await self._drive(get_blocks(self, request_id, caches, block_ids, source, timeout, keep))

    async def delete(self, request_id: str) -> bool:
        await self.connect()
        return bool(await self._drive(self._simple(p.Delete(req=next(self._reqs), request_id=request_id))))

    async def cache_put(self, keys: Sequence[str], pages: Sequence[torch.Tensor | Parts], *,
                        namespace: str = "") -> list[bool]:
        """Store pages in the daemon's KV tier under (namespace, keys[i]): see `Client.cache_put`."""
        await self.connect()
        return await self._drive(cache_put(self, keys, pages, namespace))

    async def cache_get(self, keys: Sequence[str], outs: Sequence[torch.Tensor | Parts], *,
                        namespace: str = "") -> list[bool]:
        """Fill outs[i] from the KV tier: see `Client.cache_get`."""
        await self.connect()
        return await self._drive(cache_get(self, keys, outs, namespace))

    async def cache_exists(self, keys: Sequence[str], *, namespace: str = "") -> int:
        """How many keys, from the first, the KV tier holds."""
        await self.connect()
        return await self._drive(cache_exists(self, keys, namespace))

    async def cache_clear(self, namespace: str = "") -> int:
        """Drop a namespace's pages; returns how many went."""
        await self.connect()
        return await self._drive(self._simple(p.CacheClear(req=next(self._reqs), namespace=namespace)))

    async def cache_events(self, namespace: str, *, epoch: int = 0, since: int = 0) -> dict:
        """The namespace's pages stored and removed since (epoch, since): see `Client.cache_events`."""
        await self.connect()
        return await self._drive(self._simple(p.CacheEvents(req=next(self._reqs), namespace=namespace, epoch=epoch,
                                                            since=since)))

    async def cache_stats(self, namespace: str | None = None) -> dict:
        """The KV tier's counters (hits, misses, evictions, entries, bytes, budget, ...)."""
        await self.connect()
        return await self._drive(self._simple(p.CacheStats(req=next(self._reqs), namespace=namespace)))

    async def stats(self) -> dict:
        await self.connect()
        return await self._drive(self._simple(p.Stats(req=next(self._reqs))))

    async def list(self) -> list[dict]:
        await self.connect()
        return await self._drive(self._list())

    async def close(self) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(KvdError("client closed"))
        self._pending.clear()
        self._close_transport()

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()


class AsyncPutStream:
    """A cache being written tensor by tensor from asyncio; see Client.put_stream."""

    def __init__(self, client: AsyncClient, state: StreamState) -> None:
        self._client, self._state = client, state

    async def write(self, kv: Mapping[str, Any]) -> None:
        await self._client._drive(write_stream(self._client, self._state, kv))

    async def commit(self) -> None:
        await self._client._drive(commit_stream(self._client, self._state))

    async def abort(self) -> None:
        await self._client._drive(abort_stream(self._client, self._state))

    async def __aenter__(self) -> AsyncPutStream:
        return self

    async def __aexit__(self, exc_type, *rest: Any) -> None:
        if exc_type is None:
            await self.commit()
        else:
            await self.abort()
