"""The KVDConnector vLLM loads (`kv_connector_module_path: kvd.integrations.vllm`): one per process,
a thin face that hands each call to the side of its role (vLLM's engine core and worker processes).

vLLM builds the connector with role SCHEDULER in the engine core (`KVDScheduler`: plans saves
and loads, hands out and reads the kv_transfer_params, releases shared shards) and with role
WORKER in each TP x PP worker (`KVDWorker`: saves layer by layer during the forward, loads on its
own threads). A call of the other side's is answered as vLLM's base class would.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ..transfer_params import ConnectorSettings
from .scheduler import KVDConnectorMetadata, KVDScheduler
from .transfer_stats import KVDConnectorStats, KVDPromMetrics
from .worker import KVDWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class KVDConnector(KVConnectorBase_V1, SupportsHMA):
    """kvd as vLLM's KV connector, for every KV cache group of a hybrid model too (`SupportsHMA`:
    vLLM keeps its hybrid KV cache manager on). vLLM owns the paged caches; the connector only
    reads them while saving and writes the blocks a load was given."""

    _cache_hit_source = CacheHitSource.P2P  # vLLM's per-source hit metrics: KV from a peer instance

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = ConnectorSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.scheduler: KVDScheduler | None = None
        self.worker: KVDWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = KVDScheduler(vllm_config, kv_cache_config, settings)
        else:
            self.worker = KVDWorker(vllm_config, kv_cache_config, settings)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        # (vLLM 0.33) sleep remaps the KV cache; the worker holds the caches it registered, so
        # sleep mode stays off until unregister_kv_caches/restore_kv_caches re-register them
        return False

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVDPromMetrics:
        return KVDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # save_kv_layer runs between attention layers: a fully captured CUDA graph would skip it
        # on replay and hand off nothing, so vLLM must capture piecewise
        return True

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVDConnectorStats:
        return KVDConnectorStats(data=dict(data or {}))

    def _scheduler(self) -> KVDScheduler:
        assert self.scheduler is not None, "a scheduler-side call on a worker's connector"
        return self.scheduler

    def _worker(self) -> KVDWorker:
        assert self.worker is not None, "a worker-side call on the scheduler's connector"
        return self.worker

    # ================================ scheduler side ======================================
    def on_new_request(self, request: Request) -> None:
        self._scheduler().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._scheduler().get_loaded_kv_cache_group_ids(request)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler().update_connector_output(connector_output)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        # kvd took its copy while the prompt was computed: the blocks are vLLM's to free now
        return self._scheduler().request_finished(request)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        # vLLM's per-source hit metrics: a prefix from the node's tier is host memory, a P/D handoff a peer's
        if num_external_tokens == 0:
            return {}
        tier = self._scheduler().prefix.is_hit(request)
        return {CacheHitSource.HOST if tier else CacheHitSource.P2P: num_external_tokens}

    def may_load_async(self, request: Request) -> bool:
        # (vLLM 0.34) any request may hit the tier when lookups are on; a P/D decode request loads
        params = request.kv_transfer_params
        return bool(params and params.get("do_remote_prefill")) or self._scheduler().prefix.loads

    def take_events(self) -> Iterable[Any]:
        # blocks kvd's tier holds for this engine (BlockStored / BlockRemoved, medium CPU), on the
        # engine's own KV event publisher
        return self._scheduler().prefix.take_events() if self.scheduler is not None else ()

    def reset_cache(self) -> bool | None:
        # vLLM's reset_prefix_cache(reset_connector=True): this deployment's pages go from the tier too
        return self.scheduler.prefix.reset() if self.scheduler is not None else None

    # ================================= worker side ========================================
    def _meta(self) -> KVDConnectorMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, KVDConnectorMetadata) else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker().start_load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: the request waits until get_transfer_results reports them

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        self._worker().save_layer(self._meta(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._worker().wait_for_save(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker().transfer_results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().load_errors()

    def get_kv_connector_stats(self) -> KVDConnectorStats | None:
        # (asked of both sides; the scheduler's has none)
        return self.worker.stats() if self.worker is not None else None

    def shutdown(self) -> None:
        for side in (self.worker, self.scheduler):
            if side is not None:
                side.shutdown()
