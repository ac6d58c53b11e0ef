"""The KVDConnector's prefix reuse, scheduler side (vLLM's engine core process): a prompt's leading
full blocks that kvd's tier holds are loaded instead of computed, and the full blocks of every
prompt this engine computes are stored there, once per block hash, for any engine of the same
model and layout on the node, or on the cluster through the tier's placement.

- Lookup (`matched`): the blocks of the prompt past what this engine computed (its own prefix
  cache), up to the last full block before the prompt's last token, are asked for in one
  `cache_exists` (every group's and every saving rank's page of each block, in block order: the
  leading count is the leading blocks held whole). It runs on a thread: answered within QUICK
  seconds, the request is scheduled at once; otherwise vLLM asks again at its next step, and a
  lookup not answered within `kvd_lookup_timeout` (a daemon down or slow) is a miss. A daemon that
  failed to answer is not asked again for RETRY_AFTER seconds. A hit is loaded asynchronously.
- Load (`after_alloc`): per group, the hit's blocks that this engine did not compute and that the
  group keeps for the hit's next token (a sliding window needs none of its older blocks).
- Saves (`saves`): in the step that completes each full block of a prompt (capped to the block
  hashes vLLM publishes, `num_publishable_block_hashes`, where it has them), every group's block
  that the tier does not hold already (`TierFeed`). The workers copy them at the end of the step.
- Requests with P/D kv_transfer_params are the P/D path's, not the tier's.

Hybrid models: groups of full attention, sliding window and chunked local attention, all of one
block size. A Mamba state exists only at the end of each computed chunk, not at every block, so a
model with a Mamba group does not use the tier (the connector says so at start).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...client import Client
from ...errors import BadRequest, KvdError
from ..paged.groups import KVGroup
from ..paged.tier_pages import TierLayout, TierLoad, TierSave, leading_blocks, unusable
from ..paged.tier_worker import warm_threads
from ..transfer_params import ConnectorSettings
from .engine_layout import model_kv_layout, tier_namespace
from .tier_feed import BlockInfo, TierFeed

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvd.vllm")

QUICK = 0.002  # seconds a lookup is waited for in the scheduler's call (a local daemon answers in less)
RETRY_AFTER = 1.0  # seconds without asking a daemon that failed to answer


@dataclass
class Lookup:
    """One request's question to the tier, and its answer."""

    first: int  # the first block asked for (the engine computed the ones before)
    limit: int  # blocks asked up to
    per_block: list[int]  # keys asked per block
    future: Future | None
    deadline: float
    found: int | None = None  # leading blocks held from `first`; None: not answered yet
    asked_for: int = 0  # num_computed_tokens the answer was given for


class PrefixTier:
    """One engine's prefix reuse, scheduler side. Nothing here waits on the daemon beyond QUICK."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, settings: ConnectorSettings,
                 group_ids: tuple[int, ...], groups: tuple[KVGroup, ...]) -> None:
        self.settings = settings
        self.group_ids = group_ids
        self.groups = groups
        why = unusable(groups) if settings.cache != "off" else None
        if why:
            log.warning("kvd: kvd_cache=%r is turned off for this model: %s", settings.cache, why)
        self.loads = settings.cache_loads and why is None
        self.saves = settings.cache_saves and why is None
        self.feed: TierFeed | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._lookups: dict[str, Lookup] = {}
        self._requests: dict[str, Request] = {}  # requests whose prompts are saved
        self._tables: dict[str, list[list[int]]] = {}  # their block tables, per group
        self._next: dict[str, int] = {}  # their next block to save
        self._loads: list[TierLoad] = []
        self._written: dict[str, tuple[int, ...]] = {}  # vLLM's ids of the groups a hit's load writes
        self._hits: set[str] = set()  # requests whose external tokens are the tier's (not P/D's)
        self._loading: dict[str, set[str]] = {}  # request -> the block hashes its load writes
        self._in_flight: dict[str, int] = {}  # block hash -> loads writing it now
        # with vLLM's prefix cache on, a request whose prefix another request is loading waits for
        # that load and hits the engine's own cache, rather than reading the same pages again
        self._share_loads = bool(getattr(vllm_config.cache_config, "enable_prefix_caching", False))
        self._local = threading.local()
        self._clients: list[Client] = []
        self._down_until = 0.0
        if not (self.loads or self.saves):
            return
        self.block = groups[0].block_size
        hash_block = getattr(kv_cache_config, "hash_block_size", None) or self.block
        if self.block % hash_block:
            raise ValueError(f"kvd: block size {self.block} is not a multiple of vLLM's hash block size {hash_block}")
        self.scale = self.block // hash_block  # vLLM's block hashes per block of ours
        self.layout = TierLayout.of(model_kv_layout(vllm_config, "uint8"), groups)
        self.namespace = tier_namespace(vllm_config, kv_cache_config, settings.salt)
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvd-lookup")
        warm_threads(self._executor, 2, self._client)  # (a client maps the pool when it connects)
        events = getattr(vllm_config, "kv_events_config", None)
        publish = bool(events is not None and getattr(events, "enable_kv_cache_events", False))
        self.feed = TierFeed(self._client_for_feed, self.namespace, self.layout, group_ids, publish=publish)
        log.info("kvd: prefix reuse %s in KV tier namespace %s", settings.cache, self.namespace)

    def _connect(self) -> Client:
        # a lookup that waits longer than its deadline is a miss anyway
        return Client(self.settings.socket, reply_timeout=max(1.0, 2 * self.settings.lookup_timeout),
                      connect_timeout=1.0).connect()

    def _client_for_feed(self) -> Client:
        return self._connect()

    def _client(self) -> Client:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = self._connect()
            self._clients.append(client)
        return client

    def _exists(self, keys: list[str]) -> int:
        try:
            return self._client().cache_exists(keys, namespace=self.namespace)
        except Exception as exc:
            client, self._local.client = getattr(self._local, "client", None), None
            if client is not None:
                client.close()
            if isinstance(exc, KvdError) and not isinstance(exc, BadRequest):
                self._down_until = time.monotonic() + RETRY_AFTER
            log.warning("kvd: a prefix lookup failed (a miss): %s: %s", type(exc).__name__, exc)
            return 0

    # -- block hashes ----------------------------------------------------------------------
    def hashes(self, request: Request, blocks: int) -> list[str]:
        """The hex block hashes of the request's first `blocks` blocks (those vLLM has hashed)."""
        raw = request.block_hashes
        blocks = min(blocks, len(raw) // self.scale)
        return [raw[(i + 1) * self.scale - 1].hex() for i in range(blocks)]

    # -- lookups ---------------------------------------------------------------------------
    def matched(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's get_num_new_matched_tokens for a request of the tier's."""
        if not self.loads:
            return 0, False
        rid = request.request_id
        # a hit leaves the prompt's last token to compute (vLLM samples from it)
        limit = min((request.num_tokens - 1) // self.block, len(request.block_hashes) // self.scale)
        first = num_computed_tokens // self.block
        if limit <= first:
            self._lookups.pop(rid, None)
            return 0, False
        look = self._lookups.get(rid)
        if look is None or look.first != first or look.limit != limit:
            ahead = self.hashes(request, first + 1)[first:]
            if self._share_loads and rid not in self._loading and ahead and ahead[0] in self._in_flight:
                return None, False  # being loaded for another request: this one then hits the engine's cache
            look = self._ask(request, first, limit)
        if look.found is None:
            if look.future is not None and look.future.done():
                look.found = leading_blocks(look.future.result(), look.per_block)
            elif time.monotonic() > look.deadline:
                log.warning("kvd: the prefix lookup of request %s took over %gs (kvd_lookup_timeout): a miss", rid,
                            self.settings.lookup_timeout)
                look.found = 0
            else:
                return None, False  # asked again at vLLM's next step
        look.asked_for = num_computed_tokens
        tokens = (look.first + look.found) * self.block - num_computed_tokens
        return (tokens, True) if tokens > 0 else (0, False)

    def _ask(self, request: Request, first: int, limit: int) -> Lookup:
        now = time.monotonic()
        if now < self._down_until or self._executor is None:
            look = Lookup(first, limit, [], None, now, found=0)
        else:
            keys, per_block = self.layout.lookup_keys(self.hashes(request, limit), first)
            future = self._executor.submit(self._exists, keys)
            look = Lookup(first, limit, per_block, future, now + self.settings.lookup_timeout)
            with contextlib.suppress(FutureTimeout):
                look.found = leading_blocks(future.result(timeout=QUICK), per_block)
        self._lookups[request.request_id] = look
        return look

    def loaded_groups(self, request: Request) -> tuple[int, ...] | None:
        """vLLM's ids of the groups a hit's load writes (None: not a hit of the tier's)."""
        written = self._written.get(request.request_id)
        if written is not None:
            return written
        look = self._lookups.get(request.request_id)
        if look is None or not look.found:
            return None
        tokens = (look.first + look.found) * self.block
        return tuple(gid for gid, g in zip(self.group_ids, self.groups, strict=True)
                     if g.kept_blocks(tokens)[0] < g.kept_blocks(tokens)[1])

    def after_alloc(self, request: Request, block_ids: Sequence[Sequence[int]], num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks: a hit's are loaded (asynchronously) into them."""
        rid = request.request_id
        look = self._lookups.pop(rid, None)
        if look is None or not look.found or num_external_tokens <= 0:
            return
        local = look.asked_for
        total = local + num_external_tokens
        stop = total // self.block
        hashes = self.hashes(request, stop)
        pages, written = [], []
        for index, (gid, group) in enumerate(zip(self.group_ids, self.groups, strict=True)):
            table = block_ids[gid]
            kept, _ = group.kept_blocks(total)
            mine = [(hashes[i], index, table[i]) for i in range(max(kept, local // self.block), stop)]
            pages += mine
            if mine:
                written.append(gid)
        self._loads.append(TierLoad(rid, pages, total))
        self._written[rid] = tuple(written)
        self._hits.add(rid)
        self._loading[rid] = {h for h, _, _ in pages}
        for block_hash in self._loading[rid]:
            self._in_flight[block_hash] = self._in_flight.get(block_hash, 0) + 1
        self._next[rid] = max(self._next.get(rid, 0), stop)  # (loaded blocks are the tier's already)
        if self.feed is not None:
            self.feed.found(sorted({(h, g) for h, g, _ in pages}), self._describe(request, range(stop), hashes))

    def is_hit(self, request: Request) -> bool:
        return request.request_id in self._hits

    def take_loads(self) -> list[TierLoad]:
        loads, self._loads = self._loads, []
        return loads

    def load_done(self, req_id: str) -> None:
        self._written.pop(req_id, None)
        for block_hash in self._loading.pop(req_id, ()):
            left = self._in_flight.pop(block_hash) - 1
            if left:
                self._in_flight[block_hash] = left

    # -- saves -----------------------------------------------------------------------------
    def track(self, request: Request) -> None:
        """A new request whose prompt's blocks are saved as they are computed."""
        if self.saves:
            self._requests[request.request_id] = request

    def saves_for(self, output: SchedulerOutput) -> TierSave | None:
        """The pages to store at the end of this step: the prompt blocks it completes."""
        if not self.saves or not self._requests:
            return None
        scheduled = output.num_scheduled_tokens
        step: list[tuple[str, int]] = []  # (request, tokens computed after this step)
        for new in output.scheduled_new_reqs:
            if new.req_id in self._requests:
                self._tables[new.req_id] = [list(new.block_ids[gid]) for gid in self.group_ids]
                self._next.setdefault(new.req_id, new.num_computed_tokens // self.block)
                step.append((new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0)))
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self._requests:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids or req_id not in self._tables:  # preempted: blocks anew
                self._tables[req_id] = [list(new_ids[gid]) for gid in self.group_ids] if new_ids else \
                    [[] for _ in self.group_ids]
            elif new_ids:
                for table, gid in zip(self._tables[req_id], self.group_ids, strict=True):
                    table.extend(new_ids[gid])
            step.append((req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0)))
        pages: list[tuple[str, int, int]] = []
        seen: set[tuple[str, int]] = set()
        info: dict[str, BlockInfo] = {}
        for req_id, computed in step:
            pages += self._complete(self._requests[req_id], computed, seen, info)
        if not pages:
            return None
        assert self.feed is not None
        self.feed.saving(sorted(seen), info)
        return TierSave(pages)

    def _complete(self, request: Request, computed: int, seen: set, info: dict) -> list[tuple[str, int, int]]:
        """The pages of the request's prompt blocks completed by `computed` tokens, not saved yet."""
        rid = request.request_id
        upto = min(computed, request.num_prompt_tokens) // self.block
        publishable = getattr(request, "num_publishable_block_hashes", None)
        if isinstance(publishable, int):
            upto = min(upto, publishable // self.scale)
        start = self._next.get(rid, 0)
        if upto <= start:
            return []
        hashes = self.hashes(request, upto)
        tables = self._tables.get(rid) or [[] for _ in self.groups]
        pages = []
        for i in range(start, len(hashes)):
            blocks = [table[i] if i < len(table) else 0 for table in tables]
            if 0 in blocks:  # vLLM's null block: a block this step did not compute (never ours to save)
                continue
            for g, block in enumerate(blocks):
                page = (hashes[i], g)
                if page not in seen and self.feed is not None and self.feed.wanted(page):
                    seen.add(page)
                    pages.append((hashes[i], g, block))
        self._next[rid] = max(start, len(hashes))
        info.update(self._describe(request, range(start, len(hashes)), hashes))
        return pages

    def _describe(self, request: Request, blocks: range, hashes: list[str]) -> dict[str, BlockInfo]:
        """What KV events say of these blocks (only when vLLM publishes them)."""
        if self.feed is None or not self.feed.publish:
            return {}
        lora = request.lora_request
        tokens = request.all_token_ids
        return {hashes[i]: BlockInfo(hashes[i - 1] if i else None, tuple(tokens[i * self.block:(i + 1) * self.block]),
                                     lora.adapter_id if lora else None, lora.name if lora else None,
                                     _extra_keys(request, i * self.block, (i + 1) * self.block))
                for i in blocks if i < len(hashes)}

    def finished(self, req_id: str) -> None:
        self.load_done(req_id)  # (an aborted load)
        for table in (self._lookups, self._requests, self._tables, self._next, self._written):
            table.pop(req_id, None)
        self._hits.discard(req_id)

    # -- the whole namespace ---------------------------------------------------------------
    def reset(self) -> bool:
        """The engine resets its prefix cache: kvd drops this deployment's pages too (everywhere on
        the cluster: a clear is the tier's). False if the daemon did not confirm."""
        if not (self.loads or self.saves):
            return True
        try:
            with self._connect() as client:
                client.cache_clear(self.namespace)
        except Exception as exc:
            log.error("kvd: clearing the prefix tier (namespace %s) failed: %s", self.namespace, exc)
            return False
        if self.feed is not None:
            self.feed.cleared()
        return True

    def take_events(self) -> list:
        return self.feed.take() if self.feed is not None else []

    def shutdown(self) -> None:
        if self.feed is not None:
            self.feed.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        for client in self._clients:
            with contextlib.suppress(Exception):
                client.close()


def _extra_keys(request: Request, start: int, end: int) -> Any:
    """The block's extra hash keys as vLLM's own events publish them (None where it cannot say)."""
    try:
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

        keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
        return to_event_extra_keys([keys])
    except Exception:
        return None
