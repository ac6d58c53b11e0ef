"""The client library: `AsyncClient` is the implementation, `Client` its synchronous face.

Only control messages go over the daemon's socket; tensor bytes are copied by this
process straight into (put) or out of (get) the daemon's shared pool, mapped once at
connect. A put is: reserve slots -> copy -> commit. A get is: lease slots -> copy ->
release (fire and forget, so a get costs one round trip).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
from typing import Any, Mapping

import torch
import zmq
import zmq.asyncio

from . import protocol as p
from .config import default_socket
from .device import map_pool
from .errors import BadRequest, KvdError, ProtocolError, Timeout, error_from_code
from .layout import TensorSpec
from .tensors import as_tensor, check_out, copy_in, copy_out, spec_of

log = logging.getLogger(__name__)

# how long past an operation's own timeout we wait for the daemon before calling it dead
REPLY_GRACE = 30.0


class AsyncClient:
    """Talks to the local kvd daemon. Safe for concurrent use by tasks of one event loop."""

    def __init__(self, socket: str | None = None, *, reply_timeout: float = REPLY_GRACE) -> None:
        self.endpoint = socket or default_socket()
        self.reply_timeout = reply_timeout
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._reqs = itertools.count(1)
        self._reader: asyncio.Task | None = None
        self._connecting: asyncio.Lock | None = None
        self._mapping = None
        self._pool: torch.Tensor | None = None
        self.node_id: str | None = None
        self.info: p.HelloOk | None = None

    # --- connection ---------------------------------------------------------------------------

    async def connect(self) -> None:
        """Connect and map the pool. Called by every operation; explicit use is optional."""
        if self._pool is not None:
            return
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._pool is not None:
                return
            if self.endpoint.startswith("ipc://") and not os.path.exists(self.endpoint[len("ipc://"):]):
                raise KvdError(f"no kvd daemon at {self.endpoint} (start one with `kvd serve`)")
            self._ctx = zmq.asyncio.Context()
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.endpoint)
            self._reader = asyncio.get_running_loop().create_task(self._read())
            hello = await self._call(p.Hello(req=next(self._reqs), client=f"pid-{os.getpid()}"), 10.0)
            if not isinstance(hello, p.HelloOk):
                raise ProtocolError(f"expected hello_ok, got {hello.TYPE}")
            try:
                self._mapping, _ = map_pool(hello.pool_path, hello.pool_size)
            except OSError as exc:
                raise KvdError(
                    f"cannot map the daemon's pool at {hello.pool_path}: {exc} "
                    "(client and daemon must run as the same user, with a shared PID namespace "
                    "or a shared --pool-path)"
                ) from None
            self._pool = torch.frombuffer(self._mapping, dtype=torch.uint8)
            self.info, self.node_id = hello, hello.node_id

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
            self._reader = None
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(KvdError("client closed"))
        self._pending.clear()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self._pool = None
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:
                pass  # a tensor view still references it; it goes with the process
            self._mapping = None

    async def __aenter__(self) -> "AsyncClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                msg = p.decode(frames)
            except KvdError as exc:
                log.warning("undecodable reply from the daemon: %s", exc)
                continue
            fut = self._pending.pop(getattr(msg, "req", 0), None)
            if fut is None:
                if isinstance(msg, p.Error):
                    log.warning("daemon reported: %s", msg.message)
                continue
            if not fut.done():
                fut.set_result(msg)

    def _send(self, msg: p.Message) -> None:
        self._sock.send_multipart(p.encode(msg))

    async def _call(self, msg: p.Message, wait: float) -> p.Message:
        """Send a request, wait up to `wait` + reply_timeout for its reply; Error replies raise."""
        fut = asyncio.get_running_loop().create_future()
        self._pending[msg.req] = fut
        await self._sock.send_multipart(p.encode(msg))
        try:
            reply = await asyncio.wait_for(fut, wait + self.reply_timeout)
        except asyncio.TimeoutError:
            raise Timeout(f"daemon at {self.endpoint} did not answer {msg.TYPE} in time") from None
        finally:
            self._pending.pop(msg.req, None)
        if isinstance(reply, p.Error):
            raise error_from_code(reply.code, reply.message, remote=reply.origin)
        return reply

    # --- the API --------------------------------------------------------------------------------

    async def put(self, request_id: str, kv: Mapping[str, Any], *, dest: str | None = None,
                  ttl: float | None = None, meta: dict | None = None) -> None:
        """Hand off a request's KV cache.

        Without dest, returns once the local daemon holds the bytes; with dest (a peer name or
        tcp:// endpoint), once that peer has verified and stored them. The caller keeps
        ownership of its tensors; kvd copies them once, into the shared pool.
        """
        await self.connect()
        if not isinstance(kv, Mapping) or not kv:
            raise BadRequest("kv must be a non-empty mapping of name -> tensor")
        tensors = {name: as_tensor(name, value) for name, value in kv.items()}
        specs = [spec_of(name, t) for name, t in tensors.items()]
        slots = await self._call(p.PutAlloc(req=next(self._reqs), request_id=request_id,
                                            tensors=[s.to_wire() for s in specs], ttl=ttl, meta=meta), 0)
        committed = False
        try:
            for tensor, segments in zip(tensors.values(), slots.segments):
                copy_in(self._pool, tensor, segments)
            commit = p.PutCommit(req=next(self._reqs), request_id=request_id, token=slots.token, dest=dest)
            committed = True
            await self._call(commit, 3600.0 if dest else 0)
        except BaseException:
            if not committed:  # free the reservation now rather than at lease expiry
                self._send(p.Delete(req=next(self._reqs), request_id=request_id))
            raise

    async def get(self, request_id: str, *, source: str | None = None, timeout: float = 30.0,
                  out: Mapping[str, torch.Tensor] | None = None, keep: bool = False) -> dict[str, torch.Tensor]:
        """Fetch a request's KV cache, waiting up to `timeout` seconds for it to arrive.

        With source (a peer name or tcp:// endpoint), the local daemon pulls it from there.
        With out, bytes land in those tensors (same dtype and shape); other names get new
        tensors. The entry is released after a successful get unless keep=True.
        """
        await self.connect()
        slots = await self._call(p.Get(req=next(self._reqs), request_id=request_id, timeout=float(timeout),
                                       source=source, keep=keep), float(timeout))
        consume = not keep
        try:
            specs = [TensorSpec.from_wire(t) for t in slots.tensors]
            out = out or {}
            unknown = set(out) - {s.name for s in specs}
            if unknown:
                raise BadRequest(f"out names tensors the cache does not hold: {sorted(unknown)}")
            for spec in specs:
                if spec.name in out:
                    check_out(spec, out[spec.name])
            result = {
                spec.name: copy_out(self._pool, spec, segments, out.get(spec.name))
                for spec, segments in zip(specs, slots.segments)
            }
        except BaseException:
            consume = False  # give the entry back: nothing was delivered
            raise
        finally:
            self._send(p.GetDone(req=next(self._reqs), request_id=request_id, token=slots.token,
                                 consume=consume, reply=False))
        return result

    async def delete(self, request_id: str) -> bool:
        """Drop a request's cache; True if it was held."""
        await self.connect()
        reply = await self._call(p.Delete(req=next(self._reqs), request_id=request_id), 0)
        return bool(reply.value)

    async def stats(self) -> dict:
        await self.connect()
        return (await self._call(p.Stats(req=next(self._reqs)), 0)).value

    async def list(self) -> list[dict]:
        await self.connect()
        return (await self._call(p.ListEntries(req=next(self._reqs)), 0)).value


class Client:
    """Synchronous face of AsyncClient: each call runs on a private event loop, in the caller's
    thread (no thread hop on the hot path). Calls from several threads are serialized."""

    def __init__(self, socket: str | None = None, **kwargs: Any) -> None:
        import uvloop

        self._loop = uvloop.new_event_loop()
        self._lock = threading.Lock()
        self._async = AsyncClient(socket, **kwargs)

    def _run(self, coro):
        with self._lock:
            return self._loop.run_until_complete(coro)

    @property
    def node_id(self) -> str | None:
        return self._async.node_id

    def connect(self) -> "Client":
        self._run(self._async.connect())
        return self

    def put(self, request_id: str, kv: Mapping[str, Any], *, dest: str | None = None,
            ttl: float | None = None, meta: dict | None = None) -> None:
        self._run(self._async.put(request_id, kv, dest=dest, ttl=ttl, meta=meta))

    def get(self, request_id: str, *, source: str | None = None, timeout: float = 30.0,
            out: Mapping[str, torch.Tensor] | None = None, keep: bool = False) -> dict[str, torch.Tensor]:
        return self._run(self._async.get(request_id, source=source, timeout=timeout, out=out, keep=keep))

    def delete(self, request_id: str) -> bool:
        return self._run(self._async.delete(request_id))

    def stats(self) -> dict:
        return self._run(self._async.stats())

    def list(self) -> list[dict]:
        return self._run(self._async.list())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._async.close())
        self._loop.close()

    def __enter__(self) -> "Client":
        return self.connect()

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._loop.is_closed() and not self._loop.is_running():
                self.close()
        except Exception:
            pass
