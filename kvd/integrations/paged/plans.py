"""What a paged KV entry holds and which entries a consumer rank reads (engine worker and scheduler
processes; pure: no I/O, no engine import).

A producer rank's entry is its shard of a request's paged cache: one tensor per attention layer it
holds, named by the engine's layer name, `[n_blocks, *block_shape]`. Its meta carries a
`PagedKVLayout`: the model signature, every layer's block shape and dtype, the block size, and the
shard's place in the model as a `kvd.parallel.KVLayout` (TP size and rank, PP size and rank and
the layer partition, hence its layer range and KV-head range), plus the axis of the heads inside
a block. A consumer rank plans from its own layout and the producer's deployment
(`SourceDeployment`, carried by the handshake) which source shards it needs and which head slice
of which layer each one gives (`plan_loads`), and checks every source entry's layout before a
byte of it is copied (`check_source`).

Layers are matched by name; their global index (for the pipeline split) is the one integer in the
name ("model.layers.7.self_attn.attn" -> 7). Entries are logical tensors (a gather of logical
block rows), so the producer's physical stride order need not match the consumer's.

A hybrid model's layers fall into KV cache groups (`kvd.integrations.paged.groups`), each with
its own block table; the layout lists them (none listed: one full-attention group of every
layer). The head plan is per layer, so it holds for every attention group alike; a Mamba
state has no KV heads to split and moves between equal TP sizes only.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, TypeGuard

from ...errors import BadRequest, LayoutMismatch
from ...parallel.kv_layout import KVLayout, shard_layouts
from ...parallel.readers import is_primary, read_plans, readers
from .groups import FULL, MAMBA, KVGroup, check_groups

# quantization modes whose pages split by head (scales outside the page, or none): only these
# are resharded; the others move between identical deployments only
HEAD_SEPARABLE_QUANT = ("NONE", "FP8_PER_TENSOR")
_INDEX = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def layer_index(name: str) -> int:
    """The global layer index in an engine's layer name: its one integer component."""
    found = _INDEX.findall(name)
    if len(found) != 1:
        raise BadRequest(f"layer name {name!r} has no single layer index")
    return int(found[0])



def _is_count(value: object) -> TypeGuard[int]:
    """A tp or pp size from a peer's kvd_layout: an int (not a bool) in [1, 4096]."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 4096

@dataclass(frozen=True)
class SourceDeployment:
    """The producer instance's parallel layout, as the handshake carries it."""

    tp_size: int = 1
    pp_size: int = 1
    pp_partition: str | None = None  # layers per stage, "3,3,2,2" (VLLM_PP_LAYER_PARTITION's form)

    def to_params(self) -> dict[str, Any]:
        return {"tp_size": self.tp_size, "pp_size": self.pp_size, "pp_partition": self.pp_partition}

    @classmethod
    def from_params(cls, raw: Any) -> SourceDeployment:
        if not isinstance(raw, dict):
            raise ValueError(f"kvd_layout must be a map, got {raw!r:.80}")
        tp, pp, part = raw.get("tp_size"), raw.get("pp_size", 1), raw.get("pp_partition")
        if not _is_count(tp) or not _is_count(pp):
            raise ValueError(f"kvd_layout tp_size and pp_size must be ints in [1, 4096]: {raw!r:.120}")
        if part is not None and not (isinstance(part, str) and len(part) <= 256):
            raise ValueError(f"kvd_layout pp_partition must be a string like '3,3,2': {part!r:.80}")
        return cls(tp, pp, part)


@dataclass(frozen=True)
class PagedKVLayout:
    """What a consumer must agree on with a producer for the bytes to mean the same attention."""

    model: str  # architecture signature, e.g. "LlamaForCausalLM:num_hidden_layers=32:...:kv_dtype=auto"
    layers: tuple[tuple[str, tuple[int, ...], str], ...]  # (layer name, one block's shape, dtype)
    block_size: int
    kv: KVLayout  # the shard: model geometry, TP/PP sizes and ranks, layer partition
    head_axis: int | None = 0  # the heads' axis inside a block's shape; None: no head axis (MLA)
    quant: str = "NONE"  # the KV quantization mode
    cache_layout: str | None = None  # physical stride order (vLLM's KVCacheLayout name): for the logs
    groups: tuple[KVGroup, ...] = ()  # the KV cache groups; () is one full-attention group of every layer

    def __post_init__(self) -> None:
        (l0, l1), (h0, h1) = self.kv.layer_range(), self.kv.head_range()
        if self.head_axis is None and self.kv.num_kv_heads != 1:
            raise BadRequest("a cache without a head axis must be modelled as one KV head")
        if self.groups:
            check_groups(self.groups, [name for name, _, _ in self.layers])
        states = self.state_layers
        for name, shape, _ in self.layers:
            if not l0 <= layer_index(name) < l1:
                raise BadRequest(f"layer {name!r} lies outside this stage's layers [{l0}, {l1})")
            if self.head_axis is not None and name not in states and not (
                    0 <= self.head_axis < len(shape) and shape[self.head_axis] == h1 - h0):
                raise BadRequest(f"layer {name!r}: block shape {list(shape)} does not hold {h1 - h0} KV heads "
                                 f"on axis {self.head_axis}")

    @property
    def kv_groups(self) -> tuple[KVGroup, ...]:
        """The KV cache groups, the default one spelled out."""
        return self.groups or (KVGroup(FULL, self.block_size, tuple(name for name, _, _ in self.layers)),)

    @property
    def state_layers(self) -> frozenset[str]:
        """Layers whose blocks hold a recurrent state (Mamba, linear attention), not per-token KV."""
        return frozenset(name for g in self.groups if g.kind == MAMBA for name in g.layers)

    @property
    def tp_size(self) -> int:
        return self.kv.tp_size

    @property
    def tp_rank(self) -> int:
        return self.kv.tp_rank

    @property
    def pp_rank(self) -> int:
        return self.kv.pp_rank

    @classmethod
    def from_caches(cls, caches: Any, *, model: str, block_size: int, kv: KVLayout | None = None,
                    tp_size: int = 1, tp_rank: int = 0, head_axis: int | None = 0, quant: str = "NONE",
                    cache_layout: str | None = None, groups: tuple[KVGroup, ...] = ()) -> PagedKVLayout:
        """From a worker's per-layer paged caches `{name: [num_blocks, *block_shape]}`. Without `kv`,
        one pipeline stage holding every layer, its heads split evenly over `tp_size`; without
        `groups`, one full-attention group."""
        import torch

        from ...client.tensors import DTYPE_NAMES

        layers = []
        for name, cache in caches.items():
            if not isinstance(cache, torch.Tensor) or cache.dim() < 2:
                raise BadRequest(f"{name!r}: a paged cache is a tensor [num_blocks, ...]")
            if cache.dtype not in DTYPE_NAMES:
                raise BadRequest(f"{name!r}: dtype {cache.dtype} is not supported")
            layers.append((name, tuple(cache.shape[1:]), DTYPE_NAMES[cache.dtype]))
        if not layers:
            raise BadRequest("no paged caches registered")
        if kv is None:
            states = {name for g in groups if g.kind == MAMBA for name in g.layers}
            shape = next(s for n, s, _ in layers if n not in states)
            heads = 1 if head_axis is None else shape[head_axis] * tp_size
            kv = KVLayout(num_layers=max(layer_index(n) for n, _, _ in layers) + 1, num_kv_heads=heads,
                          head_dim=shape[-1], dtype=layers[0][2], tp_rank=tp_rank, tp_size=tp_size)
        return cls(model, tuple(layers), block_size, kv, head_axis, quant, cache_layout, tuple(groups))

    def to_wire(self) -> dict:
        return {"model": self.model, "block_size": self.block_size, "kv": self.kv.to_wire(),
                "head_axis": self.head_axis, "quant": self.quant, "cache_layout": self.cache_layout,
                # redundant with kv, for readers of the meta (and checked on receipt)
                "layer_range": list(self.kv.layer_range()), "head_range": list(self.kv.head_range()),
                "layers": [[name, list(shape), dtype] for name, shape, dtype in self.layers],
                # (only a hybrid model's: a one-group layout reads the same as before groups existed)
                **({"groups": [g.to_wire() for g in self.groups]} if self.groups else {})}

    @classmethod
    def from_wire(cls, wire: Any) -> PagedKVLayout:
        try:
            layers = tuple((str(name), tuple(int(d) for d in shape), str(dtype))
                           for name, shape, dtype in wire["layers"])
            axis = wire["head_axis"]
            groups = tuple(KVGroup.from_wire(g) for g in wire.get("groups") or ())
            made = cls(str(wire["model"]), layers, int(wire["block_size"]), KVLayout.from_wire(wire["kv"]),
                       None if axis is None else int(axis), str(wire["quant"]), wire.get("cache_layout"), groups)
            ranges = [list(made.kv.layer_range()), list(made.kv.head_range())]
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise BadRequest(f"not a paged KV layout: {exc!r}") from None
        if [wire.get("layer_range"), wire.get("head_range")] != ranges:
            raise BadRequest(f"paged KV layout: layer/head ranges {wire.get('layer_range')}, "
                             f"{wire.get('head_range')} contradict its KV layout {ranges}")
        return made

    def deployment(self) -> tuple[int, int, tuple[int, ...]]:
        return self.kv.tp_size, self.kv.pp_size, self.kv.layer_partition()


@dataclass(frozen=True)
class ShardRead:
    """One source shard a consumer rank reads, and what it copies out of it."""

    src: KVLayout  # the source shard (its model geometry is the consumer's)
    copies: tuple[tuple[str, int, int, int], ...]  # (layer name, source head, destination head, heads)
    readers: int  # consumer ranks of this instance that read the shard (1: this one consumes it)


def source_layouts(mine: KVLayout, src: SourceDeployment) -> list[KVLayout]:
    """Every shard of the producer's deployment of this model; LayoutMismatch if it cannot exist."""
    try:
        return shard_layouts(mine, src.tp_size, src.pp_size, src.pp_partition)
    except BadRequest as exc:
        raise LayoutMismatch(f"producer deployment tp_size={src.tp_size}, pp_size={src.pp_size}, "
                             f"pp_partition={src.pp_partition!r} cannot hold this model: {exc.message}") from None


def plan_loads(mine: PagedKVLayout, src: SourceDeployment) -> list[ShardRead]:
    """The source shards this rank reads (in (pp, tp) order, the same on every rank), each with its
    per-layer head slices. Raises LayoutMismatch when no plan exists."""
    if src != _as_deployment(mine) and mine.quant not in HEAD_SEPARABLE_QUANT:
        raise LayoutMismatch(f"kv_quant_mode {mine.quant}: its pages do not split by head, so the KV "
                             "moves between identical TP/PP deployments only")
    states = mine.state_layers
    if states and (src.tp_size != mine.tp_size or not is_primary(mine.kv)):
        # each TP rank's Mamba state is its own slice of the model's, cut along no KV-head axis
        raise LayoutMismatch(f"tp_size: a {MAMBA} state moves between equal TP sizes with unreplicated KV "
                             f"heads only (producer tp_size={src.tp_size}, consumer tp_size={mine.tp_size}, "
                             f"{mine.kv.num_kv_heads} KV heads)")
    whole = frozenset(name for name, _, _ in mine.layers) if mine.head_axis is None else states
    return _plan(mine.kv, tuple(name for name, _, _ in mine.layers), whole, src)


@functools.lru_cache(maxsize=256)
def release_keys(mine: KVLayout, src: SourceDeployment, shared_only: bool = False) -> list[tuple[int, int]]:
    """(tp_rank, pp_rank) of every source shard some rank of this instance reads (`shared_only`:
    that several ranks read; a shard one rank reads goes with its read, unless the load failed)."""
    srcs = source_layouts(mine, src)
    dsts = shard_layouts(mine, mine.tp_size, mine.pp_size, mine.pp_partition)
    who = readers(srcs, dsts)
    return sorted((r for r in who if not shared_only or len(who[r]) > 1), key=lambda r: (r[1], r[0]))


def _as_deployment(layout: PagedKVLayout) -> SourceDeployment:
    kv = layout.kv
    return SourceDeployment(kv.tp_size, kv.pp_size, kv.pp_partition)


@functools.lru_cache(maxsize=256)  # the same few deployment pairs, for every request
def _plan(mine: KVLayout, names: tuple[str, ...], whole: frozenset[str], src: SourceDeployment) -> list[ShardRead]:
    """(whole: the layers copied as whole rows: no head axis, or a state)"""
    srcs = source_layouts(mine, src)
    dsts = shard_layouts(mine, mine.tp_size, mine.pp_size, mine.pp_partition)
    count = {src_rank: len(ranks) for src_rank, ranks in readers(srcs, dsts).items()}
    pieces = read_plans(srcs, [mine])[mine.tp_rank, mine.pp_rank]
    by_rank = {(s.tp_rank, s.pp_rank): s for s in srcs}
    index = {name: layer_index(name) for name in names}
    reads: dict[tuple[int, int], list[tuple[str, int, int, int]]] = {}
    for piece in pieces:
        for name in names:
            if piece.layer_start <= index[name] < piece.layer_stop:
                reads.setdefault((piece.src_tp_rank, piece.src_pp_rank), []).append(
                    (name, piece.src_head_offset, piece.dst_head_offset, 0 if name in whole else piece.num_heads))
    return [ShardRead(by_rank[rank], tuple(copies), count[rank])
            for rank, copies in sorted(reads.items(), key=lambda kv: (kv[0][1], kv[0][0]))]


def check_source(mine: PagedKVLayout, producer: PagedKVLayout, read: ShardRead) -> None:
    """Raise LayoutMismatch, naming every differing field, unless `producer` is the shard `read`
    expects and its blocks fit this rank's caches once narrowed to the heads copied."""
    diffs = [f"{what}: producer {getattr(producer, what)!r}, consumer {getattr(mine, what)!r}"
             for what in ("model", "block_size", "head_axis", "quant")
             if getattr(producer, what) != getattr(mine, what)]
    try:
        mine.kv.check_compatible(producer.kv)  # num_layers, num_kv_heads, head_dim, dtype
    except LayoutMismatch as exc:
        diffs.append(exc.message)
    got = (producer.kv.tp_rank, producer.kv.tp_size, producer.kv.pp_rank, producer.kv.pp_size,
           producer.kv.layer_partition())
    want = (read.src.tp_rank, read.src.tp_size, read.src.pp_rank, read.src.pp_size, read.src.layer_partition())
    fields = ("tp_rank", "tp_size", "pp_rank", "pp_size", "layer partition")
    diffs += [f"{f}: producer {a!r}, expected {b!r}" for f, a, b in zip(fields, got, want, strict=True) if a != b]
    theirs = {name: (shape, dtype) for name, shape, dtype in producer.layers}
    ours = {name: (shape, dtype) for name, shape, dtype in mine.layers}
    their_groups = {name: g for g in producer.kv_groups for name in g.layers}
    our_groups = {name: g for g in mine.kv_groups for name in g.layers}
    states = mine.state_layers
    for name, _, _, _ in read.copies:
        axis = None if name in states else mine.head_axis  # (a state is compared whole)
        if name not in theirs:
            diffs.append(f"layers: the producer holds no layer {name!r}")
        elif not their_groups[name].same_cache(our_groups[name]):
            theirs_g, ours_g = their_groups[name], our_groups[name]
            diffs.append(f"layer {name}: producer KV cache group {theirs_g.label} of {theirs_g.block_size}-token "
                         f"blocks, consumer {ours_g.label} of {ours_g.block_size}-token blocks")
        elif _unheaded(theirs[name], axis) != _unheaded(ours[name], axis):
            diffs.append(f"layer {name}: producer block {theirs[name]}, consumer block {ours[name]}")
        if len(diffs) > 6:
            break
    if diffs:
        raise LayoutMismatch("the producer's KV layout differs: " + "; ".join(diffs))


def _unheaded(block: tuple[tuple[int, ...], str], axis: int | None) -> tuple[tuple[int, ...], str]:
    shape, dtype = block
    if axis is None or axis >= len(shape):
        return shape, dtype
    return (*shape[:axis], -1, *shape[axis + 1:]), dtype

