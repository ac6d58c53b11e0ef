"""Handing a request's blocks of a paged KV cache to kvd and back, in an inference engine's worker
processes, between instances of any TP x PP layout.

Engine-agnostic (no vLLM import): the vLLM connector (`kvd.integrations.vllm`) is a thin adapter
over this module, and the tests drive it with real daemons and real paged tensors. What an entry
holds and which entries a rank reads is in `kvd.integrations.paged.plans`, which blocks of each KV
cache group move in `kvd.integrations.paged.groups` (both pure).

- Producer: each rank that is the first holder of its KV heads (replicas of the same heads, and
  every rank but 0 of an MLA-style cache, save nothing) streams one entry per request,
  `shard_key(request_key, tp_rank, pp_rank)` = `"{request_key}@tp{t}.pp{p}"`: one tensor per
  layer of its stage, named by the engine's layer name, `[n_blocks, *block_shape]`
  (vLLM's CPU backend: `[n, kv_heads, block_size, 2*head_size]`), the blocks its group keeps of the
  request in order (a window's, a Mamba state's last); slots of the last block past `num_tokens`
  are unspecified. Each attention layer is gathered (one index_select) into the stream the moment
  the engine has computed it (with a destination, the daemon is already sending it); state
  layers (Mamba), final only once the forward is over, are gathered then; the step commits. Meta:
  `{"paged_kv": PagedKVLayout.to_wire(), "num_tokens": n}`, and with several KV cache groups
  `"first_blocks"`: each group's first block kept.
- Consumer: a background thread plans the source shards its rank needs (`plan_loads`, from the
  producer's deployment), leases them all, checks each one's layout (a LayoutMismatch naming the
  field refuses the load before a byte is written) and scatters exactly its head slice of each
  layer into the engine's blocks (one index_copy_ per slice, straight from the pool), group by
  group, each into the blocks the group's own table gives. A shard only this rank reads is
  consumed by the read; one that several ranks read stays (pulled ones move here) until the engine
  reports every rank done and the connector releases it (`release_keys`).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ...client import Client, PutStream
from ...client.blocks import Rows
from ...client.reshard import HeadSlice, ShardFetch, scatter_shards
from ...errors import BadRequest, KvdError, LayoutMismatch, NotFound, PoolFull, Timeout
from ...parallel.readers import is_primary
from .groups import GroupRead, blocks_for, check_entry_blocks, group_reads, per_group
from .plans import PagedKVLayout, ShardRead, SourceDeployment, check_source, plan_loads
from .specs import META_KEY, LoadSpec, SaveSpec, TransferResults, TransferStats, entry_key

log = logging.getLogger("kvd.paged_kv")

# why a load by request id alone most often finds nothing: this node's daemon cannot ask a registry
DIRECTORY_HINT = (" (its shards are listed in the prefill's cluster registry: this node's daemon finds them "
                  "only if it runs with --registry and --cluster of the same cluster)")
MAX_COMMITS_IN_FLIGHT = 2  # steps whose pushes are being delivered while the engine goes on
__all__ = ["META_KEY", "LoadSpec", "PagedKVLayout", "PagedKVWorker", "SaveSpec", "SourceDeployment", "TransferResults",
           "TransferStats", "blocks_for", "entry_key"]


def _discard(client: Client | None) -> None:
    """Close a client we stop using (its zmq context must not be left to the garbage collector)."""
    if client is not None:
        with contextlib.suppress(Exception):
            client.close()
    return None


class PagedKVWorker:
    """One engine worker's (one TP x PP rank's) side: streams saves, runs loads in the background."""

    def __init__(self, caches: Mapping[str, torch.Tensor], layout: PagedKVLayout, *,
                 connect: Callable[[], Client], ttl: float = 300.0, load_timeout: float = 30.0,
                 load_threads: int = 4, retry_after: float = 10.0, commit_in_background: bool = False) -> None:
        self.caches = dict(caches)
        self.layout = layout
        self._connect = connect
        self.ttl, self.load_timeout = ttl, load_timeout
        self._client: Client | None = None  # the engine thread's (saves)
        self._streams: dict[str, tuple[PutStream, set[str], list[str]]] = {}  # req id -> (stream, written, expected)
        self._failed_saves: set[str] = set()
        # an unreachable daemon must not stall every forward step: after a connection failure,
        # saves fail at once (the consumer recomputes) until retry_after has passed
        self.retry_after = retry_after
        self._down_until = 0.0
        self._loads: dict[str, tuple[LoadSpec, Future]] = {}
        self._executor = ThreadPoolExecutor(max_workers=load_threads, thread_name_prefix="kvd-load")
        self._local = threading.local()  # one client per load thread
        self._load_clients: list[Client] = []  # the same, for close()
        self.groups = layout.kv_groups
        self._group_of = {name: index for index, group in enumerate(self.groups) for name in group.layers}
        # a state (Mamba) is final only after the forward: saved by finish_saves, not per layer
        self._states = [name for name, _, _ in layout.layers if name in layout.state_layers]
        # a replica of heads another rank holds (and ranks > 0 of an MLA-style cache) saves nothing
        self.saves_shard = is_primary(layout.kv)
        self._stats = TransferStats()
        self._stats_lock = threading.Lock()  # loads finish on their own threads
        # a push's commit returns once the peer has the entry: off the engine's thread, the step
        # ends when its blocks are in the pool (copied at each write) and the next one's streams
        # open on another connection while the last step's commits wait for their delivery
        self.commit_in_background = commit_in_background
        self._commits: list[tuple[Future, Client]] = []  # in flight, oldest first, on their connection
        self._spare: list[Client] = []  # connections whose commits are done
        self._committer: ThreadPoolExecutor | None = None
        self._step_saving: float | None = None  # seconds in save_layer during the step under way, if it saved

    # -- saves (engine thread) -------------------------------------------------------------
    def _save_client(self) -> Client:
        if self._client is None:
            self._reap_commits(wait=len(self._commits) >= MAX_COMMITS_IN_FLIGHT)
            self._client = self._spare.pop() if self._spare else self._connect()
        return self._client

    def save_layer(self, specs: list[SaveSpec], layer_name: str, kv_layer: torch.Tensor) -> None:
        """Gather this layer's blocks of each request and write them into its stream now."""
        if not self.saves_shard or not specs:
            return
        started = time.monotonic()
        try:
            self._save_layer(specs, layer_name, kv_layer)
        finally:
            self._step_saving = (self._step_saving or 0.0) + time.monotonic() - started

    def _save_layer(self, specs: list[SaveSpec], layer_name: str, kv_layer: torch.Tensor) -> None:
        group = self._group_of[layer_name]
        for spec in specs:
            if spec.req_id in self._failed_saves:
                continue
            if time.monotonic() < self._down_until:
                self._failed_saves.add(spec.req_id)
                continue
            rows = spec.block_ids[group][spec.first_block[group]:]
            if not rows:
                continue  # decode keeps none of this group's blocks (a window that starts past the prompt)
            try:
                stream, written, _ = self._streams.get(spec.req_id) or self._open(spec)
                stream.write({layer_name: Rows(kv_layer, rows)})  # one gather into the pool
                written.add(layer_name)
                nbytes = len(rows) * kv_layer[0].numel() * kv_layer.element_size()
                with self._stats_lock:  # take_stats() swaps the counters from another thread
                    self._stats.saved_bytes += nbytes
                    self._stats.count(self._stats.saved_by_kind, self.groups[group].kind, nbytes)
            except Exception as exc:  # never into the engine: the consumer recomputes instead
                self._fail_save(spec.req_id, exc)

    def _open(self, spec: SaveSpec) -> tuple[PutStream, set[str], list[str]]:
        if len(spec.block_ids) != len(self.groups):
            raise BadRequest(f"block tables for {len(spec.block_ids)} KV cache groups, the model has "
                             f"{len(self.groups)}")
        rows = []
        for group, table, first in zip(self.groups, spec.block_ids, spec.first_block, strict=True):
            if len(table) != blocks_for(spec.num_tokens, group.block_size):
                raise BadRequest(f"{len(table)} blocks for {spec.num_tokens} tokens of {group.block_size}")
            rows.append(len(table) - first)
        shapes = {name: ((rows[self._group_of[name]], *shape), self.caches[name].dtype)
                  for name, shape, _ in self.layout.layers if rows[self._group_of[name]]}
        meta: dict[str, Any] = {META_KEY: self.layout.to_wire(), "num_tokens": spec.num_tokens}
        if self.layout.groups:
            meta["first_blocks"] = list(spec.first_block)
        stream = self._save_client().put_stream(
            entry_key(spec.request_key, self.layout.kv.tp_rank, self.layout.kv.pp_rank), shapes, dest=spec.dest,
            ttl=self.ttl, meta=meta)
        self._streams[spec.req_id] = (stream, set(), list(shapes))
        return self._streams[spec.req_id]

    def finish_saves(self, specs: Sequence[SaveSpec] = ()) -> set[str]:
        """Save the state layers of `specs` (the forward is over) and commit every stream opened this
        step; returns the request ids whose save failed."""
        started = time.monotonic()
        try:
            return self._finish_saves(specs)
        finally:
            saving, self._step_saving = self._step_saving, None
            if saving is not None or specs:
                with self._stats_lock:
                    self._stats.save_seconds.append((saving or 0.0) + time.monotonic() - started)

    def _finish_saves(self, specs: Sequence[SaveSpec]) -> set[str]:
        for name in self._states:
            self.save_layer(list(specs), name, self.caches[name])
        streams, self._streams = self._streams, {}
        ready: dict[str, PutStream] = {}
        for req_id, (stream, written, expected) in streams.items():
            missing = [name for name in expected if name not in written]
            if missing:  # an entry with unwritten layers would hand over garbage
                self._fail_save(req_id, BadRequest(f"layers never saved in this step: {missing[:3]}"), stream)
            else:
                ready[req_id] = stream
        if ready and self.commit_in_background and self._client is not None:
            if self._committer is None:
                self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvd-commit")
            client, self._client = self._client, None  # the next step's streams open on another
            self._commits.append((self._committer.submit(self._commit_all, ready), client))
            self._reap_commits(wait=False)
        else:
            for req_id, stream in ready.items():
                try:
                    stream.commit()
                    self._stats.saves += 1
                except Exception as exc:
                    self._fail_save(req_id, exc, stream)
        failed, self._failed_saves = self._failed_saves, set()
        self._stats.save_failures += len(failed)
        return failed

    def _commit_all(self, streams: dict[str, PutStream]) -> bool:
        """(The committer's thread) commit one step's streams, in order; False: their connection
        failed and is not to be used again."""
        healthy = True
        for req_id, stream in streams.items():
            try:
                stream.commit()
                with self._stats_lock:
                    self._stats.saves += 1
            except Exception as exc:  # the consumer recomputes (its load times out)
                log.error("kvd: saving the KV of request %s failed: %s", req_id, exc)
                with self._stats_lock:
                    self._stats.save_failures += 1
                if isinstance(exc, KvdError) and not isinstance(exc, (BadRequest, PoolFull)):
                    healthy = False
                    self._down_until = time.monotonic() + self.retry_after
                else:
                    try:
                        stream.abort()
                    except Exception:
                        healthy = False
        return healthy

    def _reap_commits(self, wait: bool) -> None:
        """Take back the connections whose commits are done (with wait, the oldest's too)."""
        while self._commits and (self._commits[0][0].done() or wait):
            future, client = self._commits.pop(0)
            wait = False
            if future.exception() is None and future.result():
                self._spare.append(client)
            else:
                _discard(client)

    def flush_commits(self) -> None:
        """Wait until every commit handed to the background has ended."""
        while self._commits:
            self._reap_commits(wait=True)

    def _fail_save(self, req_id: str, exc: BaseException, stream: PutStream | None = None) -> None:
        self._failed_saves.add(req_id)
        if isinstance(exc, KvdError) and not isinstance(exc, (BadRequest, PoolFull)):
            _discard(self._client)  # gone or stuck: reconnect, not before retry_after
            self._client = None
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
                _discard(self._client)  # the connection is in an unknown state
                self._client = None

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
        deadline = started + self.load_timeout
        reads = plan_loads(self.layout, spec.producer)  # LayoutMismatch before anything is fetched
        groups = group_reads(self.groups, spec.block_ids, spec.first_blocks, spec.num_tokens)
        # one scatter per group (each its own blocks and rows), every shard leased and checked in
        # each: the first checks all of every shard before a byte is copied; the last consumes
        calls: list[GroupRead | None] = list(groups) or [None]
        loaded = 0
        try:
            for i, call in enumerate(calls):
                last = i == len(calls) - 1
                fetches = [ShardFetch(entry_key(spec.request_key, r.src.tp_rank, r.src.pp_rank),
                                      self._planner(r, spec, groups, call), consume=last and r.readers == 1,
                                      move=True) for r in reads]
                copied = scatter_shards(self._load_client(), fetches, call.block_ids if call else [],
                                        rows=call.rows if call else (0, 0), source=spec.source,
                                        timeout=max(0.0, deadline - time.monotonic()),
                                        head_axis=1 + (self.layout.head_axis or 0))
                loaded += copied
                if call is not None:
                    with self._stats_lock:
                        self._stats.count(self._stats.loaded_by_kind, self.groups[call.group].kind, copied)
        except LayoutMismatch:
            raise  # (the connection is fine: the leases were given back)
        except Exception:
            self._drop_load_client()  # the connection is in an unknown state: start afresh
            raise
        with self._stats_lock:
            self._stats.loads += 1
            self._stats.loaded_bytes += loaded
            self._stats.load_seconds.append(time.monotonic() - started)

    def _planner(self, read: ShardRead, spec: LoadSpec, groups: list[GroupRead],
                 call: GroupRead | None) -> Callable[[Any, Any], list[HeadSlice]]:
        """The check of one source entry, run once its lease is held and before any copy: all of
        it (every group), whichever group `call` copies."""
        names = [name for name, _, _, _ in read.copies]

        def plan(meta: Any, specs: Any) -> list[HeadSlice]:
            key = entry_key(spec.request_key, read.src.tp_rank, read.src.pp_rank)
            if not isinstance(meta, dict) or META_KEY not in meta:
                raise LayoutMismatch(f"{key}: not a paged KV entry (no {META_KEY!r} in its meta)")
            try:
                producer = PagedKVLayout.from_wire(meta[META_KEY])
                check_source(self.layout, producer, read)
                have = meta.get("num_tokens")
                if not isinstance(have, int) or have < spec.num_tokens or any(
                        len(table) > blocks_for(have, group.block_size)
                        for group, table in zip(self.groups, spec.block_ids, strict=True)):
                    raise LayoutMismatch(f"holds {have} tokens, {spec.num_tokens} were expected")
                first = per_group(meta.get("first_blocks", ()), len(producer.kv_groups), "first_blocks")
            except (LayoutMismatch, BadRequest) as exc:
                raise LayoutMismatch(f"{key}: {exc.message}") from None
            problems = check_entry_blocks(self.groups, groups, spec.num_tokens, producer.kv_groups, first, have,
                                          names)
            if problems:
                raise LayoutMismatch(f"{key}: the producer's blocks differ: " + "; ".join(problems))
            wanted = set(call.layers) if call is not None else set()
            return [HeadSlice(name, self.caches[name], src_head, dst_head, heads or None)
                    for name, src_head, dst_head, heads in read.copies if name in wanted]
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
                results.failed_blocks.update(spec.filled_blocks())
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
        self.flush_commits()
        if self._committer is not None:
            self._committer.shutdown(wait=True)
        _discard(self._client)
        self._client = None
        for client in self._spare:
            _discard(client)
        self._spare.clear()
        for client in self._load_clients:
            _discard(client)
        self._load_clients.clear()
