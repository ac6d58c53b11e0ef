"""What kvd's tier holds of an engine's prefix pages, and the KV events that tell routers (vLLM's
engine core process, scheduler side).

A thread follows the deployment's tier namespace on the local daemon (`cache_events`: the pages
stored and removed since its last poll, one request a poll, never one per page). From it the
connector knows which blocks the tier holds whole (every saving rank's page of a (block hash,
group)), so each is saved once, and a page evicted is saved again the next time a prompt
computes it. A save not seen stored within IN_FLIGHT seconds (refused, its daemon gone) may be
tried again.

With vLLM's KV events on (`--kv-events-config`), `take_events()` hands the engine's publisher, in
its own format, topic and block hashes: `BlockStored` (medium "CPU": the node's tier, loadable by
this engine) for each block kvd holds that this engine saved or found there (with its tokens and
parent hash, which routers such as llm-d key on), `BlockRemoved` (medium "CPU") when the tier
evicts or clears one, and `AllBlocksCleared` when the engine resets its prefix cache and kvd's
namespace with it. A follower that lost its place (the daemon restarted) removes everything it
announced. A daemon without `cache_events` (older kvd) leaves the connector saving each block once
per engine lifetime, and announcing nothing.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...client import Client
from ...errors import BadRequest
from ..paged.tier_pages import TierLayout, parse_key

log = logging.getLogger("kvd.vllm")

POLL_INTERVAL = 0.25  # seconds between two polls of the daemon
IN_FLIGHT = 30.0  # seconds a save may take to be seen stored before it may be tried again
MAX_TRACKED = 1 << 17  # (block, group) pairs remembered as held; the oldest are forgotten past it
MAX_DESCRIBED = 1 << 15  # blocks whose tokens are kept for BlockStored events
RETRY_AFTER = 1.0  # seconds before asking a daemon that failed to answer again
FULL_ANSWER = 2048  # events in a full answer (the daemon's most): a backlog, asked for again at once

Page = tuple[str, int]  # (block hash hex, group index among the connector's groups)


@dataclass(frozen=True)
class BlockInfo:
    """What a BlockStored event says about a block beyond its hash."""

    parent: str | None  # the previous block's hash hex
    tokens: tuple[int, ...]
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: Any = None


class TierFeed:
    def __init__(self, connect: Callable[[], Client], namespace: str, layout: TierLayout, group_ids: tuple[int, ...],
                 *, publish: bool, interval: float = POLL_INTERVAL) -> None:
        self._connect = connect
        self.namespace = namespace
        self.layout = layout
        self.group_ids = group_ids
        self.publish = publish
        self.interval = interval
        self.following = True  # until the daemon turns out to have no cache_events
        self._lock = threading.Lock()
        self._stored: dict[Page, set] = {}  # pages of a block seen stored, by saving rank, until all are
        self._held: collections.OrderedDict[Page, None] = collections.OrderedDict()  # whole in the tier
        self._in_flight: dict[Page, float] = {}  # saves asked for, not seen stored yet: their deadline
        self._info: collections.OrderedDict[str, BlockInfo] = collections.OrderedDict()
        self._announced: set[Page] = set()
        self._events: collections.deque = collections.deque()
        self._stop = threading.Event()
        self._cursor = (0, 0)
        self._thread = threading.Thread(target=self._run, name="kvd-tier-feed", daemon=True)
        self._thread.start()

    # -- the scheduler's thread ------------------------------------------------------------
    def wanted(self, page: Page) -> bool:
        """Whether a computed block's page is worth saving: not held, not being saved."""
        with self._lock:
            if page in self._held:
                return False
            deadline = self._in_flight.get(page)
            return deadline is None or deadline < time.monotonic()

    def saving(self, pages: list[Page], info: dict[str, BlockInfo]) -> None:
        """These pages are saved in this step (their blocks described for the events)."""
        with self._lock:
            self._describe(info)
            if not self.following:  # nobody will say they landed: count them held (saved once)
                for page in pages:
                    self._hold(page)
                return
            deadline = time.monotonic() + IN_FLIGHT
            self._in_flight.update((page, deadline) for page in pages)

    def found(self, pages: list[Page], info: dict[str, BlockInfo]) -> None:
        """A lookup found these pages in the tier (this engine loads them)."""
        with self._lock:
            self._describe(info)
            for page in pages:
                self._hold(page)
                self._announce(page)

    def cleared(self) -> None:
        """The engine reset its prefix cache and kvd's namespace was cleared with it."""
        with self._lock:
            self._held.clear()
            self._stored.clear()
            self._in_flight.clear()
            self._announced.clear()
            if self.publish:
                from vllm.distributed.kv_events import AllBlocksCleared

                self._events.append(AllBlocksCleared())

    def take(self) -> list:
        """The KV events since the last call (vLLM's own event classes)."""
        with self._lock:
            events, self._events = list(self._events), collections.deque()
        return events

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # -- bookkeeping (under the lock) ------------------------------------------------------
    def _describe(self, info: dict[str, BlockInfo]) -> None:
        for block_hash, block in info.items():
            self._info[block_hash] = block
            self._info.move_to_end(block_hash)
        while len(self._info) > MAX_DESCRIBED:
            self._info.popitem(last=False)

    def _hold(self, page: Page) -> None:
        self._held[page] = None
        self._held.move_to_end(page)
        self._in_flight.pop(page, None)
        self._stored.pop(page, None)
        while len(self._held) > MAX_TRACKED:
            forgotten, _ = self._held.popitem(last=False)
            self._announced.discard(forgotten)

    def _announce(self, page: Page) -> None:
        info = self._info.get(page[0])
        if not self.publish or info is None or page in self._announced:
            return
        self._announced.add(page)
        self._events.append(_block_stored(page, info, self.layout.block_size, self.group_ids))

    def _gone(self, page: Page) -> None:
        self._held.pop(page, None)
        if page in self._announced:
            self._announced.discard(page)
            self._events.append(_block_removed(page, self.group_ids))

    def _apply(self, answer: dict) -> None:
        with self._lock:
            if answer.get("lost"):  # anything announced may be gone: say so, and learn afresh
                for page in list(self._announced):
                    self._gone(page)
                self._held.clear()
                self._stored.clear()
            for kind, key in answer.get("events") or ():
                parsed = parse_key(key) if isinstance(key, str) else None
                if parsed is None or not 0 <= parsed[1] < len(self.layout.groups):
                    continue  # (another writer's key in our namespace: not a page of ours)
                block_hash, group, rank = parsed
                page = (block_hash, group)
                if kind == "stored":
                    ranks = self._stored.setdefault(page, set())
                    ranks.add(rank)
                    if ranks >= set(self.layout.ranks[group]):
                        self._hold(page)
                        self._announce(page)
                    elif len(self._stored) > MAX_TRACKED:
                        self._stored.pop(next(iter(self._stored)))
                elif kind == "removed":
                    self._stored.pop(page, None)
                    self._gone(page)
            now = time.monotonic()
            for page in [p for p, deadline in self._in_flight.items() if deadline < now]:
                del self._in_flight[page]

    # -- the follower's thread -------------------------------------------------------------
    def _run(self) -> None:
        client: Client | None = None
        while not self._stop.is_set():
            try:
                if client is None:
                    client = self._connect()
                epoch, since = self._cursor
                answer = client.cache_events(self.namespace, epoch=epoch, since=since)
            except BadRequest as exc:  # an older daemon: no events to follow
                log.warning("kvd: the daemon does not report its tier's events (%s): prefix blocks are saved "
                            "once per engine, and routers are not told about them", exc)
                with self._lock:
                    self.following = False
                    for page in list(self._in_flight):
                        self._hold(page)
                break
            except Exception as exc:
                log.debug("kvd: following the tier failed: %s", exc)
                _close(client)
                client = None
                self._stop.wait(RETRY_AFTER)
                continue
            self._cursor = (answer["epoch"], answer["next"])
            self._apply(answer)
            if len(answer.get("events") or ()) < FULL_ANSWER:
                self._stop.wait(self.interval)
        _close(client)


def _close(client: Client | None) -> None:
    if client is not None:
        with contextlib.suppress(Exception):
            client.close()
    return None


def _external(block_hash: str) -> Any:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return maybe_convert_block_hash(bytes.fromhex(block_hash))


def _fields(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """The values this vLLM's event class has fields for (they grow between releases)."""
    known = getattr(cls, "__struct_fields__", ())
    return {k: v for k, v in values.items() if k in known}


def _block_stored(page: Page, info: BlockInfo, block_size: int, group_ids: tuple[int, ...]) -> Any:
    from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored

    return BlockStored(**_fields(BlockStored, {
        "block_hashes": [_external(page[0])], "parent_block_hash": _external(info.parent) if info.parent else None,
        "token_ids": list(info.tokens), "block_size": block_size, "lora_id": info.lora_id, "medium": MEDIUM_CPU,
        "lora_name": info.lora_name, "extra_keys": info.extra_keys, "group_idx": group_ids[page[1]]}))


def _block_removed(page: Page, group_ids: tuple[int, ...]) -> Any:
    from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved

    return BlockRemoved(**_fields(BlockRemoved, {"block_hashes": [_external(page[0])], "medium": MEDIUM_CPU,
                                                 "group_idx": group_ids[page[1]]}))
