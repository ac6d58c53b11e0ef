"""A worker's side of prefix reuse through kvd's KV tier (engine worker processes; engine-agnostic):
stores the full blocks a step computed, loads a hit's blocks into the ones the engine allocated.

Pages are what `kvd.integrations.paged.tier_pages` names: one block of one KV cache group on one saving
rank, every layer of the group this rank holds laid end to end (`kvd.Parts` of the layers'
block views: one copy each way between the engine's cache and the daemon's pool, no staging).

- Saves run in the engine's thread at the end of the forward step that computed the blocks
  (before the next step may reuse a freed block), one `cache_put` a step for all of them: one
  reservation, the copies, one commit. Only the first holder of each set of KV heads saves.
- Loads run on threads of their own, one `cache_get` per hit; a page that is missing (evicted
  since the lookup, another size) fails the load and its blocks are reported, so the engine
  recomputes them rather than attend to what was in those blocks before.
- A daemon that does not answer is not asked again for `retry_after` seconds: saves are skipped
  and loads fail at once meanwhile, so a dead daemon costs misses, never a stalled step.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ...client import Client
from ...client.cache import Parts
from ...errors import BadRequest, KvdError
from ...parallel.kv_layout import KVLayout
from ...parallel.readers import is_primary
from .groups import KVGroup
from .specs import TransferResults, TransferStats
from .tier_pages import TierLoad, TierSave, page_key, saving_rank

log = logging.getLogger("kvd.paged_kv")


class TierWorker:
    """One engine rank's pages in the tier: its caches, its groups (with this rank's layers of each)."""

    def __init__(self, caches: Mapping[str, torch.Tensor], groups: tuple[KVGroup, ...], kv: KVLayout,
                 namespace: str, *, connect: Callable[[], Client], load_threads: int = 2,
                 retry_after: float = 10.0) -> None:
        self.caches = dict(caches)
        self.groups = groups
        self.namespace = namespace
        self.rank = saving_rank(kv)
        self.saves = is_primary(kv)  # a replica of another rank's heads reads that rank's pages
        self._connect = connect
        self.retry_after = retry_after
        self._down_until = 0.0
        self._client: Client | None = None  # the engine thread's
        self._local = threading.local()
        self._clients: list[Client] = []
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=load_threads, thread_name_prefix="kvd-tier-load")
        self._loads: dict[str, tuple[TierLoad, Future]] = {}
        self.stats = TransferStats()
        # a client maps the whole pool when it connects (~0.1 s a GiB): done now, off the first steps
        self._save_client: Future | None = self._executor.submit(self._connect)
        warm_threads(self._executor, load_threads, self._load_client)

    def _page(self, group: int, block: int) -> Parts | None:
        """One block of every layer of the group this rank holds (None: it holds none)."""
        layers = self.groups[group].layers
        return Parts([self.caches[name][block] for name in layers]) if layers else None

    def _down(self, exc: BaseException) -> None:
        if isinstance(exc, KvdError) and not isinstance(exc, BadRequest):
            self._down_until = time.monotonic() + self.retry_after

    # -- saves (the engine's thread) -------------------------------------------------------
    def save(self, spec: TierSave | None) -> None:
        """Store this step's full blocks; never raises into the engine (a failed save is a later miss)."""
        if spec is None or not spec.pages or not self.saves or time.monotonic() < self._down_until:
            return
        keys, pages = [], []
        for block_hash, group, block in spec.pages:
            page = self._page(group, block)
            if page is not None:
                keys.append(page_key(block_hash, group, self.rank))
                pages.append(page)
        if not keys:
            return
        started = time.monotonic()
        try:
            if self._client is None:
                self._client = self._take_save_client()
            stored = self._client.cache_put(keys, pages, namespace=self.namespace)
        except Exception as exc:
            _discard(self._client)
            self._client = None
            self._down(exc)
            with self._lock:
                self.stats.tier_save_failures += len(keys)
            log.warning("kvd: storing %d prefix pages failed: %s: %s", len(keys), type(exc).__name__, exc)
            return
        with self._lock:
            self.stats.save_seconds.append(time.monotonic() - started)  # (the engine's step waited this long)
            for ok, page in zip(stored, pages, strict=True):
                if ok:
                    self.stats.tier_saves += 1
                    self.stats.tier_saved_bytes += page.nbytes
                else:  # refused: the tier or the pool is full of what it cannot evict
                    self.stats.tier_save_failures += 1

    def _take_save_client(self) -> Client:
        """The client connected at start (once), else a new one."""
        future, self._save_client = self._save_client, None
        if future is not None:
            try:
                return future.result()
            except Exception:
                pass  # (the daemon was not there at start)
        return self._connect()

    # -- loads (threads of their own) ------------------------------------------------------
    def start_load(self, spec: TierLoad) -> None:
        if spec.req_id not in self._loads:
            self._loads[spec.req_id] = (spec, self._executor.submit(self._load, spec))

    def _load_client(self) -> Client:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = self._connect()
            with self._lock:
                self._clients.append(client)
        return client

    def _load(self, spec: TierLoad) -> set[int]:
        """Fill the hit's blocks; returns the blocks that could not be filled (empty: all were)."""
        if time.monotonic() < self._down_until:
            return spec.block_ids()
        keys, outs, blocks = [], [], []
        for block_hash, group, block in spec.pages:
            out = self._page(group, block)
            if out is not None:  # (a group with no layer on this rank has nothing to fill here)
                keys.append(page_key(block_hash, group, self.rank))
                outs.append(out)
                blocks.append(block)
        started = time.monotonic()
        try:
            found = self._load_client().cache_get(keys, outs, namespace=self.namespace) if keys else []
        except Exception as exc:
            self._down(exc)
            client, self._local.client = getattr(self._local, "client", None), None
            with self._lock:
                if client in self._clients:
                    self._clients.remove(client)
            _discard(client)
            log.warning("kvd: loading %d prefix pages of request %s failed: %s: %s", len(keys), spec.req_id,
                        type(exc).__name__, exc)
            return spec.block_ids()
        missing = {block for ok, block in zip(found, blocks, strict=True) if not ok}
        with self._lock:
            self.stats.tier_loaded_bytes += sum(out.nbytes for ok, out in zip(found, outs, strict=True) if ok)
            if missing:
                self.stats.tier_load_failures += 1
            else:
                self.stats.tier_loads += 1
                self.stats.load_seconds.append(time.monotonic() - started)
        if missing:
            log.warning("kvd: %d of %d prefix pages of request %s are gone from the tier (evicted since the "
                        "lookup): those blocks are recomputed", len(missing), len(keys), spec.req_id)
        return missing

    def poll(self) -> TransferResults:
        """Loads that ended since the last poll; a failed one with the blocks it could not fill."""
        results = TransferResults()
        for req_id, (spec, future) in list(self._loads.items()):
            if not future.done():
                continue
            del self._loads[req_id]
            results.finished_loads.add(req_id)
            exc = future.exception()
            if exc is not None:  # (not the daemon's doing: _load catches those)
                log.error("kvd: loading the prefix of request %s failed: %s: %s", req_id, type(exc).__name__, exc)
                with self._lock:
                    self.stats.tier_load_failures += 1
            missing = spec.block_ids() if exc is not None else future.result()
            if missing:
                results.failed_loads.add(req_id)
                results.failed_blocks.update(missing)
        return results

    def take_stats(self) -> TransferStats:
        with self._lock:
            stats, self.stats = self.stats, TransferStats()
        return stats

    def pending_loads(self) -> int:
        return len(self._loads)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        _discard(self._client)
        self._client = None
        if self._save_client is not None and self._save_client.done() and self._save_client.exception() is None:
            _discard(self._save_client.result())
        for client in self._clients:
            _discard(client)
        self._clients.clear()


def warm_threads(executor: ThreadPoolExecutor, threads: int, connect: Callable[[], object]) -> None:
    """Run `connect` once on each of the executor's threads, in the background (each task waits for
    the others, so that every thread takes one); a failure is left for the first real call."""
    barrier = threading.Barrier(threads)

    def warm() -> None:
        try:
            barrier.wait(timeout=30)
            connect()
        except Exception:
            pass
    for _ in range(threads):
        executor.submit(warm)


def _discard(client: Client | None) -> None:
    if client is not None:
        with contextlib.suppress(Exception):
            client.close()
    return None
