"""The client library: one implementation of each operation, driven two ways.

Each operation (`_put`, `_get`, ...) is written once, as a generator that yields the
requests it needs answered and receives the replies: no I/O inside. `AsyncClient`
(kvd.async_client) drives it on the event loop (many concurrent operations per connection); `Client` drives it over
a blocking socket in the caller's thread (no event loop, no thread hop: the lowest
latency for the common synchronous worker). Only control messages cross the socket (a unix
socket, `kvd.localsock`); tensor bytes are copied by this process straight into (put) or out
of (get) the daemon's shared pool, mapped once at connect.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
from typing import Any, Callable, Generator, Mapping

import torch

from . import protocol as p
from .config import default_socket
from .device import map_pool
from .errors import BadRequest, KvdError, ProtocolError, Timeout, error_from_code
from .layout import Extent, Segment, TensorSpec, blocks_needed, physical_segments, tensor_offsets
from .localsock import BlockingConnection, unix_path
from .paged import get_blocks, put_blocks
from .streaming import (
    Emit, Receive, StreamState, abort_stream, commit_stream, open_stream, read_stream, specs_from, write_stream,
)
from .tensors import as_tensor, check_out, copy_in, copy_out, spec_of

log = logging.getLogger(__name__)

# how long past an operation's own timeout we wait for the daemon before calling it dead
REPLY_GRACE = 30.0
CONNECT_TIMEOUT = 10.0  # how long the first hello may take (beyond reply_timeout)
# longest silence inside a stream being read: the daemon reports a stalled peer long before
MAX_ABANDONED = 1024  # abandoned requests remembered, waiting for their replies
STREAM_SILENCE = 600.0
NO_REPLY = None  # yield (msg, NO_REPLY): send and do not wait


class StreamClosed(Exception):
    """Thrown into a reading operation when its caller stops iterating early."""

# an operation yields (request, seconds to wait for the reply or NO_REPLY) and gets the reply back
Operation = Generator[tuple[p.Message, float | None], p.Message | None, Any]


class ConnectionLost(KvdError):
    """The daemon connection an operation started on is gone (a reconnect maps a new pool)."""


class _ClientCore:
    """What both faces share: the operations, request ids, and the mapped pool."""

    def __init__(self, socket: str | None, reply_timeout: float, connect_timeout: float = CONNECT_TIMEOUT) -> None:
        self.endpoint = socket or default_socket()
        self.reply_timeout = reply_timeout
        self.connect_timeout = connect_timeout
        self._reqs = itertools.count(1)
        self._mapping = None
        self._pool: torch.Tensor | None = None
        self.info: p.HelloOk | None = None
        self._sock = None  # the connection (kvd.localsock)
        self._ipc_close = None  # closes a CUDA IPC mapping
        # blocks the daemon lent this connection for the next small put: (token, extents, blocks)
        self._scratch: tuple[int, list[Extent], int] | None = None
        self.transfer_wait = STREAM_SILENCE
        # which connection (and pool mapping) this is: offsets the daemon gave on one are
        # meaningless on the next, so every copy checks that it is still the same one
        self._generation = 0
        self._pid = os.getpid()  # a client inherited across fork() must not use its parent's connection
        # requests given up on (cancelled, interrupted) whose reply may still come: what it holds
        # for us (a read lease, a reservation, lent blocks) is given back when it does
        self._abandoned: collections.OrderedDict[int, p.Message] = collections.OrderedDict()
        # open put streams by their put_alloc's req: an error on that req says the daemon ended it
        self._writes: dict[int, StreamState] = {}

    def _stream_notice(self, msg: p.Message) -> bool:
        """An error about an open stream (its lease ran out, it was deleted, its push failed):
        kept for the stream's next write, which raises it. True if msg was one."""
        state = self._writes.get(getattr(msg, "req", None)) if isinstance(msg, p.Error) else None
        if state is None:
            return False
        state.failed = error_from_code(msg.code, msg.message, remote=msg.origin)
        return True

    def _read_notices(self) -> None:
        """Take in what the daemon sent unasked before a stream writes (Client: a non-blocking
        read; AsyncClient's loop takes messages in as they come)."""

    def _abandon(self, msg: p.Message) -> None:
        self._abandoned[msg.req] = msg
        if len(self._abandoned) > MAX_ABANDONED:  # replies that never came (the connection ended)
            self._abandoned.popitem(last=False)

    def _late_reply(self, reply: p.Message) -> p.Message | None:
        """A reply to an abandoned request: keep what is useful, return the message that gives
        back what it holds (sent without a reply), if any."""
        request = self._abandoned.pop(getattr(reply, "req", None), None)
        if isinstance(reply, p.PutOk):
            self._keep_scratch(reply)  # its put is over, and the blocks lent with it are ours to use
        if request is None:
            return None
        if isinstance(reply, p.GetSlots):
            return p.GetDone(req=next(self._reqs), request_id=request.request_id, token=reply.token,
                             consume=False, reply=False)
        if isinstance(reply, p.PutSlots):  # a reservation nobody will write
            return p.Delete(req=next(self._reqs), request_id=request.request_id, token=reply.token)
        return None

    def _pool_of(self, generation: int) -> torch.Tensor:
        """The mapped pool, if it is still that of the connection an operation started on."""
        if not self._same_connection(generation):
            raise ConnectionLost("the connection to the daemon was lost during this operation (did the daemon "
                                 "restart?): nothing more was copied; start it over")
        return self._pool

    def _same_connection(self, generation: int) -> bool:
        # (in a fork()ed child, whatever the parent opened is the parent's)
        return generation == self._generation and self._pool is not None and os.getpid() == self._pid

    def _forked(self) -> bool:
        """True in a child process that inherited this client: forget the parent's connection
        (without closing it under the parent), its loan and its mapping; connect anew."""
        if os.getpid() == self._pid:
            return False
        self._pid = os.getpid()
        self._sock, self._scratch, self._pool, self._mapping, self._ipc_close = None, None, None, None, None
        self.info = None
        return True

    @property
    def node_id(self) -> str | None:
        return self.info.node_id if self.info else None

    def _check_endpoint(self) -> None:
        path = unix_path(self.endpoint)
        if path is not None and not os.path.exists(path):
            raise KvdError(f"no kvd daemon at {self.endpoint} (start one with `kvd serve`)")

    def _connected(self) -> bool:
        """Connected to a live daemon; a lost connection is closed here, so the caller reconnects."""
        if self._forked() or self._pool is None:
            return False
        if self._sock is None or not self._sock.alive():
            self._close_transport()  # the daemon went away (restarted?): map its new pool
            return False
        return True

    def _raise_if_error(self, reply: p.Message) -> p.Message:
        if isinstance(reply, p.Error):
            raise error_from_code(reply.code, reply.message, remote=reply.origin)
        return reply

    # --- operations (no I/O) -------------------------------------------------------------------

    def _hello(self) -> Operation:
        hello = yield p.Hello(req=next(self._reqs), client=f"pid-{os.getpid()}"), self.connect_timeout
        if not isinstance(hello, p.HelloOk):
            raise ProtocolError(f"expected hello_ok, got {hello.TYPE}")
        if hello.pool_handle is not None:  # a GPU pool: map it by CUDA IPC, copy device to device
            from .cuda import open_ipc_pool

            self._pool, self._ipc_close = open_ipc_pool(hello.pool_handle, hello.pool_size, hello.device)
            self.info = hello
            self._generation += 1
            return
        try:
            self._mapping, _ = map_pool(hello.pool_path, hello.pool_size)
        except OSError as exc:
            raise KvdError(
                f"cannot map the daemon's pool at {hello.pool_path}: {exc} (client and daemon must run "
                "as the same user, with a shared PID namespace or a shared --pool-path)"
            ) from None
        self._pool = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self.info = hello
        self._generation += 1

    def _put(self, request_id: str, kv: Mapping[str, Any], dest: str | None, ttl: float | None,
             meta: dict | None) -> Operation:
        if not isinstance(kv, Mapping) or not kv:
            raise BadRequest("kv must be a non-empty mapping of name -> tensor")
        tensors = {name: as_tensor(name, value) for name, value in kv.items()}
        generation = self._generation

        def write(segments: list[list[Segment]]) -> None:
            pool = self._pool_of(generation)
            for tensor, tensor_segments in zip(tensors.values(), segments):
                copy_in(pool, tensor, tensor_segments)

        yield from self._put_with(request_id, [spec_of(name, t) for name, t in tensors.items()], write,
                                  dest, ttl, meta)

    def _put_with(self, request_id: str, specs: list[TensorSpec], write: Callable[[list[list[Segment]]], None],
                  dest: str | None, ttl: float | None, meta: dict | None) -> Operation:
        """A put whose bytes `write(segments of each tensor)` copies into the pool: into the
        blocks lent after the last put when it fits (one round trip), else reserve, write, commit."""
        wire_specs = [s.to_wire() for s in specs]
        wait = 3600.0 if dest else 0.0
        offsets, total = tensor_offsets(specs)
        scratch, self._scratch = self._scratch, None  # taken: no other operation writes into it now
        if scratch is not None and blocks_needed(total, self.info.block_size) <= scratch[2]:
            token, extents, _ = scratch
            try:
                write([physical_segments(extents, self.info.block_size, offset, spec.nbytes)
                       for spec, offset in zip(specs, offsets)])
                self._sync_device()
            except BaseException:
                self._scratch = scratch  # still ours, and nobody else's bytes are in it
                raise
            reply = yield p.Put(req=next(self._reqs), request_id=request_id, tensors=wire_specs, scratch=token,
                                ttl=ttl, meta=meta, dest=dest), wait
        else:
            # a loan too small for this put goes back: the reply may lend a bigger one
            slots = yield p.PutAlloc(req=next(self._reqs), request_id=request_id, tensors=wire_specs, ttl=ttl,
                                     meta=meta, give_back=scratch[0] if scratch else None), 0.0
            try:
                write(slots.segments)
                self._sync_device()
            except BaseException:
                # free the reservation now rather than at lease expiry
                yield p.Delete(req=next(self._reqs), request_id=request_id, token=slots.token), NO_REPLY
                raise
            reply = yield p.PutCommit(req=next(self._reqs), request_id=request_id, token=slots.token, dest=dest,
                                      lend=True), wait
        self._keep_scratch(reply)

    def _keep_scratch(self, reply: p.Message) -> None:
        """Remember blocks the daemon lent for the next put (checked: they must lie in the pool)."""
        if not isinstance(reply, p.PutOk) or reply.scratch is None:
            return  # (the daemon lends one loan per connection: a new one means any old one was used)
        try:
            extents = [(int(first), int(count)) for first, count in reply.extents]
        except (TypeError, ValueError):
            return
        pool_blocks = self.info.pool_size // self.info.block_size
        if all(0 <= first and 0 < count and first + count <= pool_blocks for first, count in extents):
            self._scratch = (reply.scratch, extents, sum(count for _, count in extents))

    def _get(self, request_id: str, source: str | None, timeout: float, out: Mapping[str, torch.Tensor] | None,
             keep: bool, with_meta: bool = False) -> Operation:
        generation = self._generation
        slots = yield p.Get(req=next(self._reqs), request_id=request_id, timeout=float(timeout),
                            source=source, keep=keep), float(timeout)
        consume = not keep
        try:
            pool = self._pool_of(generation)
            specs = [TensorSpec.from_wire(t) for t in slots.tensors]
            out = out or {}
            unknown = set(out) - {s.name for s in specs}
            if unknown:
                raise BadRequest(f"out names tensors the cache does not hold: {sorted(unknown)}")
            for spec in specs:
                if spec.name in out:
                    check_out(spec, out[spec.name])
            result = {
                spec.name: copy_out(pool, spec, segments, out.get(spec.name))
                for spec, segments in zip(specs, slots.segments)
            }
            self._sync_device()
        except BaseException:
            consume = False  # give the entry back: nothing was delivered
            raise
        finally:
            yield p.GetDone(req=next(self._reqs), request_id=request_id, token=slots.token,
                            consume=consume, reply=False), NO_REPLY
        return (result, slots.meta) if with_meta else result

    def _simple(self, msg: p.Message) -> Operation:
        reply = yield msg, 0.0
        return reply.value

    def _send_nowait(self, msg: p.Message) -> None:
        raise NotImplementedError

    def _unwind(self, op: Operation, exc: BaseException, reraise: bool) -> None:
        """Throw exc into the operation, send the clean-up messages it yields, re-raise.

        After ConnectionLost they are not sent: their tokens and request ids were the old
        daemon's, and on the new one they could name somebody else's."""
        try:
            step = op.throw(exc)
            while not isinstance(step, (Emit, Receive)) and step[1] is NO_REPLY:
                if not isinstance(exc, ConnectionLost):
                    self._send_nowait(step[0])
                step = op.send(None)
        except (StopIteration, StreamClosed):
            pass
        finally:
            op.close()
        if reraise:
            raise exc

    def _sync_device(self) -> None:
        """Wait for this process's copies into or out of the pool (GPU pools copy asynchronously)."""
        if self._pool is not None and self._pool.device.type == "cuda":
            torch.cuda.current_stream(self._pool.device).synchronize()

    def _close_transport(self) -> None:
        """Close the connection and the pool mapping."""
        self._scratch = None  # lent to that connection; the daemon takes it back
        self._writes.clear()  # (its streams fail at their next write: another connection's offsets)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._close_mapping()

    def _close_mapping(self) -> None:
        self._pool = None
        if self._ipc_close is not None:
            self._ipc_close()
            self._ipc_close = None
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:
                pass  # a tensor view still references it; it goes with the process
            self._mapping = None


class Client(_ClientCore):
    """Talks to the local kvd daemon from ordinary (synchronous) code.

    One operation at a time per Client (calls from several threads are serialized); use one
    Client per thread, or AsyncClient, for concurrency.
    """

    def __init__(self, socket: str | None = None, *, reply_timeout: float = REPLY_GRACE,
                 connect_timeout: float = CONNECT_TIMEOUT) -> None:
        super().__init__(socket, reply_timeout, connect_timeout)
        self._sock: BlockingConnection | None = None
        self._lock = threading.RLock()
        self._inbox: dict[int, collections.deque] = {}  # open get_stream req -> its messages read early

    def _steps(self, op: Operation):
        """Run an operation: do its I/O, yield what it emits, return its result."""
        reply = None
        streams: list[int] = []  # this operation's get_stream requests
        try:
            while True:
                try:
                    step = op.send(reply)
                except StopIteration as stop:
                    return stop.value
                reply = None
                if isinstance(step, Emit):
                    try:
                        yield step.value
                    except GeneratorExit:
                        self._unwind(op, StreamClosed("iteration stopped early"), reraise=False)
                        raise
                    continue
                try:
                    if isinstance(step, Receive):
                        reply = self._receive(step.req, step.wait)
                    else:
                        msg, wait = step
                        if wait is NO_REPLY:
                            self._send_nowait(msg)
                            continue
                        if isinstance(msg, p.GetStream):
                            # its later messages are kept for it when another call (in the loop
                            # over the stream, same thread) reads them off the socket first
                            self._inbox[msg.req] = collections.deque()
                            streams.append(msg.req)
                        reply = self._call(msg, wait)
                except BaseException as exc:
                    self._unwind(op, exc, reraise=True)
        finally:
            for req in streams:
                self._inbox.pop(req, None)

    def _send_nowait(self, msg: p.Message) -> None:
        if self._sock is None:
            return  # no connection (closed, or forked away): the daemon gives back what we held
        try:
            self._sock.send(p.encode(msg))
        except KvdError:
            pass  # clean-up only: a daemon that lost us gives back what we held by itself

    def _drive(self, op: Operation) -> Any:
        with self._lock:
            steps = self._steps(op)
            try:
                while True:
                    next(steps)
                    raise ProtocolError("this operation does not stream")
            except StopIteration as stop:
                return stop.value

    def _receive(self, req: int, wait: float, awaited: str = "a stream") -> p.Message:
        kept = self._inbox.get(req)
        if kept:
            return self._raise_if_error(kept.popleft())
        while True:
            frames = self._sock.receive(wait + self.reply_timeout)
            if frames is None:
                try:
                    self._reset_socket()
                except KvdError:
                    self._close_transport()  # the daemon is gone: the next call reconnects
                raise Timeout(f"daemon at {self.endpoint} went silent while we waited for {awaited}")
            try:
                reply = p.decode(frames)
            except KvdError as exc:
                log.warning("undecodable reply from the daemon: %s", exc)
                continue
            if getattr(reply, "req", None) == req:
                return self._raise_if_error(reply)
            self._route(reply)

    def _route(self, reply: p.Message) -> None:
        """A message that is not the reply awaited now."""
        if getattr(reply, "req", None) in self._inbox:  # a stream's, read by a call inside its loop
            self._inbox[reply.req].append(reply)
        elif not self._stream_notice(reply):
            give_back = self._late_reply(reply)  # a stale reply, to a request given up on
            if give_back is not None:
                self._send_nowait(give_back)

    def _read_notices(self) -> None:
        while self._sock is not None and (frames := self._sock.receive(0)) is not None:
            try:
                self._route(p.decode(frames))
            except KvdError as exc:
                log.warning("undecodable message from the daemon: %s", exc)

    def _call(self, msg: p.Message, wait: float) -> p.Message:
        self._sock.send(p.encode(msg))
        try:
            # skips stale replies to abandoned requests; a Timeout the daemon reports passes unchanged
            return self._receive(msg.req, wait, f"its answer to {msg.TYPE}")
        except (KeyboardInterrupt, SystemExit):  # interrupted while waiting: the reply comes later
            self._abandon(msg)
            raise

    def _reset_socket(self) -> None:
        """A fresh connection (after a timeout, late replies would otherwise still arrive); the
        daemon gives back what the old one held."""
        self._scratch = None
        if self._sock is not None:
            self._sock.close()
        self._sock = BlockingConnection(self.endpoint, self.connect_timeout)

    def connect(self) -> "Client":
        """Connect and map the pool. Every operation calls it; explicit use is optional."""
        with self._lock:
            if not self._connected():
                self._check_endpoint()
                self._reset_socket()
                try:
                    self._drive(self._hello())
                except BaseException:
                    self._close_transport()
                    raise
        return self

    def put(self, request_id: str, kv: Mapping[str, Any], *, dest: str | None = None,
            ttl: float | None = None, meta: dict | None = None) -> None:
        """Hand off a request's KV cache.

        Without dest, returns once the local daemon holds the bytes; with dest (a peer name or
        tcp:// endpoint), once that peer has verified and stored them. The caller keeps
        ownership of its tensors; kvd copies them once, into the shared pool.
        """
        self.connect()
        self._drive(self._put(request_id, kv, dest, ttl, meta))

    def get(self, request_id: str, *, source: str | None = None, timeout: float = 30.0,
            out: Mapping[str, torch.Tensor] | None = None, keep: bool = False, with_meta: bool = False):
        """Fetch a request's KV cache, waiting up to `timeout` seconds for it to arrive.

        With source (a peer name or tcp:// endpoint), the local daemon pulls it from there.
        With out, bytes land in those tensors (same dtype and shape); other names get new
        tensors. The entry is released after a successful get unless keep=True. With
        with_meta=True, returns (tensors, meta): the `meta` dict given to put (None if none).
        """
        self.connect()
        return self._drive(self._get(request_id, source, timeout, out, keep, with_meta))

    def put_stream(self, request_id: str, layout: Mapping[str, Any], *, dest: str | None = None,
                   ttl: float | None = None, meta: dict | None = None) -> "PutStream":
        """Open a cache to be written tensor by tensor (e.g. layer by layer during prefill).

        layout maps every tensor name to a tensor of the final shape and dtype (a 'meta' tensor
        will do) or a (shape, dtype) pair. Each `write` is copied into the pool at once and, with
        dest, sent to that peer while you compute the next layer. `commit` (or leaving the with
        block) returns when the peer has the whole cache; an exception aborts the stream.
        """
        self.connect()
        state = StreamState(request_id, specs_from(layout), dest)
        self._drive(open_stream(self, state, ttl, meta))
        return PutStream(self, state)

    def get_stream(self, request_id: str, *, source: str | None = None, timeout: float = 30.0,
                   out: Mapping[str, torch.Tensor] | None = None, keep: bool = False):
        """Iterate a cache as it arrives: yields {name: tensor} for each group of tensors that
        became complete, the first as soon as the entry appears here (within timeout). With
        source (a peer), the local daemon pulls it from there and each group is handed over as
        soon as its bytes have landed."""
        self.connect()
        with self._lock:
            yield from self._steps(read_stream(self, request_id, timeout, out, keep, source))

    def put_blocks(self, request_id: str, caches: Mapping[str, torch.Tensor], block_ids, *,
                   dest: str | None = None, ttl: float | None = None, meta: dict | None = None) -> None:
        """Hand off a request's blocks of paged caches: `caches` maps names to paged tensors
        [num_blocks, ...] (e.g. one per layer for K and V), `block_ids` the request's rows in them.
        Each tensor's rows are gathered into the pool by one index_select, written in place."""
        self.connect()
        self._drive(put_blocks(self, request_id, caches, block_ids, dest, ttl, meta))

    def get_blocks(self, request_id: str, caches: Mapping[str, torch.Tensor], block_ids, *,
                   source: str | None = None, timeout: float = 30.0, keep: bool = False) -> None:
        """Fetch a request's blocks into this worker's paged caches at `block_ids` (which may differ
        from the producer's): one index_copy_ per tensor, straight from the pool."""
        self.connect()
        self._drive(get_blocks(self, request_id, caches, block_ids, source, timeout, keep))

    def delete(self, request_id: str) -> bool:
        """Drop a request's cache; True if it was held."""
        self.connect()
        return bool(self._drive(self._simple(p.Delete(req=next(self._reqs), request_id=request_id))))

    def stats(self) -> dict:
        self.connect()
        return self._drive(self._simple(p.Stats(req=next(self._reqs))))

    def list(self) -> list[dict]:
        self.connect()
        return self._drive(self._simple(p.ListEntries(req=next(self._reqs))))

    def close(self) -> None:
        with self._lock:
            self._close_transport()

    def __del__(self) -> None:
        try:
            self._close_transport()
        except Exception:
            pass

    def __enter__(self) -> "Client":
        return self.connect()

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class PutStream:
    """A cache being written tensor by tensor; see Client.put_stream."""

    def __init__(self, client: Client, state: StreamState) -> None:
        self._client, self._state = client, state

    def write(self, kv: Mapping[str, Any]) -> None:
        """Copy these tensors into the pool and announce them (sent on to dest right away)."""
        self._client._drive(write_stream(self._client, self._state, kv))

    def commit(self) -> None:
        """Every tensor not yet written is taken as it is in the pool; returns when delivered."""
        self._client._drive(commit_stream(self._client, self._state))

    def abort(self) -> None:
        self._client._drive(abort_stream(self._client, self._state))

    def __enter__(self) -> "PutStream":
        return self

    def __exit__(self, exc_type, *rest: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
