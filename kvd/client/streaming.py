"""Layer-wise streaming in a worker process: write a cache layer by layer, read it as it arrives.

The producer opens a stream with every tensor's name, shape and dtype, writes tensors as
they are computed (each write is copied into the pool and announced; with dest, the daemon
sends it to the peer at once) and commits. The consumer iterates groups of tensors as they
become complete. The operations are generators (no I/O), driven by Client/AsyncClient.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvd.errors import BadRequest
from kvd.wire import protocol as p
from kvd.wire.layout import TensorSpec, validate_specs

from .blocks import Rows, block_index, gather_rows
from .ops import NO_REPLY, WAIT_FOREVER, Emit, Receive
from .tensors import DTYPE_NAMES, as_tensor, copy_in, copy_out


def specs_from(layout: Mapping[str, Any]) -> list[TensorSpec]:
    """{name: tensor (a 'meta' tensor is fine) or (shape, dtype)} -> tensor specs."""
    specs = []
    for name, value in layout.items():
        if isinstance(value, torch.Tensor):
            if value.is_nested:
                raise BadRequest(f"layout[{name!r}] is a nested tensor, which has no one shape")
            shape, dtype = tuple(value.shape), value.dtype
        elif isinstance(value, tuple) and len(value) == 2:
            shape, dtype = tuple(value[0]), value[1]
        else:
            raise BadRequest(f"layout[{name!r}] must be a tensor or a (shape, dtype) pair")
        if dtype not in DTYPE_NAMES:
            raise BadRequest(f"layout[{name!r}]: dtype {dtype} is not supported")
        specs.append(TensorSpec(name, DTYPE_NAMES[dtype], shape))
    if not specs:
        raise BadRequest("a stream needs at least one tensor")
    return specs


class StreamState:
    """What a producer stream remembers between writes."""

    def __init__(self, request_id: str, specs: list[TensorSpec], dest: str | None) -> None:
        self.request_id = request_id
        self.specs = specs
        self.index = {spec.name: i for i, spec in enumerate(specs)}
        self.dest = dest
        self.token = 0
        self.segments: list = []
        self.written: set[int] = set()
        self.closed = False
        self.generation = 0  # the client's connection the stream was opened on (its offsets are that pool's)
        self.req = 0  # the put_alloc's: the daemon reports on it if the stream ends without its writer
        self.failed: Exception | None = None  # why the daemon ended it (lease ran out, deleted, push failed)


def _give_up(core, state: StreamState, failed: Exception):
    """The daemon ended this stream: stop writing, say so (the daemon keeps its blocks parked until
    then, as we might still be copying), and raise why."""
    state.closed = True
    core._writes.pop(state.req, None)
    if core._same_connection(state.generation):
        yield p.Delete(req=next(core._reqs), request_id=state.request_id, token=state.token), NO_REPLY
    raise failed


def open_stream(core, state: StreamState, ttl: float | None, meta: dict | None):
    core._check_request_id(state.request_id)
    core._check_meta(meta)
    validate_specs(state.specs)
    state.generation = core._generation
    state.req = next(core._reqs)
    slots = yield p.PutAlloc(req=state.req, request_id=state.request_id,
                             tensors=[s.to_wire() for s in state.specs], ttl=ttl, meta=meta,
                             stream=True, dest=state.dest), 0.0
    state.token, state.segments = slots.token, slots.segments
    core._writes[state.req] = state


def write_stream(core, state: StreamState, kv: Mapping[str, Any]):
    if state.closed:
        raise BadRequest("stream already committed or aborted")
    core._read_notices()
    if state.failed is not None:
        yield from _give_up(core, state, state.failed)
    indices = []
    for name, value in kv.items():
        if name not in state.index:
            raise BadRequest(f"{name!r} is not a tensor of stream {state.request_id!r}")
        i = state.index[name]
        if i in state.written:
            raise BadRequest(f"{name!r} was already written")
        spec = state.specs[i]
        if isinstance(value, Rows):  # rows of a paged cache: gathered straight into the pool
            ids = block_index(name, value.block_ids, value.cache)
            dtype, shape = value.cache.dtype, (len(ids), *value.cache.shape[1:])
        else:
            tensor = as_tensor(name, value)
            dtype, shape = tensor.dtype, tuple(tensor.shape)
        if DTYPE_NAMES.get(dtype) != spec.dtype or shape != spec.shape:
            raise BadRequest(f"{name!r} is {dtype} {shape}, the stream declared {spec.dtype} {spec.shape}")
        pool = core._pool_of(state.generation)  # a restarted daemon's pool has other entries there
        if isinstance(value, Rows):
            gather_rows(pool, state.segments[i], spec, value.cache, ids)
        else:
            copy_in(pool, tensor, state.segments[i])
        indices.append(i)
    core._sync_device()
    state.written.update(indices)
    yield p.PutPart(req=next(core._reqs), request_id=state.request_id, token=state.token,
                    tensors=indices), NO_REPLY


def commit_stream(core, state: StreamState):
    if state.closed:
        raise BadRequest("stream already committed or aborted")
    core._read_notices()
    if state.failed is not None:
        yield from _give_up(core, state, state.failed)
    state.closed = True
    core._writes.pop(state.req, None)
    core._pool_of(state.generation)  # opened on a connection that is gone: nothing to commit here
    yield p.PutCommit(req=next(core._reqs), request_id=state.request_id, token=state.token,
                      dest=state.dest), (WAIT_FOREVER if state.dest else 0.0)


def abort_stream(core, state: StreamState):
    if not state.closed:
        state.closed = True
        core._writes.pop(state.req, None)
        if core._same_connection(state.generation):  # (a restarted daemon never had it)
            # names the reservation: a newer entry of the same id (ours expired) is not touched
            yield p.Delete(req=next(core._reqs), request_id=state.request_id, token=state.token), NO_REPLY


def read_stream(core, request_id: str, timeout: float, out: Mapping[str, torch.Tensor] | None, keep: bool,
                source: str | None = None):
    """Yields Emit({name: tensor}) for each group of tensors as it becomes complete."""
    core._check_request_id(request_id)
    req = next(core._reqs)
    generation = core._generation
    slots = yield p.GetStream(req=req, request_id=request_id, timeout=float(timeout), source=source,
                              keep=keep), float(timeout)
    specs = [TensorSpec.from_wire(t) for t in slots.tensors]
    out = out or {}
    consume = False
    try:
        done = False
        while not done:
            ready = yield Receive(req, core.transfer_wait)
            done = ready.complete
            if ready.tensors:
                pool = core._pool_of(generation)
                group = {
                    specs[i].name: copy_out(pool, specs[i], slots.segments[i], out.get(specs[i].name))
                    for i in ready.tensors
                }
                core._sync_device()
                yield Emit(group)
        consume = not keep
    finally:
        yield p.GetDone(req=next(core._reqs), request_id=request_id, token=slots.token,
                        consume=consume, reply=False), NO_REPLY
