"""Layout-aware KV handoff between instances with different TP/PP, e.g. prefill TP=2 -> decode TP=4
(worker process).

Built on the plain client API. The convention, one entry per source rank:

- key `f"{request_id}@tp{tp_rank}.pp{pp_rank}"`, meta `{"kv_layout": layout.to_wire(), "shard_of": request_id}`;
- tensors `"layer.{global_layer}.k"` and `"layer.{global_layer}.v"` for exactly the shard's layers,
  each `[..., heads_in_this_shard, head_dim]`: KV heads on `head_axis` (default -2), head_dim last;
- a tiny companion entry `key + "#layout"` with the layout as JSON bytes (one uint8 tensor). A
  reader checks it before moving any bulk bytes, and since it is put *after* the data, once a
  reader sees it the data has arrived too.

A decode rank plans with `plan_reshard`, fetches only the source shards its slice needs
(`keep=True`: other decode ranks read the same shards), checks every fingerprint before
moving bulk bytes and every tensor before assembling, then copies its slice out with
`assemble`. Layer and head rules (vLLM's) live in `kvd.parallel.kv_layout`.

`scatter_shards` is the paged form, for engine connectors (`kvd.integrations.paged.handoff`): it
leases several shards at once, lets the caller check each one's meta and tensors before any
byte moves, then copies head slices of their rows straight from the pool into the caller's
paged caches (one index_copy_ per slice, no temporary when the tensor is contiguous in the pool).
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvd.errors import AlreadyExists, BadRequest, LayoutMismatch
from kvd.parallel.kv_layout import KVLayout, ShardPiece, assemble, plan_reshard, shard_layouts, slice_shard
from kvd.wire import protocol as proto
from kvd.wire.layout import TensorSpec

from .blocks import block_index, scatter_rows
from .ops import NO_REPLY, Operation, Receive, reply_as
from .tensors import DTYPE_NAMES, TORCH_DTYPES, as_tensor, copy_out

if TYPE_CHECKING:
    from .sync import Client

LAYOUT_SUFFIX = "#layout"
LAYOUT_TENSOR = "kv_layout"
MAX_LAYOUT_BYTES = 4096  # a to_wire() dict is ~200 bytes; anything bigger is not ours
KINDS = ("k", "v")

__all__ = ["LAYOUT_SUFFIX", "HeadSlice", "ShardFetch", "check_shard", "get_shard", "put_shard", "release_shards",
           "scatter_shards", "shard_key", "shard_names"]


def shard_key(request_id: str, tp_rank: int, pp_rank: int) -> str:
    """The entry name of one source rank's shard."""
    return f"{request_id}@tp{tp_rank}.pp{pp_rank}"


def shard_names(layout: KVLayout) -> list[str]:
    """The tensor names a shard of `layout` holds, layer by layer, k before v."""
    l0, l1 = layout.layer_range()
    return [f"layer.{g}.{kind}" for g in range(l0, l1) for kind in KINDS]


def check_shard(kv: Mapping[str, Any], layout: KVLayout, head_axis: int = -2) -> dict[str, torch.Tensor]:
    """Raise LayoutMismatch unless `kv` is exactly the shard `layout` describes; return it as torch tensors.

    Checks names (the shard's layer range), dtype, the head count on `head_axis` and head_dim
    on the last axis. Other axes (tokens, blocks) are free.
    """
    if not isinstance(kv, Mapping) or not kv:
        raise BadRequest("kv must be a non-empty mapping of name -> tensor")
    where = f"shard tp{layout.tp_rank}/{layout.tp_size} pp{layout.pp_rank}/{layout.pp_size}"
    expected = shard_names(layout)
    if set(kv) != set(expected):
        missing, extra = sorted(set(expected) - set(kv)), sorted(set(kv) - set(expected), key=str)
        raise LayoutMismatch(f"{where} holds layers [{', '.join(map(str, layout.layer_range()))}): "
                             f"missing {missing[:6]}, unexpected {extra[:6]}")
    h0, h1 = layout.head_range()
    tensors = {}
    for name in expected:
        t = as_tensor(name, kv[name])
        if DTYPE_NAMES[t.dtype] != layout.dtype:
            raise LayoutMismatch(f"{where}: {name} dtype {DTYPE_NAMES[t.dtype]} != layout dtype {layout.dtype}")
        # head_dim is the last axis, so the head axis must be another one
        if t.dim() < 2 or not -t.dim() <= head_axis < t.dim() - 1 or head_axis == -1:
            raise BadRequest(f"{where}: {name} of shape {list(t.shape)} has no head axis {head_axis} before head_dim")
        if t.shape[head_axis] != h1 - h0:
            raise LayoutMismatch(f"{where}: {name} has {t.shape[head_axis]} heads on axis {head_axis}, "
                                 f"the shard holds {h1 - h0} (KV heads [{h0}, {h1}) of {layout.num_kv_heads})")
        if t.shape[-1] != layout.head_dim:
            raise LayoutMismatch(f"{where}: {name} head_dim {t.shape[-1]} != layout head_dim {layout.head_dim}")
        tensors[name] = t
    return tensors


def put_shard(client: Client, request_id: str, kv: Mapping[str, Any], layout: KVLayout, *,
              dest: str | None = None, ttl: float | None = None, head_axis: int = -2) -> str:
    """Hand off this rank's shard of request_id's cache; returns its entry key.

    Validates `kv` against `layout` before any byte is sent, then puts the data and its layout
    entry (both to `dest` when given, with the same `ttl`).
    """
    tensors = check_shard(kv, layout, head_axis)
    key = shard_key(request_id, layout.tp_rank, layout.pp_rank)
    meta = {"kv_layout": layout.to_wire(), "shard_of": request_id}
    client.put(key, tensors, dest=dest, ttl=ttl, meta=meta)
    # second, as a commit marker; if this put fails, the data entry goes at its ttl
    client.put(key + LAYOUT_SUFFIX, {LAYOUT_TENSOR: _encode(layout)}, dest=dest, ttl=ttl, meta=meta)
    return key


def get_shard(client: Client, request_id: str, layout: KVLayout, src_tp_size: int, src_pp_size: int, *,
              source: str | None = None, timeout: float = 30.0, out: Mapping[str, torch.Tensor] | None = None,
              consume: bool = False, head_axis: int = -2,
              src_pp_partition: str | None = None) -> dict[str, torch.Tensor]:
    """This rank's slice (`layout`) of request_id's cache, rebuilt from a src_tp_size x src_pp_size deployment.

    Returns {"layer.{g}.k"/"layer.{g}.v": tensor} for this rank's layers, written into `out`
    (same names; preallocated, any device) when given. `source`: pull the shards from that
    peer. `timeout` bounds the whole call. Source shards stay (keep=True) for the other decode
    ranks unless `consume` (this is their last reader); `release_shards` drops them later.
    Raises LayoutMismatch (naming the field) before assembling anything if a source shard is
    another model or another deployment than src_tp_size/src_pp_size/src_pp_partition.
    """
    srcs = {(s.tp_rank, s.pp_rank): s for s in shard_layouts(layout, src_tp_size, src_pp_size, src_pp_partition)}
    pieces = plan_reshard(list(srcs.values()), layout)
    needed = sorted({(p.src_tp_rank, p.src_pp_rank) for p in pieces})  # only these are fetched
    deadline = time.monotonic() + timeout
    keys = {rank: shard_key(request_id, *rank) for rank in needed}
    # fingerprints first: a mismatch then costs a few hundred bytes, not the cache
    for rank in needed:
        got = _fetch(client, keys[rank] + LAYOUT_SUFFIX, source, deadline, keep=True)
        _check_source(keys[rank], _decode(got), srcs[rank], layout)
    held = {rank: check_shard(_fetch(client, keys[rank], source, deadline, keep=not consume), srcs[rank], head_axis)
            for rank in needed}
    targets = _target_shapes(pieces, held, layout, head_axis, out)  # all checks done before any copy
    dtype, result = TORCH_DTYPES[layout.dtype], dict[str, torch.Tensor]()
    for kind in KINDS:  # k and v are assembled alike, each as a list of per-layer tensors
        names = [f"layer.{g}.{kind}" for g in range(*layout.layer_range())]
        layers = {rank: [held[rank][f"layer.{g}.{kind}"] for g in range(*srcs[rank].layer_range())]
                  for rank in needed}
        data = [(p, slice_shard(p, layers[p.src_tp_rank, p.src_pp_rank], head_axis)) for p in pieces]
        dst = [out[n] if out is not None else torch.empty(targets[n], dtype=dtype) for n in names]
        result.update(zip(names, assemble(layout, data, head_axis, dst), strict=True))
    if consume:  # the data entries went with their get; the layout entries go too
        for rank in needed:
            client.delete(keys[rank] + LAYOUT_SUFFIX)
    return {name: result[name] for name in shard_names(layout)}


def release_shards(client: Client, request_id: str, src_tp_size: int, src_pp_size: int) -> int:
    """Drop every source shard of request_id this daemon holds (data and layout entries).

    For the decode side once all its ranks have read them; copies elsewhere go at their ttl.
    Returns how many data shards were held.
    """
    held = 0
    for pp in range(src_pp_size):
        for tp in range(src_tp_size):
            key = shard_key(request_id, tp, pp)
            held += client.delete(key)
            client.delete(key + LAYOUT_SUFFIX)
    return held


def _encode(layout: KVLayout) -> torch.Tensor:
    raw = json.dumps(layout.to_wire(), sort_keys=True).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _decode(kv: Mapping[str, torch.Tensor]) -> KVLayout:
    t = kv.get(LAYOUT_TENSOR)
    if t is None or t.dtype != torch.uint8 or t.dim() != 1 or t.numel() > MAX_LAYOUT_BYTES:
        raise BadRequest(f"a layout entry holds one uint8 tensor {LAYOUT_TENSOR!r} of at most {MAX_LAYOUT_BYTES} bytes")
    try:
        raw = json.loads(bytes(t.numpy()))
    except ValueError:
        raise BadRequest("layout entry is not valid JSON") from None
    return KVLayout.from_wire(raw)


def _check_source(key: str, got: KVLayout, expected: KVLayout, dst: KVLayout) -> None:
    try:
        dst.check_compatible(got)  # names every differing model field (head_dim, dtype, ...)
    except LayoutMismatch as exc:
        raise LayoutMismatch(f"{key}: {exc.message}") from None
    mine = (got.tp_rank, got.tp_size, got.pp_rank, got.pp_size, got.layer_partition())
    want = (expected.tp_rank, expected.tp_size, expected.pp_rank, expected.pp_size, expected.layer_partition())
    if mine != want:
        fields = ("tp_rank", "tp_size", "pp_rank", "pp_size", "layer partition")
        diffs = ", ".join(f"{f} {a!r} != {b!r}" for f, a, b in zip(fields, mine, want, strict=True) if a != b)
        raise LayoutMismatch(f"{key} was put by another deployment: {diffs} "
                             "(pass the prefill's src_tp_size, src_pp_size, src_pp_partition)")


def _fetch(client: Client, key: str, source: str | None, deadline: float, keep: bool) -> dict[str, torch.Tensor]:
    try:
        return client.get(key, source=source, timeout=max(0.0, deadline - time.monotonic()), keep=keep)
    except AlreadyExists:
        if source is None:
            raise
        # another reader on this node is pulling the same shard right now: wait for its copy
        return client.get(key, timeout=max(0.0, deadline - time.monotonic()), keep=keep)


def _target_shapes(pieces: list[ShardPiece], held: Mapping[tuple[int, int], Mapping[str, torch.Tensor]],
                   layout: KVLayout, head_axis: int, out: Mapping[str, torch.Tensor] | None) -> dict[str, list[int]]:
    """Each destination tensor's shape; sources (and `out`) must agree on every non-head axis."""
    heads = layout.head_range()[1] - layout.head_range()[0]
    names = shard_names(layout)
    if out is not None and set(out) != set(names):
        raise BadRequest(f"out must name exactly this shard's tensors ({names[0]} .. {names[-1]})")
    shapes: dict[str, list[int]] = {}
    if out is not None:
        for name in names:
            t = out[name]
            if not isinstance(t, torch.Tensor) or DTYPE_NAMES.get(t.dtype) != layout.dtype:
                raise BadRequest(f"out[{name!r}] must be a {layout.dtype} torch.Tensor")
            shapes[name] = list(t.shape)
    for p in pieces:
        for g in range(p.layer_start, p.layer_stop):
            for kind in KINDS:
                name = f"layer.{g}.{kind}"
                shape = list(held[p.src_tp_rank, p.src_pp_rank][name].shape)
                shape[head_axis] = heads
                if shapes.setdefault(name, shape) != shape:
                    raise LayoutMismatch(f"{name}: source tp{p.src_tp_rank}.pp{p.src_pp_rank} gives shape {shape} "
                                         f"(with {heads} heads), expected {shapes[name]}")
    return shapes


# --- paged shards, straight from the pool into an engine's blocks ----------------------------------

@dataclass(frozen=True)
class HeadSlice:
    """Rows of one tensor of a shard entry, narrowed to some KV heads, into a paged cache.

    The entry's tensor is [n_rows, ...] and `cache` is [num_blocks, ...]; both carry the heads on
    `head_axis` (an axis of the full tensor). heads=None copies whole rows (no head axis, e.g. an
    MLA latent that every rank holds)."""

    name: str
    cache: torch.Tensor
    src_head: int = 0
    dst_head: int = 0
    heads: int | None = None


@dataclass(frozen=True)
class ShardFetch:
    """One shard entry to read. `plan(meta, specs)` checks it (raise LayoutMismatch to refuse:
    nothing of any shard of the call is copied then) and returns its slices.

    consume: this reader is the entry's last: it goes (with a source, the holder drops its copy).
    move (with a source, consume=False): the holder drops its copy once it has arrived here, and
    this daemon keeps it for the other readers; else the holder keeps its copy too."""

    key: str
    plan: Callable[[Any, Mapping[str, TensorSpec]], Sequence[HeadSlice]]
    consume: bool = True
    move: bool = False


def scatter_shards(client: Client, fetches: Sequence[ShardFetch], block_ids: Sequence[int], *,
                   rows: tuple[int, int], source: str | None = None, timeout: float = 30.0,
                   head_axis: int = 1) -> int:
    """Copy rows [rows[0], rows[1]) of each fetched shard's slices into `block_ids` of the caches.

    Every shard is leased (in the order given: callers sharing shards give them in one order,
    so nobody waits in a circle) and checked by its plan as soon as it is leased; only when all
    are held and checked is anything copied. A refusal or error copies nothing and gives every
    lease back. Returns the bytes copied."""
    if rows[1] - rows[0] != len(block_ids) or rows[0] < 0:
        raise BadRequest(f"rows {rows} do not match {len(block_ids)} block ids")
    client.connect()
    return client._drive(_scatter_op(client, list(fetches), list(block_ids), rows, source, timeout, head_axis))


def _scatter_op(core, fetches: list[ShardFetch], block_ids: list[int], rows: tuple[int, int], source: str | None,
                timeout: float, head_axis: int) -> Operation:
    generation = core._generation
    deadline = time.monotonic() + timeout
    held: list[tuple[ShardFetch, proto.GetSlots]] = []
    delivered = False
    try:
        work = []  # (slice, its entry's spec and segments): every check before the first copy
        for fetch in fetches:
            wait = max(0.0, deadline - time.monotonic())
            # a stream's lease never hides the entry from the other readers (a get's consuming lease
            # would, until its release); whether this read consumes is said at its release
            req = next(core._reqs)
            slots = reply_as(proto.GetSlots, (yield proto.GetStream(req=req, request_id=fetch.key, timeout=wait,
                                                                    source=source,
                                                                    keep=not (fetch.consume or fetch.move)), wait))
            held.append((fetch, slots))
            # checked as soon as it is leased: a refusal need not wait for the other shards
            specs = {spec.name: (spec, segments) for spec, segments in
                     zip((TensorSpec.from_wire(t) for t in slots.tensors), slots.segments, strict=True)}
            for piece in fetch.plan(slots.meta, {name: spec for name, (spec, _) in specs.items()}):
                if piece.name not in specs:
                    raise LayoutMismatch(f"{fetch.key} holds no tensor {piece.name!r}")
                spec, segments = specs[piece.name]
                _check_slice(fetch.key, piece, spec, rows, head_axis)
                work.append((piece, spec, segments))
            complete = False
            while not complete:  # (checked before its bytes are here: a refusal costs no transfer)
                ready = reply_as(proto.TensorsReady, (yield Receive(req, max(1.0, deadline - time.monotonic()))))
                complete = ready.complete
        pool = core._pool_of(generation)
        ids = {}
        copied = 0
        for piece, spec, segments in work:
            if id(piece.cache) not in ids:
                ids[id(piece.cache)] = block_index(piece.name, block_ids, piece.cache)
            src = _pool_rows(pool, spec, segments)[rows[0]:rows[1]]
            dst = piece.cache
            if piece.heads is not None:
                src = src.narrow(head_axis, piece.src_head, piece.heads)
                dst = dst.narrow(head_axis, piece.dst_head, piece.heads)
            scatter_rows(dst, ids[id(piece.cache)], src)
            copied += src.numel() * src.element_size()
        core._sync_device()
        delivered = True
        return copied
    finally:
        for fetch, slots in held:  # consume only what was delivered; else give it back
            yield proto.GetDone(req=next(core._reqs), request_id=fetch.key, token=slots.token,
                            consume=delivered and fetch.consume, reply=False), NO_REPLY


def _check_slice(key: str, piece: HeadSlice, spec: TensorSpec, rows: tuple[int, int], head_axis: int) -> None:
    """The slice must fit both ends exactly: copy_ would broadcast, index_copy_ would cast."""
    cache = piece.cache
    where = f"{key}: {piece.name}"
    if DTYPE_NAMES.get(cache.dtype) != spec.dtype:
        raise LayoutMismatch(f"{where} dtype {spec.dtype} != cache dtype {DTYPE_NAMES.get(cache.dtype, cache.dtype)}")
    if len(spec.shape) != cache.dim() or spec.shape[0] < rows[1]:
        raise LayoutMismatch(f"{where} of shape {list(spec.shape)} lacks rows {rows} for a cache "
                             f"of shape {list(cache.shape)}")
    src, dst = list(spec.shape[1:]), list(cache.shape[1:])
    if piece.heads is not None:
        axis = head_axis % cache.dim() - 1
        if not (0 <= axis < len(src) and piece.heads > 0 and piece.src_head >= 0
                and piece.src_head + piece.heads <= src[axis] and piece.dst_head >= 0
                and piece.dst_head + piece.heads <= dst[axis]):
            raise LayoutMismatch(f"{where}: heads [{piece.src_head}, +{piece.heads}) -> [{piece.dst_head}, "
                                 f"+{piece.heads}) do not fit {src} -> {dst} on axis {head_axis}")
        src[axis] = dst[axis] = piece.heads
    if src != dst:
        raise LayoutMismatch(f"{where}: a block of shape {list(spec.shape[1:])} does not fit the cache's "
                             f"{list(cache.shape[1:])}")


def _pool_rows(pool: torch.Tensor, spec: TensorSpec, segments: list) -> torch.Tensor:
    """The entry's tensor as a view of the pool when it lies in one piece there, else a copy."""
    if len(segments) == 1:
        offset, length = segments[0]
        return pool[offset:offset + length].view(TORCH_DTYPES[spec.dtype]).view(spec.shape)
    return copy_out(pool, spec, segments, None)
