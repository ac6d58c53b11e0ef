"""`Client`: the client library for ordinary (synchronous) code (worker process).

It drives the operations of `core.py` over a blocking unix socket in the calling thread: no
event loop, no thread hop, the lowest latency for the common synchronous worker.
"""
from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvd.errors import KvdError, ProtocolError, Timeout
from kvd.wire import protocol as p

from .blocks import get_blocks, put_blocks
from .cache import Parts, cache_exists, cache_get, cache_put
from .connection import BlockingConnection
from .core import CONNECT_TIMEOUT, REPLY_GRACE, ConnectionLost, _ClientCore, log
from .ops import NO_REPLY, Emit, Operation, Receive, StreamClosed, req_of
from .streaming import StreamState, abort_stream, commit_stream, open_stream, read_stream, specs_from, write_stream


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
        with contextlib.suppress(KvdError):  # clean-up only: a daemon that lost us gives back what we held by itself
            self._sock.send(p.encode(msg))

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
            frames = self._connection().receive(wait + self.reply_timeout)
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
            if type(reply) is p.Error and reply.req == 0:  # the daemon says why it closes this connection
                self._close_transport()  # (the next call connects again)
                self._raise_if_error(reply)
            self._route(reply)

    def _route(self, reply: p.Message) -> None:
        """A message that is not the reply awaited now."""
        if (req := req_of(reply)) in self._inbox:  # a stream's, read by a call inside its loop
            self._inbox[req].append(reply)
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
        self._connection().send(p.encode(msg))
        try:
            # skips stale replies to abandoned requests; a Timeout the daemon reports passes unchanged
            return self._receive(req_of(msg), wait, f"its answer to {msg.TYPE}")
        except (KeyboardInterrupt, SystemExit):  # interrupted while waiting: the reply comes later
            self._abandon(msg)
            raise

    def _connected(self) -> bool:
        """Connected to a live daemon; a lost connection is closed here, so the caller reconnects."""
        if self._forked() or self._pool is None:
            return False
        if self._sock is None or not self._sock.alive():
            self._close_transport()  # the daemon went away (restarted?): map its new pool
            return False
        return True

    def _connection(self) -> BlockingConnection:
        """The connection an operation talks on; closed under it (close() from another thread), it
        fails as a lost connection does."""
        if self._sock is None:
            raise ConnectionLost(f"the connection to the kvd daemon at {self.endpoint} was lost")
        return self._sock

    def _reset_socket(self) -> None:
        """A fresh connection (after a timeout, late replies would otherwise still arrive); the
        daemon gives back what the old one held."""
        self._scratch = []
        if self._sock is not None:
            self._sock.close()
        self._sock = BlockingConnection(self.endpoint, self.connect_timeout)

    def connect(self) -> Client:
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
                   ttl: float | None = None, meta: dict | None = None) -> PutStream:
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

    def cache_put(self, keys: Sequence[str], pages: Sequence[torch.Tensor | Parts], *,
                  namespace: str = "") -> list[bool]:
        """Store pages in the daemon's KV tier, page i under (namespace, keys[i]), in one batch.

        Each page (any dtype and shape, a view will do; or `Parts`, several tensors laid end to
        end) is copied once, straight into the pool.
        Per key: True if stored or already held, False if refused (the tier or the pool is
        full of what cannot be evicted, the page is bigger than the budget). The pages belong
        to the daemon, not to this client: they outlive it, until evicted or cleared."""
        self.connect()
        return self._drive(cache_put(self, keys, pages, namespace))

    def cache_get(self, keys: Sequence[str], outs: Sequence[torch.Tensor | Parts], *,
                  namespace: str = "") -> list[bool]:
        """Fill outs[i] with the page stored under (namespace, keys[i]), one copy straight from the
        pool; outs[i] must have the page's byte count (its dtype and shape may differ, e.g. a
        uint8 view; `Parts` are filled in order).
        Per key: True if filled, False on a miss (absent, evicted, other size).
        Reads never consume a page."""
        self.connect()
        return self._drive(cache_get(self, keys, outs, namespace))

    def cache_exists(self, keys: Sequence[str], *, namespace: str = "") -> int:
        """How many keys, from the first, the KV tier holds (SGLang's batch_exists)."""
        self.connect()
        return self._drive(cache_exists(self, keys, namespace))

    def cache_clear(self, namespace: str = "") -> int:
        """Drop a namespace's pages; returns how many went."""
        self.connect()
        return self._drive(self._simple(p.CacheClear(req=next(self._reqs), namespace=namespace)))

    def cache_events(self, namespace: str, *, epoch: int = 0, since: int = 0) -> dict:
        """The namespace's pages stored and removed since `since` of the daemon's log `epoch`, and
        from now on followed: {"epoch", "next", "events": [[kind, key], ...], "lost"}. Start with
        (0, 0), then pass the epoch and next of each answer; `lost` says events were missed (the
        daemon restarted, or this follower fell more than its log holds behind)."""
        self.connect()
        return self._drive(self._simple(p.CacheEvents(req=next(self._reqs), namespace=namespace, epoch=epoch,
                                                      since=since)))

    def cache_stats(self, namespace: str | None = None) -> dict:
        """The KV tier's counters: hits, misses, evictions, stored, refused, entries, bytes, budget
        (of one namespace, or of all with the biggest namespaces by name; of all, in a cluster, also
        "cluster": the exchanges with other nodes' tiers: stored_sent, fetched, asked, timeouts, bad)."""
        self.connect()
        return self._drive(self._simple(p.CacheStats(req=next(self._reqs), namespace=namespace)))

    def stats(self) -> dict:
        self.connect()
        return self._drive(self._simple(p.Stats(req=next(self._reqs))))

    def list(self) -> list[dict]:
        self.connect()
        return self._drive(self._list())

    def close(self) -> None:
        with self._lock:
            self._close_transport()

    def __del__(self) -> None:
        # try/except, not contextlib.suppress: at interpreter exit the module's globals may already
        # be None, and a finalizer must not print a traceback then
        try:  # noqa: SIM105
            self._close_transport()
        except Exception:
            pass

    def __enter__(self) -> Client:
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

    def __enter__(self) -> PutStream:
        return self

    def __exit__(self, exc_type, *rest: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
