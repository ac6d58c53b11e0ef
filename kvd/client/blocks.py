"""Paged KV caches (worker process): a request's blocks straight from and into a worker's block table.

An inference engine keeps each layer's KV cache as one big paged tensor
[num_blocks, block_size, ...] and a request owns some block ids, scattered anywhere in it.
`put_blocks` gathers those rows into the pool with one `index_select` per tensor, writing
directly into the pool (no temporary, no per-block copies); `get_blocks` scatters them into
the consumer's own block ids with one `index_copy_` per tensor. Operations are generators
(no I/O), driven by Client / AsyncClient like the others.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvd.errors import BadRequest
from kvd.wire import protocol as p
from kvd.wire.layout import TensorSpec

from .ops import NO_REPLY
from .tensors import DTYPE_NAMES, TORCH_DTYPES, copy_in, copy_out


def block_index(name: str, block_ids: Sequence[int] | torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """block_ids as a long tensor on the cache's device, checked against the cache first (on the
    host for a list: no device round trip per layer on a GPU)."""
    if not isinstance(cache, torch.Tensor) or cache.dim() < 1:
        raise BadRequest(f"{name!r}: a paged cache has the block index as its first dimension")
    ids = torch.as_tensor(block_ids, dtype=torch.long)
    if ids.dim() != 1 or ids.numel() == 0:
        raise BadRequest("block_ids must be a non-empty 1-D sequence of block numbers")
    if int(ids.min()) < 0 or int(ids.max()) >= cache.shape[0]:
        raise BadRequest(f"{name!r}: block ids must lie in 0..{cache.shape[0] - 1}")
    return ids.to(cache.device)


def _pool_view(pool: torch.Tensor, segments: list, spec: TensorSpec) -> torch.Tensor | None:
    """The tensor's bytes in the pool as a typed view, when they are contiguous there."""
    if len(segments) != 1:
        return None
    offset, length = segments[0]
    return pool[offset:offset + length].view(TORCH_DTYPES[spec.dtype]).view(spec.shape)


@dataclass(frozen=True)
class Rows:
    """Rows `block_ids` of a paged cache [num_blocks, ...]: as a value of a stream write
    (`stream.write({"layer.0": Rows(cache, ids)})`) they are gathered straight into the pool."""

    cache: torch.Tensor
    block_ids: Sequence[int] | torch.Tensor


def byte_view(tensor: torch.Tensor) -> torch.Tensor | None:
    """The same memory as uint8 (the last dim scaled), or None when its last dim is strided.
    Gathers on bytes work for every dtype (CPU torch has no fp8 index kernels) and keep bits."""
    try:
        return tensor.view(torch.uint8)
    except RuntimeError:
        return None


def gather_rows(pool: torch.Tensor, segments: list, spec: TensorSpec, cache: torch.Tensor,
                ids: torch.Tensor) -> None:
    """cache[ids] -> the tensor's pool segments: one gather kernel into the pool where possible."""
    target = _pool_view(pool, segments, spec)
    source, out = byte_view(cache), byte_view(target) if target is not None else None
    if target is not None and out is not None and source is not None and target.device == cache.device:
        torch.index_select(source, 0, ids, out=out)  # straight into the pool, no temporary
        return
    rows = source.index_select(0, ids).view(cache.dtype) if source is not None else cache.index_select(0, ids)
    copy_in(pool, rows, segments)


def scatter_rows(cache: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """rows -> cache[ids]: one scatter kernel, on bytes where possible (every dtype, bits kept)."""
    rows = rows.to(cache.device)
    target, source = byte_view(cache), byte_view(rows)
    if target is not None and source is not None:
        target.index_copy_(0, ids, source)
    else:
        cache.index_copy_(0, ids, rows)


def put_blocks(core, request_id: str, caches: Mapping[str, torch.Tensor], block_ids, dest: str | None,
               ttl: float | None, meta: dict | None):
    if not caches:
        raise BadRequest("caches must name at least one paged tensor")
    specs, gathers = [], {}
    for name, cache in caches.items():
        if not isinstance(cache, torch.Tensor) or cache.dtype not in DTYPE_NAMES:
            raise BadRequest(f"{name!r}: expected a torch tensor of a supported dtype")
        ids = gathers[name] = block_index(name, block_ids, cache)
        specs.append(TensorSpec(name, DTYPE_NAMES[cache.dtype], (len(ids), *cache.shape[1:])))

    generation = core._generation

    def write(segments: list) -> None:
        pool = core._pool_of(generation)
        for spec, tensor_segments, (name, cache) in zip(specs, segments, caches.items(), strict=True):
            gather_rows(pool, tensor_segments, spec, cache, gathers[name])

    yield from core._put_with(request_id, specs, write, dest, ttl, meta)


def get_blocks(core, request_id: str, caches: Mapping[str, torch.Tensor], block_ids, source: str | None,
               timeout: float, keep: bool):
    core._check_request_id(request_id)
    generation = core._generation
    slots = yield p.Get(req=next(core._reqs), request_id=request_id, timeout=float(timeout), source=source,
                        keep=keep), float(timeout)
    consume = not keep
    try:
        specs = [TensorSpec.from_wire(t) for t in slots.tensors]
        by_name = {spec.name: (spec, segments) for spec, segments in zip(specs, slots.segments, strict=True)}
        if set(caches) != set(by_name):
            raise BadRequest(f"caches name {sorted(caches)}, the entry holds {sorted(by_name)}")
        scatters = {}
        for name, cache in caches.items():
            spec, segments = by_name[name]
            ids = scatters[name] = block_index(name, block_ids, cache)
            if (DTYPE_NAMES.get(cache.dtype) != spec.dtype or tuple(cache.shape[1:]) != spec.shape[1:]
                    or len(ids) != spec.shape[0]):
                raise BadRequest(f"{name!r}: cache {cache.dtype} {tuple(cache.shape)} with {len(ids)} block ids "
                                 f"does not fit the entry's {spec.dtype} {spec.shape}")
        pool = core._pool_of(generation)
        for name, cache in caches.items():
            spec, segments = by_name[name]
            source_rows = _pool_view(pool, segments, spec)
            if source_rows is None:
                source_rows = copy_out(pool, spec, segments, None)
            scatter_rows(cache, scatters[name], source_rows)
        core._sync_device()
    except BaseException:
        consume = False
        raise
    finally:
        yield p.GetDone(req=next(core._reqs), request_id=request_id, token=slots.token, consume=consume,
                        reply=False), NO_REPLY
