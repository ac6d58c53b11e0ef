"""The KV tier's client operations (worker process): batches of pages in and out of the daemon's
evictable cache, as I/O-free generators (`ops.py`) that `Client` and `AsyncClient` drive.

A put asks the daemon for room for the whole batch (cache_put), copies each new page once,
straight into the pool, and commits (cache_commit); a get asks where the hits are (cache_get),
copies each once, straight out of the pool into the caller's tensor, and releases them
(cache_release, no reply). Batches over the daemon's cap (MAX_BATCH keys) go as several.
A full tier answers False, never an exception; transport errors raise as in any call.

A page may also be given as `Parts`: several tensors laid end to end (an engine's block of every
layer, each layer its own tensor), stored as one page of their bytes and read back into the same
kind of parts: each part is copied once each way, with no staging tensor.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvd.errors import BadRequest, ProtocolError
from kvd.wire import protocol as p

from .ops import NO_REPLY, Operation, reply_as
from .tensors import DTYPE_NAMES, copy_in, host_strided_bytes, memory_problem

MAX_BATCH = 4096  # keys per request, the daemon's cap (kvd.daemon.store.page_names.MAX_BATCH)
# (`core` below is the driving client, a kvd.client.core._ClientCore: not imported, since core imports us)


def _keys(keys: Sequence[str]) -> list[str]:
    if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
        raise BadRequest("cache keys must be a sequence of str")
    return list(keys)


def _check_namespace(namespace: str) -> None:
    if not isinstance(namespace, str):
        raise BadRequest(f"a namespace must be a str, got {type(namespace).__name__}")


def _checked_slot(core: Any, slot, nbytes: int) -> list[tuple[int, int]]:
    """The daemon's segments for a page, checked before a byte moves: inside the pool, as long as the page."""
    try:
        segments = [(int(off), int(n)) for off, n in slot]
    except (TypeError, ValueError):
        raise ProtocolError(f"cache slot is not a list of [offset, length]: {str(slot)[:80]}") from None
    pool_size = core.info.pool_size
    if sum(n for _, n in segments) != nbytes or not all(off >= 0 and n > 0 and off + n <= pool_size
                                                        for off, n in segments):
        raise ProtocolError(f"cache slot {str(slot)[:80]} does not hold a page of {nbytes} bytes inside the pool")
    return segments


@dataclass(frozen=True)
class Parts:
    """One page given as several tensors, its bytes theirs laid end to end in order (e.g. one block
    of each layer of a paged cache). Stored as a flat uint8 page of their total size; a get fills
    parts of the same sizes. Each part may be a non-contiguous view."""

    tensors: tuple[torch.Tensor, ...]

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        object.__setattr__(self, "tensors", tuple(tensors))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


Page = torch.Tensor | Parts


def _tensor(tensor: object, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise BadRequest(f"{what} must be a torch.Tensor or kvd.Parts, got {type(tensor).__name__}")
    if (problem := memory_problem(tensor)) is not None:
        raise BadRequest(f"{what} is {problem}")
    if tensor.dtype not in DTYPE_NAMES:
        raise BadRequest(f"{what}: dtype {tensor.dtype} is not supported")
    return tensor.detach()


def _page(page: object, what: str) -> Page:
    if isinstance(page, Parts):
        if not page.tensors:
            raise BadRequest(f"{what}: Parts of no tensor")
        return Parts([_tensor(t, f"{what}.tensors[{i}]") for i, t in enumerate(page.tensors)])
    return _tensor(page, what)


def _nbytes(page: Page) -> int:
    return page.nbytes if isinstance(page, Parts) else page.numel() * page.element_size()


def _declared(page: Page) -> list:
    """[dtype, shape] of a page as the daemon keeps it (Parts: their bytes, flat)."""
    if isinstance(page, Parts):
        return ["uint8", [page.nbytes]]
    return [DTYPE_NAMES[page.dtype], list(page.shape)]


def _split(segments: list[tuple[int, int]], sizes: list[int]) -> list[list[tuple[int, int]]]:
    """Consecutive byte runs of `sizes` over the pool segments that hold them end to end."""
    out: list[list[tuple[int, int]]] = []
    seg, used = 0, 0  # the segment under way, and how much of it earlier parts took
    for size in sizes:
        mine: list[tuple[int, int]] = []
        while size:
            off, n = segments[seg]
            take = min(n - used, size)
            mine.append((off + used, take))
            size -= take
            used += take
            if used == n:
                seg, used = seg + 1, 0
        out.append(mine)
    return out


def _into_pool(pool: torch.Tensor, page: Page, segments: list[tuple[int, int]]) -> None:
    if not isinstance(page, Parts):
        copy_in(pool, page, segments)
        return
    for part, mine in zip(page.tensors, _split(segments, [t.numel() * t.element_size() for t in page.tensors]),
                          strict=True):
        if mine:
            copy_in(pool, part, mine)


def _batches(keys: Sequence[str], tensors: Sequence[Page], namespace: str,
             what: str) -> list[tuple[list[str], list[Page]]]:
    """Checked keys and their pages (one each: pages to put, outs to get into), MAX_BATCH a batch."""
    keys = _keys(keys)
    _check_namespace(namespace)
    checked = [_page(t, f"{what}[{i}]") for i, t in enumerate(tensors)]
    if len(checked) != len(keys):
        raise BadRequest(f"{len(keys)} keys but {len(checked)} {what}")
    return [(keys[start:start + MAX_BATCH], checked[start:start + MAX_BATCH])
            for start in range(0, len(keys), MAX_BATCH)]


def cache_put(core: Any, keys: Sequence[str], pages: Sequence[Page], namespace: str) -> Operation:
    results: list[bool] = []
    for batch_keys, batch in _batches(keys, pages, namespace, "pages"):
        generation = core._generation
        reply = reply_as(p.CacheSlots, (yield p.CachePut(req=next(core._reqs), namespace=namespace, keys=batch_keys,
                                                         pages=[_declared(page) for page in batch]), 0.0))
        slots = reply.slots
        if not isinstance(slots, list) or len(slots) != len(batch):
            raise ProtocolError(f"cache_slots has {len(slots)} slots for {len(batch)} pages")
        writes = [i for i, slot in enumerate(slots) if isinstance(slot, list)]
        if writes:
            try:
                pool = core._pool_of(generation)
                for i in writes:
                    page = batch[i]
                    segments = _checked_slot(core, slots[i], _nbytes(page))
                    if segments:
                        _into_pool(pool, page, segments)
                core._sync_device()
            except BaseException:
                yield p.CacheCommit(req=next(core._reqs), token=reply.token, ok=False), NO_REPLY
                raise
            done = reply_as(p.Ok, (yield p.CacheCommit(req=next(core._reqs), token=reply.token), 0.0))
            published = done.value  # per page written; None: the reservation ran out before the commit
            if published is None:
                published = [False] * len(writes)
            if not isinstance(published, list) or len(published) != len(writes):
                raise ProtocolError(f"cache_commit answered {str(published)[:80]} for {len(writes)} pages")
            for i, ok in zip(writes, published, strict=True):
                slots[i] = bool(ok) and slots[i]
        results += [slot is True or isinstance(slot, list) for slot in slots]
    return results


def _copy_out(pool: torch.Tensor, segments: list[tuple[int, int]], out: torch.Tensor) -> None:
    """Pool bytes -> out (same byte count), one copy. Into a contiguous host tensor, one memcpy in
    this thread: small pages are many, and torch's threaded copy spin-waits its OpenMP threads after
    each one (bench.kv_tier at load 18-32 on 2 cores: 15.5 ms a 64 KiB page that way, 0.47 ms this way)."""
    if out.device.type == "cpu" and pool.device.type == "cpu" and out.is_contiguous():
        dst, src, pos = out.view(-1).view(torch.uint8).numpy(), pool.numpy(), 0
        for off, n in segments:
            np.copyto(dst[pos:pos + n], src[off:off + n])
            pos += n
        return
    if len(segments) == 1:
        off, n = segments[0]
        strided = host_strided_bytes(out) if pool.device.type == "cpu" else None
        if strided is not None:  # a host pool page view (SGLang's layer-first layout): one strided memcpy
            np.copyto(strided, pool.numpy()[off:off + n].reshape(strided.shape))
            return
        out.copy_(pool[off:off + n].view(out.dtype).view(out.shape))
        return
    target = out if out.is_contiguous() and out.device == pool.device else torch.empty_like(out, device=pool.device)
    flat = target.reshape(-1).view(torch.uint8)
    pos = 0
    for off, n in segments:
        flat[pos:pos + n].copy_(pool[off:off + n])
        pos += n
    if target is not out:
        out.copy_(target)


def _out_of_pool(pool: torch.Tensor, segments: list[tuple[int, int]], out: Page) -> None:
    if not isinstance(out, Parts):
        _copy_out(pool, segments, out)
        return
    for part, mine in zip(out.tensors, _split(segments, [t.numel() * t.element_size() for t in out.tensors]),
                          strict=True):
        if mine:
            _copy_out(pool, mine, part)


def cache_get(core: Any, keys: Sequence[str], outs: Sequence[Page], namespace: str) -> Operation:
    results: list[bool] = []
    for batch_keys, batch in _batches(keys, outs, namespace, "outs"):
        sizes = [_nbytes(page) for page in batch]
        generation = core._generation
        reply = reply_as(p.CacheSlots, (yield p.CacheGet(req=next(core._reqs), namespace=namespace, keys=batch_keys,
                                                         sizes=sizes), 0.0))
        slots = reply.slots
        hits = [i for i, slot in enumerate(slots)
                if slot is not None] if isinstance(slots, list) and len(slots) == len(batch) else None
        try:
            if hits is None:
                raise ProtocolError(f"cache_slots has {len(slots)} slots for {len(batch)} pages")
            pool = core._pool_of(generation)
            for i in hits:
                segments = _checked_slot(core, slots[i], sizes[i])
                if segments:
                    _out_of_pool(pool, segments, batch[i])
            core._sync_device()
        finally:
            if hits != []:  # (a lease exists only when something was found)
                yield p.CacheRelease(req=next(core._reqs), token=reply.token), NO_REPLY
        found = set(hits)
        results += [i in found for i in range(len(batch))]
    return results


def cache_exists(core: Any, keys: Sequence[str], namespace: str) -> Operation:
    keys = _keys(keys)
    _check_namespace(namespace)
    total = 0
    for start in range(0, len(keys), MAX_BATCH):
        batch = keys[start:start + MAX_BATCH]
        reply = reply_as(p.Ok, (yield p.CacheExists(req=next(core._reqs), namespace=namespace, keys=batch), 0.0))
        if type(reply.value) is not int or not 0 <= reply.value <= len(batch):
            raise ProtocolError(f"cache_exists answered {reply.value!r} for {len(batch)} keys")
        total += reply.value
        if reply.value < len(batch):
            break
    return total


def give_back(request: p.Message, reply: p.CacheSlots, req: int) -> p.Message | None:
    """What returns a late cache_slots' hold (its request was given up on): uncommitted room, or pins."""
    if isinstance(request, p.CachePut) and any(isinstance(slot, list) for slot in reply.slots or ()):
        return p.CacheCommit(req=req, token=reply.token, ok=False)
    if isinstance(request, p.CacheGet) and any(slot is not None for slot in reply.slots or ()):
        return p.CacheRelease(req=req, token=reply.token)
    return None
