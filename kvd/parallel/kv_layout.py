"""Which slice of a model's KV cache each rank holds, and how to rebuild one layout from another.

Pure bookkeeping on layer and KV-head indices, no I/O (worker processes). The only torch is in
`slice_shard` (views) and `assemble` (one copy per piece), which apply a plan to per-layer
tensors; torch is imported only when they are called, so the torch-free daemon can use KVLayout
too.
A KVLayout travels in an entry's `meta` (to_wire/from_wire), so the receiver can plan a
reshard between, say, a prefill and a decode instance with different TP/PP.

Rules, both vLLM's:
- layers (vllm/distributed/utils.py get_pp_indices): each of the pp stages gets
  num_layers // pp layers, and the num_layers % pp leftover layers go one each to the
  stages just *before the last*, counting backwards (the last stage also runs the norm and
  LM head). 10 layers over 4 stages: [2, 3, 3, 2]. An explicit `pp_partition`, in the
  format of VLLM_PP_LAYER_PARTITION ("3,3,2,2"), overrides this.
- KV heads (QKVParallelLinear): with num_kv_heads >= tp each rank holds
  num_kv_heads // tp consecutive heads; with fewer heads than ranks each head is
  replicated on tp // num_kv_heads consecutive ranks, rank r holding head r // replicas.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import BadRequest, LayoutMismatch
from ..wire.dtypes import itemsize

if TYPE_CHECKING:
    import torch

MAX_COUNT = 1 << 20  # cap on every count from the wire: far above any real model or cluster
MAX_STR_LEN = 64
MODEL_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "page_layout")
_INT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "tp_rank", "tp_size", "pp_rank", "pp_size")
_OPTIONAL_FIELDS = ("block_size", "page_layout", "pp_partition")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """A model's KV-cache fingerprint plus the shard one rank holds. Invalid values raise BadRequest."""

    num_layers: int  # attention layers holding KV, whole model
    num_kv_heads: int  # KV heads per layer, whole model (before TP)
    head_dim: int
    dtype: str  # a name from kvd.wire.dtypes
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    block_size: int | None = None  # tokens per KV page, when the cache is paged
    page_layout: str | None = None  # axis order inside a page, e.g. "NHD" or "HND"
    pp_partition: str | None = None  # layers per stage, "3,3,2,2"; None = vLLM's default split

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            low = 0 if name.endswith("_rank") else 1
            if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= MAX_COUNT):
                raise BadRequest(f"KV layout {name} must be an int in [{low}, {MAX_COUNT}], got {value!r}")
        if not isinstance(self.dtype, str):
            raise BadRequest(f"KV layout dtype must be a string, got {self.dtype!r:.40}")
        itemsize(self.dtype)  # validates the name
        if self.tp_rank >= self.tp_size or self.pp_rank >= self.pp_size:
            raise BadRequest(f"KV layout rank out of range: tp {self.tp_rank}/{self.tp_size}, "
                             f"pp {self.pp_rank}/{self.pp_size}")
        if self.num_kv_heads % self.tp_size and self.tp_size % self.num_kv_heads:
            raise BadRequest(f"{self.num_kv_heads} KV heads cannot be split over tp_size {self.tp_size}: "
                             "one must divide the other")
        if self.block_size is not None and not (
                isinstance(self.block_size, int) and not isinstance(self.block_size, bool)
                and 1 <= self.block_size <= MAX_COUNT):
            raise BadRequest(f"KV layout block_size must be a positive int, got {self.block_size!r}")
        if self.page_layout is not None and not (
                isinstance(self.page_layout, str) and 0 < len(self.page_layout) <= MAX_STR_LEN):
            raise BadRequest(f"KV layout page_layout must be a short non-empty string, got {self.page_layout!r}")
        # normalize "3, 3,2" to "3,3,2" so equal partitions compare equal
        object.__setattr__(self, "pp_partition", _canonical_partition(self))
        if any(n < 1 for n in self.layer_partition()):
            raise BadRequest(f"{self.num_layers} layers cannot fill {self.pp_size} pipeline stages")

    def layer_partition(self) -> tuple[int, ...]:
        """Number of layers of each pipeline stage."""
        if self.pp_partition is not None:
            return tuple(int(n) for n in self.pp_partition.split(","))
        base, extra = divmod(self.num_layers, self.pp_size)
        parts = [base] * self.pp_size
        for i in range(2, extra + 2):  # vLLM: from the second-to-last stage backwards
            parts[-i] += 1
        return tuple(parts)

    def layer_range(self) -> tuple[int, int]:
        """Global [start, stop) of the layers this pipeline stage holds."""
        parts = self.layer_partition()
        start = sum(parts[:self.pp_rank])
        return start, start + parts[self.pp_rank]

    @property
    def head_replicas(self) -> int:
        """How many TP ranks hold each KV head (1 unless tp_size > num_kv_heads)."""
        return max(1, self.tp_size // self.num_kv_heads)

    def head_range(self) -> tuple[int, int]:
        """Global [start, stop) of the KV heads this TP rank holds."""
        if self.num_kv_heads >= self.tp_size:
            per_rank = self.num_kv_heads // self.tp_size
            return self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank
        head = self.tp_rank // self.head_replicas
        return head, head + 1

    def with_shard(self, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int,
                   pp_partition: str | None = None) -> KVLayout:
        """The same model, another shard."""
        return dataclasses.replace(self, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                                   pp_partition=pp_partition)

    def same_model(self, other: KVLayout) -> bool:
        return all(getattr(self, f) == getattr(other, f) for f in MODEL_FIELDS)

    def check_compatible(self, other: KVLayout) -> None:
        """Raise LayoutMismatch, naming every differing field, unless both describe the same model."""
        diffs = [f"{f} {getattr(self, f)!r} != {getattr(other, f)!r}"
                 for f in MODEL_FIELDS if getattr(self, f) != getattr(other, f)]
        if diffs:
            raise LayoutMismatch("KV layouts describe different models: " + ", ".join(diffs))

    def to_wire(self) -> dict[str, int | str]:
        """Plain dict for msgpack; optional fields that are None are left out."""
        wire: dict[str, int | str] = {"dtype": self.dtype}
        wire.update((name, getattr(self, name)) for name in _INT_FIELDS)
        wire.update((name, getattr(self, name)) for name in _OPTIONAL_FIELDS if getattr(self, name) is not None)
        return wire

    @classmethod
    def from_wire(cls, raw: object) -> KVLayout:
        """Validate a dict from the wire; unknown keys are rejected, since they could change the meaning."""
        if not isinstance(raw, dict):
            raise BadRequest(f"KV layout must be a map, got {type(raw).__name__}")
        known = {"dtype", *_INT_FIELDS, *_OPTIONAL_FIELDS}
        if unknown := sorted(str(k) for k in raw if k not in known):
            raise BadRequest(f"KV layout has unknown fields: {', '.join(unknown)[:200]}")
        if missing := [k for k in ("dtype", *_INT_FIELDS) if k not in raw]:
            raise BadRequest(f"KV layout is missing fields: {', '.join(missing)}")
        return cls(**raw)


def _canonical_partition(layout: KVLayout) -> str | None:
    text = layout.pp_partition
    if text is None:
        return None
    if not isinstance(text, str) or len(text) > MAX_STR_LEN * 4:
        raise BadRequest(f"pp_partition must be a string like '3,3,2', got {text!r:.80}")
    try:
        parts = [int(n) for n in text.split(",")]
    except ValueError:
        raise BadRequest(f"pp_partition must be comma-separated ints, got {text!r}") from None
    if len(parts) != layout.pp_size or sum(parts) != layout.num_layers:
        raise BadRequest(f"pp_partition {text!r} must have pp_size={layout.pp_size} entries "
                         f"summing to num_layers={layout.num_layers}")
    return ",".join(map(str, parts))


def shard_layouts(model: KVLayout, tp_size: int, pp_size: int, pp_partition: str | None = None) -> list[KVLayout]:
    """Every shard of one TP x PP deployment of `model`, in global rank order (pp outer, tp inner)."""
    return [model.with_shard(t, tp_size, p, pp_size, pp_partition) for p in range(pp_size) for t in range(tp_size)]


@dataclass(frozen=True, slots=True)
class ShardPiece:
    """One rectangle of a reshard plan: global layers x global KV heads, from one source shard."""

    src_tp_rank: int  # the source shard holding the data
    src_pp_rank: int
    layer_start: int  # global layer indices [layer_start, layer_stop)
    layer_stop: int
    head_start: int  # global KV head indices [head_start, head_stop)
    head_stop: int
    src_layer_offset: int  # where the rectangle starts inside the source shard
    src_head_offset: int
    dst_layer_offset: int  # where it lands inside the destination shard
    dst_head_offset: int

    @property
    def num_layers(self) -> int:
        return self.layer_stop - self.layer_start

    @property
    def num_heads(self) -> int:
        return self.head_stop - self.head_start


def _cuts(lo: int, hi: int, ranges: Iterable[tuple[int, int]]) -> list[int]:
    return sorted({lo, hi} | {b for r in ranges for b in r if lo < b < hi})


def _pick(candidates: list[KVLayout], dst: KVLayout) -> KVLayout:
    # Replicated heads (and same-shard layouts) have several holders. Prefer the source whose
    # tp_rank equals the destination's, so identical layouts map rank to rank; otherwise rotate
    # by the destination's tp_rank, so destination ranks needing the same heads pull from
    # different replicas.
    same = [s for s in candidates if s.tp_rank == dst.tp_rank]
    if same:
        return same[0]
    return candidates[dst.tp_rank % len(candidates)]


def plan_reshard(src_layouts: Sequence[KVLayout], dst: KVLayout) -> list[ShardPiece]:
    """Pieces that together cover the destination shard's layers x heads exactly once.

    `src_layouts` is one layout per source shard (any TP/PP, not necessarily a full grid, as
    long as together they hold what `dst` needs). Raises LayoutMismatch when a source is
    another model, BadRequest for a duplicate source or a gap no source covers.
    """
    sources = sorted(src_layouts, key=lambda s: (s.tp_rank, s.pp_rank))
    seen: set[tuple[int, int]] = set()
    for src in sources:
        dst.check_compatible(src)
        if (src.tp_rank, src.pp_rank) in seen:
            raise BadRequest(f"two source layouts claim tp_rank {src.tp_rank}, pp_rank {src.pp_rank}")
        seen.add((src.tp_rank, src.pp_rank))
    (l0, l1), (h0, h1) = dst.layer_range(), dst.head_range()
    held = [(src, src.layer_range(), src.head_range()) for src in sources]
    layer_cuts = _cuts(l0, l1, (layers for _, layers, _ in held))
    head_cuts = _cuts(h0, h1, (heads for _, _, heads in held))
    pieces: list[ShardPiece] = []
    prev_row: list[tuple[KVLayout, int, int]] = []
    row_start = l0
    for a, b in itertools.pairwise(layer_cuts):
        # cuts include every source boundary, so each source holds a cell wholly or not at all
        in_band = [(src, heads) for src, layers, heads in held if layers[0] <= a and b <= layers[1]]
        row: list[tuple[KVLayout, int, int]] = []
        for c, d in itertools.pairwise(head_cuts):
            holders = [src for src, heads in in_band if heads[0] <= c and d <= heads[1]]
            if not holders:
                raise BadRequest(f"no source holds layers [{a}, {b}) x KV heads [{c}, {d}) needed by "
                                 f"destination tp_rank {dst.tp_rank}, pp_rank {dst.pp_rank}")
            src = _pick(holders, dst)
            if row and row[-1][0] is src:
                row[-1] = (src, row[-1][1], d)  # same source as the cell to the left: widen
            else:
                row.append((src, c, d))
        if row != prev_row:  # else: same sources and head cuts as the band above, so it grows down
            pieces += _row_pieces(prev_row, row_start, a, dst)
            prev_row, row_start = row, a
    pieces += _row_pieces(prev_row, row_start, l1, dst)
    return pieces


def _row_pieces(row: list[tuple[KVLayout, int, int]], a: int, b: int, dst: KVLayout) -> list[ShardPiece]:
    dst_layer0, dst_head0 = dst.layer_range()[0], dst.head_range()[0]
    pieces = []
    for src, c, d in row:
        src_layer0, src_head0 = src.layer_range()[0], src.head_range()[0]
        pieces.append(ShardPiece(src.tp_rank, src.pp_rank, a, b, c, d,
                                 a - src_layer0, c - src_head0, a - dst_layer0, c - dst_head0))
    return pieces


def slice_shard(piece: ShardPiece, src_layers: Sequence[torch.Tensor], head_axis: int = -2) -> list[torch.Tensor]:
    """Views of the piece's data in its source shard: one tensor per layer, no copy.

    `src_layers` holds the source shard's per-layer tensors, each with its local heads on
    `head_axis` (-2 for [..., heads, head_dim]).
    """
    stop = piece.src_layer_offset + piece.num_layers
    if stop > len(src_layers):
        raise BadRequest(f"piece needs source layers up to {stop}, shard has {len(src_layers)}")
    views = []
    for t in src_layers[piece.src_layer_offset:stop]:
        if piece.src_head_offset + piece.num_heads > t.shape[head_axis]:
            raise BadRequest(f"piece needs source heads up to {piece.src_head_offset + piece.num_heads}, "
                             f"tensor has {t.shape[head_axis]} on axis {head_axis}")
        views.append(t.narrow(head_axis, piece.src_head_offset, piece.num_heads))
    return views


def assemble(dst: KVLayout, pieces_with_tensors: Iterable[tuple[ShardPiece, Sequence[torch.Tensor]]],
             head_axis: int = -2, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Copy each piece's per-layer tensors into the destination shard and return its layers.

    Writes into `out` (the destination's per-layer tensors) when given, else allocates.
    Checks dtype, shapes and that the pieces cover the shard exactly once; the caller keeps
    ownership of the piece tensors, which may be freed once this returns.
    """
    import torch

    (l0, l1), (h0, h1) = dst.layer_range(), dst.head_range()
    n_layers, n_heads = l1 - l0, h1 - h0
    if out is not None and len(out) != n_layers:
        raise BadRequest(f"out has {len(out)} layers, the destination shard {n_layers}")
    covered = bytearray(n_layers * n_heads)
    layers = list(out) if out is not None else None
    for piece, tensors in pieces_with_tensors:
        _claim(covered, piece, n_layers, n_heads)  # before any copy: a bad offset must not write
        if len(tensors) != piece.num_layers:
            raise BadRequest(f"piece has {piece.num_layers} layers but {len(tensors)} tensors")
        for i, t in enumerate(tensors):
            if t.dtype != getattr(torch, dst.dtype):  # (wire dtype names are torch's attribute names)
                raise BadRequest(f"piece tensor dtype {t.dtype} does not match layout dtype {dst.dtype}")
            if layers is None:
                shape = list(t.shape)
                shape[head_axis] = n_heads
                layers = [torch.empty(shape, dtype=t.dtype, device=t.device) for _ in range(n_layers)]
            target = layers[piece.dst_layer_offset + i]
            expected = list(target.shape)
            expected[head_axis] = piece.num_heads
            # copy_ would silently broadcast a wrong shape or cast a wrong dtype
            if list(t.shape) != expected or target.dtype != t.dtype:
                raise BadRequest(f"piece tensor {t.dtype}{list(t.shape)} does not fit "
                                 f"destination {target.dtype}{expected}")
            target.narrow(head_axis, piece.dst_head_offset, piece.num_heads).copy_(t)
    if layers is None or not all(covered):
        raise BadRequest("pieces do not cover the destination shard")
    return layers


def _claim(covered: bytearray, piece: ShardPiece, n_layers: int, n_heads: int) -> None:
    rows = range(piece.dst_layer_offset, piece.dst_layer_offset + piece.num_layers)
    cols = range(piece.dst_head_offset, piece.dst_head_offset + piece.num_heads)
    if not (rows and cols and rows[0] >= 0 and rows[-1] < n_layers and cols[0] >= 0 and cols[-1] < n_heads):
        raise BadRequest(f"{piece} falls outside the destination shard ({n_layers} layers x {n_heads} heads)")
    for row in rows:
        for col in cols:
            if covered[row * n_heads + col]:
                raise BadRequest(f"{piece} overlaps another piece")
            covered[row * n_heads + col] = 1
