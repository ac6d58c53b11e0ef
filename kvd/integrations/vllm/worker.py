"""The KVDConnector's worker side (each of vLLM's TP x PP worker processes): registers the worker's
paged caches and runs a `PagedKVWorker` on them, saving layer by layer during the forward and
loading on its own threads.

vLLM owns the caches; the connector only reads them while saving (copied into the pool before
save_kv_layer returns; a Mamba state, which vLLM never passes to save_kv_layer, once the forward is
over, in wait_for_save) and writes the blocks a load was given.

With prefix reuse on (`kvd_cache`), a `TierWorker` beside it stores the full prompt blocks each
step computed, in wait_for_save, and loads the tier's hits on threads of its own.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from ...client.tensors import DTYPE_NAMES
from ..paged.groups import FULL, MAMBA, KVGroup
from ..paged.handoff import PagedKVLayout, PagedKVWorker
from ..paged.specs import TransferResults
from ..paged.tier_pages import unusable
from ..paged.tier_worker import TierWorker
from ..transfer_params import ConnectorSettings
from .engine_layout import (
    cache_layout,
    kv_groups,
    model_kv_layout,
    model_signature,
    quant_mode,
    tier_namespace,
    worker_ranks,
)
from .scheduler import KVDConnectorMetadata
from .transfer_stats import COUNTERS, KVDConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("kvd.vllm")


class KVDWorker:
    """One worker's connector state: nothing until vLLM registers the caches."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None,
                 settings: ConnectorSettings) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.settings = settings
        self.paged: PagedKVWorker | None = None
        self.tier: TierWorker | None = None
        self._failed_blocks: set[int] = set()
        # vLLM maps failed blocks to requests for a model of one group only; with several it takes
        # the failed requests alone (and recomputes their prompts)
        self._report_blocks = True

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        _, groups = kv_groups(self.kv_cache_config)
        reusable = unusable(groups) is None
        # (a stage holds its own layers of each group; a group vLLM does not transfer is not ours)
        groups = tuple(KVGroup(g.kind, g.block_size, tuple(n for n in g.layers if n in kv_caches), g.window)
                       for g in groups)
        caches = {name: kv_caches[name] for g in groups for name in g.layers} if groups else dict(kv_caches)
        num_blocks = self.kv_cache_config.num_blocks if self.kv_cache_config else None
        for name, cache in caches.items():
            if num_blocks is not None and cache.shape[0] != num_blocks:
                raise ValueError(f"kvd: layer {name} has cache shape {tuple(cache.shape)}; the connector "
                                 f"needs the block dimension first ({num_blocks} blocks)")
        states = {name for g in groups if g.kind == MAMBA for name in g.layers}
        first = next((c for name, c in caches.items() if name not in states), next(iter(caches.values())))
        tp_rank, pp_rank = worker_ranks()
        kv = model_kv_layout(self.vllm_config, DTYPE_NAMES.get(first.dtype, "uint8"), tp_rank, pp_rank)
        # vLLM hands each layer as its logical [blocks, heads, tokens, content] view, whatever the
        # physical stride order; a 3-d [blocks, tokens, latent] cache has no head axis (MLA)
        head_axis = 0 if first.dim() == 4 else None
        one_group = len(groups) <= 1 and all(g.kind == FULL for g in groups)
        layout = PagedKVLayout.from_caches(caches, model=model_signature(self.vllm_config),
                                           block_size=self.vllm_config.cache_config.block_size, kv=kv,
                                           head_axis=head_axis, quant=quant_mode(self.kv_cache_config),
                                           cache_layout=cache_layout(self.kv_cache_config),
                                           groups=() if one_group else groups)
        self._report_blocks = len(layout.kv_groups) == 1
        s = self.settings
        # a push's commit waits for the peer, in the engine's step. KVD_VLLM_COMMIT_IN_BACKGROUND=1
        # commits off the engine's thread (the step ends when its blocks are in the pool): not the
        # default until it measures better (bench/RESULTS.md, "TTFT through the connector")
        background = os.environ.get("KVD_VLLM_COMMIT_IN_BACKGROUND", "") == "1"
        self.paged = PagedKVWorker(caches, layout, connect=s.client, ttl=s.ttl, load_timeout=s.load_timeout,
                                   load_threads=s.load_threads, commit_in_background=background)
        if s.cache != "off" and reusable:  # (the scheduler says why not, once)
            self.tier = TierWorker(caches, layout.kv_groups, kv, tier_namespace(self.vllm_config, self.kv_cache_config,
                                                                               s.salt), connect=s.client)

    def start_load(self, meta: KVDConnectorMetadata | None) -> None:
        if meta is None or self.paged is None:
            return
        for spec in meta.loads:
            self.paged.start_load(spec)
        if self.tier is not None:
            for hit in meta.tier_loads:
                self.tier.start_load(hit)

    def save_layer(self, meta: KVDConnectorMetadata | None, layer_name: str, kv_layer: torch.Tensor) -> None:
        if meta is not None and meta.saves and self.paged is not None and layer_name in self.paged.caches:
            self.paged.save_layer(meta.saves, layer_name, kv_layer)

    def wait_for_save(self, meta: KVDConnectorMetadata | None) -> None:
        if self.paged is not None:
            self.paged.finish_saves(meta.saves if meta is not None else [])
        if self.tier is not None and meta is not None and meta.tier_save is not None:
            self.tier.save(meta.tier_save)  # (the forward is over: every layer's blocks are final)

    def transfer_results(self) -> KVConnectorTransferResults:
        if self.paged is None:
            return KVConnectorTransferResults()
        results = self.paged.poll()
        if self._report_blocks:
            self._failed_blocks |= results.failed_blocks
        hits = self.tier.poll() if self.tier is not None else TransferResults()
        failed = set(results.failed_loads)
        if self._report_blocks:  # vLLM recomputes from the first block that failed, keeps the ones before
            self._failed_blocks |= hits.failed_blocks
        else:  # (several groups: block ids name no request; the whole prompt is recomputed)
            failed |= hits.failed_loads
        return KVConnectorTransferResults(finished_recving=results.finished_loads | hits.finished_loads,
                                          failed_recving=failed)

    def load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def stats(self) -> KVDConnectorStats | None:
        if self.paged is None:
            return None
        taken = self.paged.take_stats()
        tier = self.tier.take_stats() if self.tier is not None else None
        if tier is not None:  # (its fields are the tier_* counters, and its durations)
            for name in COUNTERS:
                if name.startswith("tier_"):
                    setattr(taken, name, getattr(tier, name))
            taken.load_seconds += tier.load_seconds
            taken.save_seconds += tier.save_seconds
        if taken.empty():
            return None
        return KVDConnectorStats(data={**{name: getattr(taken, name) for name in COUNTERS},
                                       "load_seconds": taken.load_seconds,
                                       "save_seconds": taken.save_seconds,
                                       "saved_bytes_by_kind": taken.saved_by_kind,
                                       "loaded_bytes_by_kind": taken.loaded_by_kind})

    def shutdown(self) -> None:
        if self.paged is not None:
            self.paged.close()
        if self.tier is not None:
            self.tier.close()
