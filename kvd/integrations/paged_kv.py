"""Handing a request's blocks of a paged KV cache to kvd and back, in an inference engine's worker
processes.

Engine-agnostic (no vLLM import): the vLLM connector (`kvd.integrations.vllm`) is a thin adapter
over this module, and the tests drive it with real daemons and real paged tensors.

The mapping between a paged cache and a kvd entry:

- One entry per request per tensor-parallel rank, key `f"{request_key}@tp{tp_rank}"`.
- One tensor per attention layer, named by the engine's layer name. A layer's paged cache is a
  tensor whose dim 0 is the block id (`[num_blocks, *block_shape]`; vLLM's CPU backend:
  `[num_blocks, kv_heads, block_size, 2*head_size]`); the entry holds the request's blocks of it, in the
  request's order: `[n_blocks, *block_shape]`, same dtype. Block j holds tokens
  `[j*block_size, (j+1)*block_size)`; slots of the last block past `num_tokens` are unspecified.
- The entry's meta: `{"paged_kv": PagedKVLayout.to_wire(), "num_tokens": n}`. A consumer whose own
  layout differs (model, layers, block shape, dtype, block size, TP size) refuses the entry with a
  LayoutMismatch that lists every difference, and never writes a byte of it into its cache.
- Producer: layers are streamed (`Client.put_stream`): the entry is opened at the request's first
  layer, each layer is gathered (one index_select) and written the moment the engine has computed
  it (with a destination, the daemon is already sending it), and committed at the end of the step.
- Consumer: a background thread fetches the entry (from the local daemon, or pulled from the
  producer's), checks it, and scatters it into the engine's blocks (one index_copy_ per layer).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ..client import Client, PutStream
from ..errors import BadRequest, KvdError, LayoutMismatch, PoolFull
from ..client.paged import Rows, scatter_rows
from ..client.tensors import DTYPE_NAMES

log = logging.getLogger("kvd.paged_kv")

META_KEY = "paged_kv"


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks hold num_tokens tokens."""
    return math.ceil(num_tokens / block_size)


def _discard(client: Client | None) -> None:
    """Close a client we stop using (its zmq context must not be left to the garbage collector)."""
    if client is not None:
        try:
            client.close()
        except Exception:
            pass
    return None


def entry_key(request_key: str, tp_rank: int) -> str:
    return f"{request_key}@tp{tp_rank}"


@dataclass(frozen=True)
class PagedKVLayout:
    """What a consumer must agree on with the producer for the bytes to mean the same attention."""

    model: str  # architecture signature, e.g. "LlamaForCausalLM:layers=32:kv_heads=8:head=128"
    layers: tuple[tuple[str, tuple[int, ...], str], ...]  # (layer name, one block's shape, dtype)
    block_size: int
    tp_size: int = 1
    tp_rank: int = 0

    @classmethod
    def from_caches(cls, caches: Mapping[str, torch.Tensor], *, model: str, block_size: int,
                    tp_size: int = 1, tp_rank: int = 0) -> "PagedKVLayout":
        layers = []
        for name, cache in caches.items():
            if not isinstance(cache, torch.Tensor) or cache.dim() < 2:
                raise BadRequest(f"{name!r}: a paged cache is a tensor [num_blocks, ...]")
            if cache.dtype not in DTYPE_NAMES:
                raise BadRequest(f"{name!r}: dtype {cache.dtype} is not supported")
            layers.append((name, tuple(cache.shape[1:]), DTYPE_NAMES[cache.dtype]))
        if not layers:
            raise BadRequest("no paged caches registered")
        return cls(model, tuple(layers), block_size, tp_size, tp_rank)

    def to_wire(self) -> dict:
        return {"model": self.model, "block_size": self.block_size, "tp_size": self.tp_size,
                "tp_rank": self.tp_rank,
                "layers": [[name, list(shape), dtype] for name, shape, dtype in self.layers]}

    @classmethod
    def from_wire(cls, wire: Any) -> "PagedKVLayout":
        try:
            layers = tuple((str(name), tuple(int(d) for d in shape), str(dtype))
                           for name, shape, dtype in wire["layers"])
            return cls(str(wire["model"]), layers, int(wire["block_size"]), int(wire["tp_size"]),
                       int(wire["tp_rank"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise BadRequest(f"not a paged KV layout: {exc!r}") from None

    def differences(self, producer: "PagedKVLayout") -> list[str]:
        """Every way the producer's layout differs from ours (empty: compatible)."""
        diffs = []
        for what in ("model", "block_size", "tp_size", "tp_rank"):
            mine, theirs = getattr(self, what), getattr(producer, what)
            if mine != theirs:
                diffs.append(f"{what}: producer {theirs!r}, consumer {mine!r}")
        if self.layers != producer.layers:
            mine, theirs = dict((n, (s, d)) for n, s, d in self.layers), dict((n, (s, d)) for n, s, d in producer.layers)
            if mine.keys() != theirs.keys():
                diffs.append(f"layers: producer has {len(theirs)} ({', '.join(sorted(set(theirs) - set(mine))[:3]) or '-'} "
                             f"not here), consumer {len(mine)} ({', '.join(sorted(set(mine) - set(theirs))[:3]) or '-'} "
                             f"not there)")
            for name in sorted(mine.keys() & theirs.keys()):
                if mine[name] != theirs[name]:
                    diffs.append(f"layer {name}: producer block {theirs[name]}, consumer block {mine[name]}")
                    break
        return diffs


@dataclass
class SaveSpec:
    """Hand off the first num_tokens of a request whose prompt completes in this step."""

    req_id: str
    request_key: str
    block_ids: list[int]
    num_tokens: int
    dest: str | None = None


@dataclass
class LoadSpec:
    """Fill a request's blocks [first_block, len(block_ids)) from the entry (the first blocks are
    already computed locally, e.g. a prefix-cache hit)."""

    req_id: str
    request_key: str
    block_ids: list[int]
    num_tokens: int
    first_block: int = 0
    source: str | None = None


@dataclass
class TransferResults:
    finished_loads: set[str] = field(default_factory=set)
    failed_loads: set[str] = field(default_factory=set)
    failed_blocks: set[int] = field(default_factory=set)


@dataclass
class TransferStats:
    """What one worker moved since the last take: counters and each load's duration."""

    saves: int = 0
    save_failures: int = 0
    saved_bytes: int = 0
    loads: int = 0
    load_failures: int = 0
    loaded_bytes: int = 0
    load_seconds: list[float] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.saves or self.save_failures or self.loads or self.load_failures)


class PagedKVWorker:
    """One engine worker's (one TP rank's) side: streams saves, runs loads in the background."""

    def __init__(self, caches: Mapping[str, torch.Tensor], layout: PagedKVLayout, *,
                 connect: Callable[[], Client], ttl: float = 300.0, load_timeout: float = 30.0,
                 load_threads: int = 4, retry_after: float = 10.0) -> None:
        self.caches = dict(caches)
        self.layout = layout
        self._connect = connect
        self.ttl, self.load_timeout = ttl, load_timeout
        self._client: Client | None = None  # the engine thread's (saves)
        self._streams: dict[str, tuple[PutStream, set[str]]] = {}  # req id -> (stream, layers written)
        self._failed_saves: set[str] = set()
        # an unreachable daemon must not stall every forward step: after a connection failure,
        # saves fail at once (the consumer recomputes) until retry_after has passed
        self.retry_after = retry_after
        self._down_until = 0.0
        self._loads: dict[str, tuple[LoadSpec, Future]] = {}
        self._executor = ThreadPoolExecutor(max_workers=load_threads, thread_name_prefix="kvd-load")
        self._local = threading.local()  # one client per load thread
        self._load_clients: list[Client] = []  # the same, for close()
        self._layer_names = [name for name, _, _ in layout.layers]
        self._stats = TransferStats()
        self._stats_lock = threading.Lock()  # loads finish on their own threads

    # -- saves (engine thread) -------------------------------------------------------------
    def _save_client(self) -> Client:
        if self._client is None:
            self._client = self._connect()
        return self._client

    def save_layer(self, specs: list[SaveSpec], layer_name: str, kv_layer: torch.Tensor) -> None:
        """Gather this layer's blocks of each request and write them into its stream now."""
        for spec in specs:
            if spec.req_id in self._failed_saves:
                continue
            if time.monotonic() < self._down_until:
                self._failed_saves.add(spec.req_id)
                continue
            try:
                stream, written = self._streams.get(spec.req_id) or self._open(spec)
                stream.write({layer_name: Rows(kv_layer, spec.block_ids)})  # one gather into the pool
                written.add(layer_name)
                self._stats.saved_bytes += len(spec.block_ids) * kv_layer[0].numel() * kv_layer.element_size()
            except Exception as exc:  # never into the engine: the consumer recomputes instead
                self._fail_save(spec.req_id, exc)

    def _open(self, spec: SaveSpec) -> tuple[PutStream, set[str]]:
        n = len(spec.block_ids)
        if n != blocks_for(spec.num_tokens, self.layout.block_size):
            raise BadRequest(f"{len(spec.block_ids)} blocks for {spec.num_tokens} tokens of "
                             f"{self.layout.block_size}")
        shapes = {name: ((n, *shape), self.caches[name].dtype) for name, shape, _ in self.layout.layers}
        stream = self._save_client().put_stream(
            entry_key(spec.request_key, self.layout.tp_rank), shapes, dest=spec.dest, ttl=self.ttl,
            meta={META_KEY: self.layout.to_wire(), "num_tokens": spec.num_tokens})
        self._streams[spec.req_id] = (stream, set())
        return self._streams[spec.req_id]

    def finish_saves(self) -> set[str]:
        """Commit every stream opened this step; returns the request ids whose save failed."""
        streams, self._streams = self._streams, {}
        for req_id, (stream, written) in streams.items():
            try:
                missing = [name for name in self._layer_names if name not in written]
                if missing:  # an entry with unwritten layers would hand over garbage
                    raise BadRequest(f"layers never saved in this step: {missing[:3]}")
                stream.commit()
                self._stats.saves += 1
            except Exception as exc:
                self._fail_save(req_id, exc, stream)
        failed, self._failed_saves = self._failed_saves, set()
        self._stats.save_failures += len(failed)
        return failed

    def _fail_save(self, req_id: str, exc: BaseException, stream: PutStream | None = None) -> None:
        self._failed_saves.add(req_id)
        if isinstance(exc, KvdError) and not isinstance(exc, (BadRequest, PoolFull)):
            self._client = _discard(self._client)  # gone or stuck: reconnect, not before retry_after
            self._down_until = time.monotonic() + self.retry_after
            log.error("kvd: saving the KV of request %s failed: %s; saves skipped for %gs", req_id, exc,
                      self.retry_after)
            return
        log.error("kvd: saving the KV of request %s failed: %s", req_id, exc)
        entry = self._streams.pop(req_id, None)
        stream = stream or (entry[0] if entry else None)
        if stream is not None:
            try:
                stream.abort()
            except Exception:
                self._client = _discard(self._client)  # the connection is in an unknown state

    # -- loads (background threads) --------------------------------------------------------
    def start_load(self, spec: LoadSpec) -> None:
        if spec.req_id not in self._loads:
            self._loads[spec.req_id] = (spec, self._executor.submit(self._load, spec))

    def _load_client(self) -> Client:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = self._connect()
            with self._stats_lock:
                self._load_clients.append(client)
        return client

    def _drop_load_client(self) -> None:
        client, self._local.client = getattr(self._local, "client", None), None
        if client is not None:
            with self._stats_lock:
                if client in self._load_clients:
                    self._load_clients.remove(client)
            _discard(client)

    def _load(self, spec: LoadSpec) -> None:
        started = time.monotonic()
        key = entry_key(spec.request_key, self.layout.tp_rank)
        try:
            tensors, meta = self._load_client().get(key, source=spec.source, timeout=self.load_timeout,
                                                    with_meta=True)
        except Exception:
            self._drop_load_client()  # the connection is in an unknown state: start afresh
            raise
        self.check_entry(key, tensors, meta, spec)
        ids = torch.as_tensor(spec.block_ids[spec.first_block:], dtype=torch.long)
        loaded = 0
        for name, cache in self.caches.items():
            rows = tensors[name][spec.first_block:len(spec.block_ids)]
            scatter_rows(cache, ids.to(cache.device), rows)
            loaded += rows.numel() * rows.element_size()
        with self._stats_lock:
            self._stats.loads += 1
            self._stats.loaded_bytes += loaded
            self._stats.load_seconds.append(time.monotonic() - started)

    def check_entry(self, key: str, tensors: Mapping[str, torch.Tensor], meta: Any, spec: LoadSpec) -> None:
        """Raise LayoutMismatch unless the entry is exactly what this worker's blocks can take."""
        if not isinstance(meta, dict) or META_KEY not in meta:
            raise LayoutMismatch(f"{key}: not a paged KV entry (no {META_KEY!r} in its meta)")
        diffs = self.layout.differences(PagedKVLayout.from_wire(meta[META_KEY]))
        if diffs:
            raise LayoutMismatch(f"{key}: the producer's KV layout differs: " + "; ".join(diffs))
        have = int(meta.get("num_tokens", -1))
        if have < spec.num_tokens or len(spec.block_ids) > blocks_for(have, self.layout.block_size):
            raise LayoutMismatch(f"{key}: holds {have} tokens, {spec.num_tokens} were expected")
        for name, cache in self.caches.items():
            tensor = tensors.get(name)
            if tensor is None or tuple(tensor.shape[1:]) != tuple(cache.shape[1:]) or tensor.dtype != cache.dtype:
                raise LayoutMismatch(f"{key}: layer {name} does not fit the paged cache")

    def poll(self) -> TransferResults:
        """Loads that ended since the last poll: finished ones, and which of them failed (their
        blocks are reported so the engine recomputes them rather than attend to garbage)."""
        results = TransferResults()
        for req_id, (spec, future) in list(self._loads.items()):
            if not future.done():
                continue
            del self._loads[req_id]
            results.finished_loads.add(req_id)
            exc = future.exception()
            if exc is not None:
                with self._stats_lock:
                    self._stats.load_failures += 1
                log.error("kvd: loading the KV of request %s failed: %s", req_id, exc)
                results.failed_loads.add(req_id)
                results.failed_blocks.update(spec.block_ids[spec.first_block:])
        return results

    def take_stats(self) -> TransferStats:
        """The counters since the last call (then reset)."""
        with self._stats_lock:
            stats, self._stats = self._stats, TransferStats()
        return stats

    def pending_loads(self) -> int:
        return len(self._loads)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        for req_id in list(self._streams):
            self._fail_save(req_id, RuntimeError("worker shutting down"))
        self._client = _discard(self._client)
        for client in self._load_clients:
            _discard(client)
        self._load_clients.clear()
