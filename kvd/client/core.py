"""What both client faces share (worker process): the operations, request ids, the mapped pool.

Each operation (`_put`, `_get`, ...) is written once, as an I/O-free generator (`ops.py`);
`Client` (`sync.py`) and `AsyncClient` (`aio.py`) drive it. Only control messages cross the
socket to the daemon; tensor bytes are copied by this process straight into (put) or out of
(get) the daemon's shared pool, mapped once at connect. The safety checks live here: an
operation never copies into a pool mapped after it began (a restarted daemon's), nor into a
parent's connection after fork(), and late replies to abandoned requests give back what they hold.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import mmap
import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import msgpack
import torch

from kvd.errors import BadRequest, KvdError, error_from_code
from kvd.memory.host import map_pool
from kvd.wire import protocol as p
from kvd.wire.endpoints import default_socket, unix_path
from kvd.wire.layout import (
    Extent,
    Segment,
    TensorSpec,
    blocks_needed,
    physical_segments,
    tensor_offsets,
    validate_specs,
)

from .cache import give_back
from .ops import NO_REPLY, WAIT_FOREVER, Emit, Operation, Receive, StreamClosed, reply_as, req_of
from .streaming import StreamState
from .tensors import as_tensor, check_out, copy_in, copy_out, spec_of

log = logging.getLogger(__name__)

# how long past an operation's own timeout we wait for the daemon before calling it dead
REPLY_GRACE = 30.0
CONNECT_TIMEOUT = 10.0  # how long the first hello may take (beyond reply_timeout)
MAX_ABANDONED = 1024  # abandoned requests remembered, waiting for their replies
# longest silence inside a stream being read: the daemon reports a stalled peer long before
STREAM_SILENCE = 600.0


class ConnectionLost(KvdError):
    """The daemon connection an operation started on is gone (a reconnect maps a new pool)."""


class _Transport(Protocol):
    """What the core closes of a face's connection (kvd.client.connection)."""

    def close(self) -> None: ...


class _ClientCore:
    """What both faces share: the operations, request ids, and the mapped pool."""

    def __init__(self, socket: str | None, reply_timeout: float, connect_timeout: float = CONNECT_TIMEOUT) -> None:
        self.endpoint = socket or default_socket()
        self.reply_timeout = reply_timeout
        self.connect_timeout = connect_timeout
        self._reqs = itertools.count(1)
        self._mapping: mmap.mmap | None = None
        self._pool: torch.Tensor | None = None
        self.info: p.HelloOk | None = None
        self._sock: _Transport | None = None  # the connection (kvd.client.connection)
        self._ipc_close: Callable[[], None] | None = None  # closes a CUDA IPC mapping
        # blocks the daemon lent this connection for its next small puts: (token, extents, blocks)
        # each, one per put in flight (a put takes one out while it writes)
        self._scratch: list[tuple[int, list[Extent], int]] = []
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
        state = self._writes.get(msg.req) if isinstance(msg, p.Error) else None
        if state is None or not isinstance(msg, p.Error):
            return False
        state.failed = error_from_code(msg.code, msg.message, remote=msg.origin)
        return True

    def _read_notices(self) -> None:
        """Take in what the daemon sent unasked before a stream writes (Client: a non-blocking
        read; AsyncClient's loop takes messages in as they come)."""

    def _abandon(self, msg: p.Message) -> None:
        self._abandoned[req_of(msg)] = msg
        if len(self._abandoned) > MAX_ABANDONED:  # replies that never came (the connection ended)
            self._abandoned.popitem(last=False)

    def _late_reply(self, reply: p.Message) -> p.Message | None:
        """A reply to an abandoned request: keep what is useful, return the message that gives
        back what it holds (sent without a reply), if any."""
        request = self._abandoned.pop(req_of(reply), None)
        if isinstance(reply, p.PutOk):
            self._keep_scratch(reply)  # its put is over, and the blocks lent with it are ours to use
        if request is None:
            return None
        if isinstance(reply, p.GetSlots) and isinstance(request, (p.Get, p.GetStream)):
            return p.GetDone(req=next(self._reqs), request_id=request.request_id, token=reply.token,
                             consume=False, reply=False)
        if isinstance(reply, p.PutSlots) and isinstance(request, p.PutAlloc):  # a reservation nobody will write
            return p.Delete(req=next(self._reqs), request_id=request.request_id, token=reply.token)
        if isinstance(reply, p.CacheSlots):  # tier room nobody will write, or pins nobody reads
            return give_back(request, reply, next(self._reqs))
        return None

    def _pool_of(self, generation: int) -> torch.Tensor:
        """The mapped pool, if it is still that of the connection an operation started on."""
        pool = self._pool
        if pool is None or not self._same_connection(generation):
            raise ConnectionLost("the connection to the daemon was lost during this operation (did the daemon "
                                 "restart?): nothing more was copied; start it over")
        return pool

    def _same_connection(self, generation: int) -> bool:
        # (in a fork()ed child, whatever the parent opened is the parent's)
        return generation == self._generation and self._pool is not None and os.getpid() == self._pid

    def _forked(self) -> bool:
        """True in a child process that inherited this client: forget the parent's connection
        (without closing it under the parent), its loan and its mapping; connect anew."""
        if os.getpid() == self._pid:
            return False
        self._pid = os.getpid()
        self._sock, self._scratch, self._pool, self._mapping, self._ipc_close = None, [], None, None, None
        self.info = None
        return True

    def _hello_ok(self) -> p.HelloOk:
        """What the daemon said as this connection opened (its pool and block size)."""
        if self.info is None:
            raise ConnectionLost(f"not connected to the kvd daemon at {self.endpoint}")
        return self.info

    @property
    def node_id(self) -> str | None:
        return self.info.node_id if self.info else None

    def _check_endpoint(self) -> None:
        path = unix_path(self.endpoint)
        if path is not None and not os.path.exists(path):
            raise KvdError(f"no kvd daemon at {self.endpoint} (start one with `kvd serve`)")

    # --- checks before anything is sent: what the daemon could not decode would come back as a
    # ProtocolError (and a warning in its log), what msgpack cannot encode as a bare TypeError

    @staticmethod
    def _check_request_id(request_id: Any) -> None:
        """A str, not empty (the daemon checks the rest, such as its length)."""
        if not isinstance(request_id, str) or not request_id:
            got = "an empty str" if isinstance(request_id, str) else type(request_id).__name__
            raise BadRequest(f"a request id must be a non-empty str, got {got}")

    @staticmethod
    def _check_meta(meta: Any) -> None:
        """None, or a dict that goes through msgpack both ways within the limits the daemon decodes with."""
        if meta is None:
            return
        if not isinstance(meta, dict):
            raise BadRequest(f"meta must be a dict or None, got {type(meta).__name__}")
        try:
            packed = msgpack.packb(meta, use_bin_type=True)
            msgpack.unpackb(packed, raw=False, strict_map_key=True, **p.UNPACK_LIMITS)
        except Exception as exc:  # msgpack raises TypeError, ValueError, OverflowError and its own
            raise BadRequest(f"meta cannot be sent: {exc} (msgpack only: dicts with str keys, lists, str, "
                             f"int, float, bool, None, bytes up to {p.UNPACK_LIMITS['max_bin_len']})") from None

    def _raise_if_error(self, reply: p.Message) -> p.Message:
        if isinstance(reply, p.Error):
            raise error_from_code(reply.code, reply.message, remote=reply.origin)
        return reply

    # --- operations (no I/O) -------------------------------------------------------------------

    def _hello(self) -> Operation:
        hello = reply_as(p.HelloOk, (yield p.Hello(req=next(self._reqs), client=f"pid-{os.getpid()}"),
                                     self.connect_timeout))
        if hello.pool_handle is not None:  # a GPU pool: map it by CUDA IPC, copy device to device
            from kvd.memory.cuda import open_ipc_pool

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
            for tensor, tensor_segments in zip(tensors.values(), segments, strict=True):
                copy_in(pool, tensor, tensor_segments)

        yield from self._put_with(request_id, [spec_of(name, t) for name, t in tensors.items()], write,
                                  dest, ttl, meta)

    def _put_with(self, request_id: str, specs: list[TensorSpec], write: Callable[[list[list[Segment]]], None],
                  dest: str | None, ttl: float | None, meta: dict | None) -> Operation:
        """A put whose bytes `write(segments of each tensor)` copies into the pool: into the
        blocks lent after the last put when it fits (one round trip), else reserve, write, commit."""
        self._check_request_id(request_id)
        self._check_meta(meta)
        validate_specs(specs)  # (here: past the limit, the header itself would be refused as too big)
        wire_specs = [s.to_wire() for s in specs]
        wait = WAIT_FOREVER if dest else 0.0
        offsets, total = tensor_offsets(specs)
        block_size = self._hello_ok().block_size
        scratch = self._take_scratch(blocks_needed(total, block_size))
        if scratch is not None:  # taken: no other operation writes into it now
            token, extents, _ = scratch
            try:
                write([physical_segments(extents, block_size, offset, spec.nbytes)
                       for spec, offset in zip(specs, offsets, strict=True)])
                self._sync_device()
            except BaseException:
                self._scratch.append(scratch)  # still ours, and nobody else's bytes are in it
                raise
            reply = yield p.Put(req=next(self._reqs), request_id=request_id, tensors=wire_specs, scratch=token,
                                ttl=ttl, meta=meta, dest=dest), wait
        else:
            # every loan is too small for this put (or in use): the biggest goes back, so that the
            # reply may lend one this size within the daemon's bound per connection
            small = self._take_scratch(0, biggest=True)
            slots = reply_as(p.PutSlots, (yield p.PutAlloc(req=next(self._reqs), request_id=request_id,
                                                           tensors=wire_specs, ttl=ttl, meta=meta,
                                                           give_back=small[0] if small else None), 0.0))
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

    def _take_scratch(self, blocks: int, biggest: bool = False) -> tuple[int, list[Extent], int] | None:
        """The smallest (or biggest) loan of at least `blocks` blocks, taken out of the list;
        None if there is none."""
        fits = [i for i, loan in enumerate(self._scratch) if loan[2] >= blocks]
        if not fits:
            return None
        return self._scratch.pop((max if biggest else min)(fits, key=lambda i: self._scratch[i][2]))

    def _keep_scratch(self, reply: p.Message | None) -> None:
        """Remember blocks the daemon lent for a next put (checked: they must lie in the pool)."""
        if not isinstance(reply, p.PutOk) or reply.scratch is None:
            return
        try:
            extents = [(int(first), int(count)) for first, count in reply.extents]
        except (TypeError, ValueError):
            return
        info = self._hello_ok()
        pool_blocks = info.pool_size // info.block_size
        if all(first >= 0 and count > 0 and first + count <= pool_blocks for first, count in extents):
            self._scratch.append((reply.scratch, extents, sum(count for _, count in extents)))

    def _get(self, request_id: str, source: str | None, timeout: float, out: Mapping[str, torch.Tensor] | None,
             keep: bool, with_meta: bool = False) -> Operation:
        self._check_request_id(request_id)
        generation = self._generation
        slots = reply_as(p.GetSlots, (yield p.Get(req=next(self._reqs), request_id=request_id,
                                                  timeout=float(timeout), source=source, keep=keep), float(timeout)))
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
                for spec, segments in zip(specs, slots.segments, strict=True)
            }
            self._sync_device()
        except BaseException:
            consume = False  # give the entry back: nothing was delivered
            raise
        finally:
            yield p.GetDone(req=next(self._reqs), request_id=request_id, token=slots.token,
                            consume=consume, reply=False), NO_REPLY
        return (result, slots.meta) if with_meta else result

    def _list(self) -> Operation:
        """Every entry, a page at a time (the daemon answers at most LIST_PAGE per request)."""
        entries: list[dict] = []
        after = None
        while True:
            reply = reply_as(p.Ok, (yield p.ListEntries(req=next(self._reqs), after=after, limit=p.LIST_PAGE), 0.0))
            entries += reply.value
            after = p.next_page_after(reply.value, after)
            if after is None:
                return entries

    def _simple(self, msg: p.Message) -> Operation:
        if hasattr(msg, "request_id"):  # (delete)
            self._check_request_id(msg.request_id)
        reply = reply_as(p.Ok, (yield msg, 0.0))
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
        self._scratch = []  # lent to that connection; the daemon takes them back
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
            with contextlib.suppress(BufferError):  # a tensor view still references it; it goes with the process
                self._mapping.close()
            self._mapping = None
