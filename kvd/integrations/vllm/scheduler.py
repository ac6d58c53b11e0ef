"""The KVDConnector's scheduler side (vLLM's engine core process): plans each step's saves and loads,
reads and writes the kv_transfer_params, and releases the shards its workers shared.

Each request's params are read once, when it arrives (`RequestParams`). A prefill whose KV goes to
a decoder is saved in the step that completes its prompt: per KV cache group, the blocks decode
keeps (`KVGroup.kept_blocks`). A decode request whose KV is on a prefill's daemon is reported as
an external hit, loaded asynchronously: per group, the blocks vLLM allocated for it that are not
already computed here.

A hybrid model (a group other than full attention: a window or a state) hands over the prompt
but its last token, which decode computes (as vLLM's own NIXL connector does for Mamba models):
the prefill stops one token short (a Mamba state is then the one decode continues from), and
what decode's manager keeps for the tokens loaded is exactly what the next token reads. A model
of one full-attention group hands over the whole prompt, and vLLM recomputes its last token.

Every other request is prefix reuse's (`prefix.PrefixTier`, with `kvd_cache` on): its leading
blocks held in kvd's tier are loaded, the full blocks of its prompt are stored there.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ...errors import LayoutMismatch
from ..paged.groups import FULL, KVGroup
from ..paged.handoff import LoadSpec, SaveSpec, entry_key
from ..paged.plans import SourceDeployment, release_keys
from ..paged.tier_pages import TierLoad, TierSave
from ..transfer_params import ConnectorSettings, LocalDaemon, RemoteKV, RequestParams, local_daemon, params_for_decoder
from .engine_layout import deployment, kv_groups, model_kv_layout
from .prefix import PrefixTier

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvd.vllm")

MAX_RELEASE_SHARDS = 256  # a refused deployment's shards are all released, within reason


@dataclass
class KVDConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, each step: whose blocks to save during this forward, which to load."""

    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    tier_save: TierSave | None = None  # prefix reuse: full blocks this step computes, to store
    tier_loads: list[TierLoad] = field(default_factory=list)  # prefix reuse: hits to load


class KVDScheduler:
    """One engine's scheduler-side state. vLLM calls it from its scheduler loop: nothing here may
    block on the daemon (deletes run on a thread of their own)."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None,
                 settings: ConnectorSettings) -> None:
        self.vllm_config = vllm_config
        self.settings = settings
        self.engine_id = vllm_config.kv_transfer_config.engine_id
        self.deployment = deployment(vllm_config)  # this instance's TP/PP, sent to decode
        self.group_ids, groups = kv_groups(kv_cache_config)
        self.groups: tuple[KVGroup, ...] = groups or (KVGroup(FULL, vllm_config.cache_config.block_size, ()),)
        # a window or a state: the prefill stops a token short, decode computes that one
        self.hybrid = any(g.kind != FULL for g in self.groups)
        self._params: dict[str, RequestParams] = {}  # requests kvd has a part in, read on arrival
        self._producing: dict[str, Request] = {}  # prefill requests whose KV goes to a decoder
        self._block_ids: dict[str, list[list[int]]] = {}  # their block tables, per group
        self._saved: dict[str, SaveSpec] = {}
        self._loads: list[LoadSpec] = []
        self._daemon: LocalDaemon | None = None  # this node's daemon, once it has answered
        self._loading: dict[str, tuple[str, SourceDeployment]] = {}  # decode req id -> its shards
        self._written: dict[str, tuple[int, ...]] = {}  # decode req id -> the groups its load writes
        self._releaser: ThreadPoolExecutor | None = None  # deletes off the engine's loop
        self.prefix = PrefixTier(vllm_config, kv_cache_config, settings, self.group_ids, groups)

    # -- a request arrives -----------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        try:
            params = RequestParams.parse(request.kv_transfer_params, self.settings.push_to)
        except ValueError as exc:
            log.warning("request %s: %s; computing it as a plain request", request.request_id, exc)
            params = RequestParams()
        if not (params.produce or params.load is not None):
            self.prefix.track(request)  # P/D's requests are P/D's alone
            return
        self._params[request.request_id] = params
        if params.produce:
            self._producing[request.request_id] = request
            if self.hybrid:
                _stop_a_token_short(request)

    # -- decode: the prompt's KV is elsewhere ----------------------------------------------
    def _remote(self, request: Request) -> RemoteKV | None:
        params = self._params.get(request.request_id)
        return params.load if params is not None else None

    def _tokens_to_load(self, request: Request, remote: RemoteKV) -> int:
        return min(remote.num_tokens, request.num_prompt_tokens - (1 if self.hybrid else 0))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        remote = self._remote(request)
        if remote is None:
            if request.request_id in self._params:  # a prefill of P/D's: computed here, whatever the tier holds
                return 0, False
            return self.prefix.matched(request, num_computed_tokens)
        count = self._tokens_to_load(request, remote) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # a P/D load writes the request's own blocks of every group that keeps any for the tokens
        # loaded (a chunk that starts at the next token keeps none); vLLM zeroes the others
        written = self._written.get(request.request_id)
        if written is not None:
            return written
        hit = self.prefix.loaded_groups(request)
        if hit is not None:
            return hit
        remote = self._remote(request)
        return self._groups_written(self._tokens_to_load(request, remote)) if remote else self.group_ids

    def _groups_written(self, num_tokens: int) -> tuple[int, ...]:
        return tuple(gid for gid, group in zip(self.group_ids, self.groups, strict=True)
                     if group.kept_blocks(num_tokens)[0] < group.kept_blocks(num_tokens)[1])

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = self._params.get(request.request_id)
        if params is None:
            self.prefix.after_alloc(request, blocks.get_block_ids(), num_external_tokens)
            return
        if params.load is None:
            return
        remote = params.load
        self._params[request.request_id] = replace(params, load=None)  # load once, even if scheduled again
        if num_external_tokens <= 0:
            return
        total = self._tokens_to_load(request, remote)
        local = total - num_external_tokens  # computed here already (a prefix-cache hit)
        tables, first = [], []
        for group, table in zip(self.groups, self._tables(blocks.get_block_ids()), strict=True):
            kept, stop = group.kept_blocks(total)
            tables.append(table[:stop])
            first.append(max(kept, local // group.block_size))
        self._loads.append(LoadSpec(req_id=request.request_id, request_key=remote.request_key,
                                    block_ids=tuple(tables), num_tokens=total, first_block=tuple(first),
                                    source=remote.source, producer=remote.producer, directory=remote.directory))
        self._loading[request.request_id] = (remote.request_key, remote.producer)
        self._written[request.request_id] = self._groups_written(total)

    def _tables(self, block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """A request's block tables of the groups kvd moves (vLLM's tuples have every group's)."""
        return [list(block_ids[gid]) for gid in self.group_ids]

    def update_connector_output(self, connector_output: Any) -> None:
        # vLLM reports a load finished once every worker (each TP x PP rank) has reported it
        failed = connector_output.failed_recving or set()
        for req_id in connector_output.finished_recving or ():
            self.prefix.load_done(req_id)
            self._release(req_id, shared_only=req_id not in failed)

    def _release(self, req_id: str, shared_only: bool = False) -> None:
        """Drop the shards this instance's workers read for req_id: the shared ones (a shard one
        worker reads went with its read), or all of them after a failed or abandoned load."""
        loading = self._loading.pop(req_id, None)
        if loading is None:
            return
        key, src = loading
        try:
            mine = model_kv_layout(self.vllm_config, "uint8")  # (geometry only: any dtype)
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
            with self.settings.client() as client:
                for key in keys:
                    client.delete(key)
        except Exception as exc:  # they expire at kvd_ttl
            log.warning("kvd: releasing %s failed: %s", keys[0] if keys else "-", exc)

    # -- prefill: hand the prompt's KV to a decoder ----------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVDConnectorMetadata:
        meta = KVDConnectorMetadata(loads=self._loads, tier_loads=self.prefix.take_loads(),
                                    tier_save=self.prefix.saves_for(scheduler_output))
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._producing:
                self._block_ids[new.req_id] = self._tables(new.block_ids)
                self._maybe_save(meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self._producing:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted, then given blocks anew
                self._block_ids[req_id] = self._tables(new_ids) if new_ids else [[] for _ in self.groups]
            elif new_ids:
                tables = self._block_ids.setdefault(req_id, [[] for _ in self.groups])
                for table, more in zip(tables, self._tables(new_ids), strict=True):
                    table.extend(more)
            self._maybe_save(meta, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _maybe_save(self, meta: KVDConnectorMetadata, req_id: str, computed_after_step: int) -> None:
        """Save in the step that completes the prompt (with chunked prefill, the last chunk: the
        earlier chunks' KV is already in the cache when each layer runs; a window's blocks freed
        since are before the ones decode keeps)."""
        prompt = self._producing[req_id].num_prompt_tokens
        if req_id in self._saved or computed_after_step < prompt:
            return
        tables, first = [], []
        for group, table in zip(self.groups, self._block_ids[req_id], strict=True):
            kept, stop = group.kept_blocks(prompt)
            tables.append(table[:stop])
            first.append(kept)
        spec = SaveSpec(req_id=req_id, request_key=f"{self.engine_id}:{req_id}", block_ids=tuple(tables),
                        num_tokens=prompt, dest=self._params[req_id].dest, first_block=tuple(first))
        self._saved[req_id] = spec
        meta.saves.append(spec)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        self.prefix.finished(req_id)
        self._release(req_id)  # a decode request that ends before its load was reported (aborted)
        self._params.pop(req_id, None)
        self._written.pop(req_id, None)
        self._producing.pop(req_id, None)
        self._block_ids.pop(req_id, None)
        spec = self._saved.pop(req_id, None)
        if spec is None or request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                                  RequestStatus.FINISHED_STOPPED):
            return False, None  # nothing handed off (an unclaimed entry expires after kvd_ttl)
        # kvd holds its own copy of the blocks: vLLM may free them now
        daemon = self._local_daemon()
        return False, params_for_decoder(spec, daemon.endpoint, self.engine_id, self.deployment,
                                         directory=daemon.directory)

    def _local_daemon(self) -> LocalDaemon:
        """This node's daemon as decode needs it: its address, and whether it lists its puts in a
        cluster registry. Asked once; until it answers, kvd_endpoint and no registry are assumed."""
        if self._daemon is None:
            try:
                with self.settings.client() as client:
                    self._daemon = local_daemon(client.stats(), self.settings.endpoint)
            except Exception as exc:  # decode can still read a pushed entry
                log.warning("kvd: cannot ask the local daemon for its address: %s", exc)
                return LocalDaemon(self.settings.endpoint, directory=False)
        return self._daemon

    def shutdown(self) -> None:
        self.prefix.shutdown()
        if self._releaser is not None:
            self._releaser.shutdown(wait=True)


def _stop_a_token_short(request: Request) -> None:
    """A hybrid model's prefill computes the prompt but its last token (decode computes that one,
    from the state after the others), once: a request that wants prompt logprobs is not loaded by
    decode, and keeps its prompt (vLLM's NIXL connector does the same for Mamba models)."""
    if request.num_prompt_tokens < 2 or request.prompt_token_ids is None or request.get_skip_reading_prefix_cache():
        return
    del request.prompt_token_ids[-1:]
    del request._all_token_ids[-1:]
    request.num_prompt_tokens -= 1
    request.max_tokens = 1
