"""KvdHiCacheStorage: kvd's KV tier as SGLang's HiCache L3 storage backend (SGLang's scheduler process).

SGLang builds it through `--hicache-storage-backend dynamic` with
`{"backend_name": "kvd", "module_path": "kvd.integrations.sglang", "class_name": "KvdHiCacheStorage",
"interface_v1": 1}` in the extra config, as `cls(storage_config, kwargs)`, then hands it the host
pool (`register_mem_pool_host`). Its prefetch threads call `batch_exists` then `batch_get_v1`, its
backup thread `batch_set_v1` (the zero-copy path, chosen by `interface_v1`); without
`interface_v1` SGLang uses the generic `batch_get`/`batch_set` of flat page tensors instead.

Pages go to the local daemon (`kvd_socket`) under one namespace per model shard, page format and
tenant (`naming.py`); the daemon owns them, so they outlive this engine and are shared with every
other instance of the same namespace. Memory: SGLang owns the host pool; a get writes into it
during the call only, a put reads from it during the call only; nothing is kept after.

Nothing raises into SGLang's threads and nothing returns None where SGLang expects a list: a
daemon that is down, full or slow answers misses and Falses (`guard.py`).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

import kvd

from . import naming
from .guard import Guard
from .pages import HostPages
from .settings import Settings

log = logging.getLogger("kvd.sglang")
T = TypeVar("T")
UNREGISTERED = "flat"  # the page format before a host pool is registered: flat tensors as given


class KvdHiCacheStorage(HiCacheStorage):
    """SGLang's L3 storage on kvd's KV tier; see the module docstring for who calls what."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.settings = Settings.from_extra(storage_config.extra_config)
        self.rank = naming.RankIdentity.of(storage_config)
        # MLA: the latent KV is the same on every TP rank, and one rank writes it (SGLang's rule)
        self.is_writer = bool(storage_config.is_storage_writer)
        self.guard = Guard()
        self.host_pages: HostPages | None = None
        self.namespace = naming.namespace(self.rank, UNREGISTERED, self.settings.salt)
        self._local = threading.local()  # one client per SGLang thread: prefetch and backup do not queue
        self._clients: list[kvd.Client] = []
        self._clients_lock = threading.Lock()
        self._closed = False
        self._metrics_on = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._metrics: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                          "backup_bandwidth": []}
        self._metrics_lock = threading.Lock()

    # --- SGLang's registration and lifecycle

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pages = HostPages(mem_pool_host)
        self.host_pages = pages
        self.namespace = naming.namespace(self.rank, naming.page_format(pages.layout, pages.dtype, pages.shape),
                                          self.settings.salt)
        log.info("kvd HiCache storage: namespace %r, pages of %d bytes (%s), %s, %s", self.namespace, pages.nbytes,
                 pages.layout, "one copy each way (views of the host pool)" if pages.zero_copy
                 else "two copies each way (this host pool gives no page views)",
                 "writer" if self.is_writer else "reader only (MLA: another rank writes)")

    def close(self) -> None:
        self._closed = True
        with self._clients_lock:
            clients, self._clients = self._clients, []
        for client in clients:
            with contextlib.suppress(Exception):  # (closing is best effort: the daemon may be gone)
                client.close()

    def clear(self) -> bool:
        """Drop this rank's namespace from the tier (every instance sharing it loses it too)."""
        return self._call("clear", lambda c: c.cache_clear(self.namespace) >= 0, False)

    def get_stats(self):
        """SGLang's StorageMetrics of the calls since the last get_stats (None while metrics are
        off, or without SGLang's metrics module, as on a CPU-only machine without torchvision)."""
        if not self._metrics_on:
            return None
        with self._metrics_lock:
            taken = {k: v[:] for k, v in self._metrics.items()}
            for v in self._metrics.values():
                v.clear()
        metrics_class = _storage_metrics_class()
        return metrics_class(**taken) if metrics_class is not None else None

    def tier_stats(self) -> dict:
        """The daemon's counters for this namespace (hits, misses, evictions, entries, bytes, budget);
        {} when the daemon does not answer."""
        return self._call("stats", lambda c: c.cache_stats(self.namespace), {})

    # --- the zero-copy path (interface_v1): pages straight between the host pool and kvd's pool

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        if not keys:
            return 0
        return self._call("batch_exists", lambda c: c.cache_exists(keys, namespace=self.namespace), 0)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        misses = [False] * len(keys)
        if not keys:
            return []

        def get(client: kvd.Client) -> list[bool]:
            pages = self._pages()
            outs, land = pages.targets(pages.starts(len(keys), host_indices))
            started = time.perf_counter()
            found = client.cache_get(keys, outs, namespace=self.namespace)
            land(found)
            self._record("prefetch", sum(found), time.perf_counter() - started)
            return found

        return self._call("batch_get_v1", get, misses)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if not keys:
            return []
        if not self.is_writer:
            return [True] * len(keys)  # another rank writes these pages (MLA); SGLang counts them as backed up

        def put(client: kvd.Client) -> list[bool]:
            pages = self._pages()
            sources = pages.sources(pages.starts(len(keys), host_indices))
            started = time.perf_counter()
            stored = client.cache_put(keys, sources, namespace=self.namespace)
            self._record("backup", sum(stored), time.perf_counter() - started)
            return stored

        return self._call("batch_set_v1", put, [False] * len(keys))

    # --- the generic path: flat page tensors given and filled by SGLang

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any | None = None, target_sizes: Any | None = None):
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> list[torch.Tensor | None]:
        """Fill target_locations[i] with page keys[i]; each filled tensor is returned, None on a miss."""
        if not keys:
            return []
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        if len(targets) != len(keys) or not all(isinstance(t, torch.Tensor) for t in targets):
            # (kvd cannot size a page it is not given room for: a miss, as for a size mismatch)
            self.guard.failed("batch_get", ValueError(f"{len(keys)} keys need as many target tensors"))
            return [None] * len(keys)
        found = self._call("batch_get", lambda c: c.cache_get(keys, targets, namespace=self.namespace),
                           [False] * len(keys))
        return [t if hit else None for t, hit in zip(targets, found, strict=False)]

    def set(self, key: str, value: Any | None = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any | None = None, target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> bool:
        """Store flat page tensors; True only if every page is stored (SGLang's generic contract)."""
        if not keys:
            return True
        if not self.is_writer:
            return True
        values = list(values) if values is not None else []
        if len(values) != len(keys) or not all(isinstance(v, torch.Tensor) for v in values):
            self.guard.failed("batch_set", ValueError(f"{len(keys)} keys need as many page tensors"))
            return False
        return all(self._call("batch_set", lambda c: c.cache_put(keys, values, namespace=self.namespace),
                              [False]))

    # --- inside

    def _pages(self) -> HostPages:
        if self.host_pages is None:
            raise RuntimeError("no host pool registered (SGLang calls register_mem_pool_host first)")
        return self.host_pages

    def _client(self) -> kvd.Client:
        client = getattr(self._local, "client", None)
        if client is None:
            if self._closed:
                raise RuntimeError("the backend is closed")
            timeout = self.settings.timeout
            client = kvd.Client(self.settings.socket, reply_timeout=timeout, connect_timeout=timeout)
            with self._clients_lock:
                self._clients.append(client)
            self._local.client = client
        return client

    def _call(self, op: str, body: Callable[[kvd.Client], T], miss: T) -> T:
        """body(client), or miss if the daemon is backed off or anything fails (logged, rate-limited)."""
        if not self.guard.available():
            return miss
        try:
            return body(self._client())
        except Exception as error:
            self.guard.failed(op, error)
            return miss

    def _record(self, kind: str, pages: int, seconds: float) -> None:
        if not self._metrics_on or pages == 0 or self.host_pages is None:
            return
        with self._metrics_lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(pages * self.host_pages.nbytes / max(seconds, 1e-9) / 1e9)


_METRICS: list = []  # [StorageMetrics or None], looked up once


def _storage_metrics_class():
    if not _METRICS:
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception:  # (it imports SGLang's model configs, which need torchvision)
            StorageMetrics = None
        _METRICS.append(StorageMetrics)
    return _METRICS[0]
