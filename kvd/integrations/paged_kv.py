"""Handing a request's blocks of a paged KV cache to kvd and back, in an inference engine's worker
processes, between instances of any TP x PP layout.

Engine-agnostic (no vLLM import): the vLLM connector (`kvd.integrations.vllm`) is a thin adapter
over this module, and the tests drive it with real daemons and real paged tensors. What an entry
holds and which entries a rank reads is in `kvd.integrations.paged_layout` (pure).

- Producer: each rank that is the first holder of its KV heads (replicas of the same heads, and
  every rank but 0 of an MLA-style cache, save nothing) streams one entry per request,
  `shard_key(request_key, tp_rank, pp_rank)` = `"{request_key}@tp{t}.pp{p}"`: one tensor per
  attention layer of its stage, named by the engine's layer name, `[n_blocks, *block_shape]`
  (vLLM's CPU backend: `[n, kv_heads, block_size, 2*head_size]`), the request's blocks in order;
  slots of the last block past `num_tokens` are unspecified. Each layer is gathered (one
  index_select) into the stream the moment the engine has computed it (with a destination, the
  daemon is already sending it); the step commits. Meta: `{"paged_kv": PagedKVLayout.to_wire(),
  "num_tokens": n}`.
- Consumer: a background thread plans the source shards its rank needs (`plan_loads`, from the
  producer's deployment), leases them all, checks each one's layout (a LayoutMismatch naming the
  field refuses the load before a byte is written) and scatters exactly its head slice of each
  layer into the engine's blocks (one index_copy_ per slice, straight from the pool). A shard only
  this rank reads is consumed by the read; one that several ranks read stays (pulled ones move
  here) until the engine reports every rank done and the connector releases it (`release_keys`).
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
from ..client.paged import Rows
from ..client.sharded import HeadSlice, ShardFetch, scatter_shards, shard_key
from ..errors import BadRequest, KvdError, LayoutMismatch, NotFound, PoolFull, Timeout
from ..parallel.readers import is_primary
from .paged_layout import PagedKVLayout, ShardRead, SourceDeployment, check_source, plan_loads

log = logging.getLogger("kvd.paged_kv")

META_KEY = "paged_kv"
# why a load by request id alone most often finds nothing: this node's daemon cannot ask a registry
DIRECTORY_HINT = (" (its shards are listed in the prefill's cluster registry: this node's daemon finds them "
                  "only if it runs with --registry and --cluster of the same cluster)")
__all__ = ["LoadSpec", "PagedKVLayout", "PagedKVWorker", "SaveSpec", "SourceDeployment", "blocks_for", "entry_key"]


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


def entry_key(request_key: str, tp_rank: int, pp_rank: int = 0) -> str:
    """The entry of one producer rank's shard of a request."""
    return shard_key(request_key, tp_rank, pp_rank)


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
    source: str | None = None  # None: here (pushed), or wherever the cluster registry says
    src: SourceDeployment = field(default_factory=SourceDeployment)  # the producer's TP/PP
    directory: bool = False  # the producer listed its shards in a cluster registry (for the log)


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
    """One engine worker's (one TP x PP rank's) side: streams saves, runs loads in the background."""

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
        # a replica of heads another rank holds (and ranks > 0 of an MLA-style cache) saves nothing
        self.saves_shard = is_primary(layout.kv)
        self._stats = TransferStats()
        self._stats_lock = threading.Lock()  # loads finish on their own threads

    # -- saves (engine thread) -------------------------------------------------------------
    def _save_client(self) -> Client:
        if self._client is None:
            self._client = self._connect()
        return self._client

    def save_layer(self, specs: list[SaveSpec], layer_name: str, kv_layer: torch.Tensor) -> None:
        """Gather this layer's blocks of each request and write them into its stream now."""
        if not self.saves_shard:
            return
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
            entry_key(spec.request_key, self.layout.kv.tp_rank, self.layout.kv.pp_rank), shapes, dest=spec.dest, ttl=self.ttl,
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
        reads = plan_loads(self.layout, spec.src)  # LayoutMismatch before anything is fetched
        fetches = [ShardFetch(entry_key(spec.request_key, r.src.tp_rank, r.src.pp_rank),
                              self._planner(r, spec), consume=r.readers == 1, move=True) for r in reads]
        try:
            loaded = scatter_shards(self._load_client(), fetches, spec.block_ids[spec.first_block:],
                                    rows=(spec.first_block, len(spec.block_ids)), source=spec.source,
                                    timeout=self.load_timeout, head_axis=1 + (self.layout.head_axis or 0))
        except LayoutMismatch:
            raise  # (the connection is fine: the leases were given back)
        except Exception:
            self._drop_load_client()  # the connection is in an unknown state: start afresh
            raise
        with self._stats_lock:
            self._stats.loads += 1
            self._stats.loaded_bytes += loaded
            self._stats.load_seconds.append(time.monotonic() - started)

    def _planner(self, read: ShardRead, spec: LoadSpec) -> Callable[[Any, Any], list[HeadSlice]]:
        """The check of one source entry, run once its lease is held and before any copy."""
        def plan(meta: Any, specs: Any) -> list[HeadSlice]:
            key = entry_key(spec.request_key, read.src.tp_rank, read.src.pp_rank)
            if not isinstance(meta, dict) or META_KEY not in meta:
                raise LayoutMismatch(f"{key}: not a paged KV entry (no {META_KEY!r} in its meta)")
            try:
                check_source(self.layout, PagedKVLayout.from_wire(meta[META_KEY]), read)
            except (LayoutMismatch, BadRequest) as exc:
                raise LayoutMismatch(f"{key}: {exc.message}") from None
            have = meta.get("num_tokens")
            if not isinstance(have, int) or have < spec.num_tokens or \
                    len(spec.block_ids) > blocks_for(have, self.layout.block_size):
                raise LayoutMismatch(f"{key}: holds {have} tokens, {spec.num_tokens} were expected")
            return [HeadSlice(name, self.caches[name], src_head, dst_head, heads or None)
                    for name, src_head, dst_head, heads in read.copies]
        return plan

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
                log.error("kvd: loading the KV of request %s failed: %s: %s%s", req_id, type(exc).__name__, exc,
                          DIRECTORY_HINT if spec.directory and isinstance(exc, (Timeout, NotFound)) else "")
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
