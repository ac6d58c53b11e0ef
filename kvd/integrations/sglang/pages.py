"""SGLang host-pool pages as tensors for the KV tier (SGLang's scheduler process; no SGLang import, duck-typed).

SGLang's host pools (MHATokenToKVPoolHost, MLATokenToKVPoolHost, ...) give a page through
`get_data_page(index, flat=False)`: for every layout (layer_first, page_first, page_first_direct)
a strided view of the pool's own buffer, no copy. The KV tier copies straight between such a view
and its shared pool, so the v1 path moves each page's bytes once each way. The pointer tables of
`get_page_buffer_meta` (what Mooncake and NIXL register) name the same memory, split per K/V
(and per layer for layer_first); a view covers all of them as one page under one key.

A pool whose data page is not a view of its buffer (checked once, at registration) gets SGLang's
generic path instead: a flat copy out (`get_data_page(flat=True)`) and `set_from_flat_data_page`
in, two copies each way, as SGLang itself does for such backends.

The bytes stored for a page are its view's elements in row-major order: exactly what the generic
path's flat page holds, so pages written by either path read back through the other.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def _buffers(host_pool: Any) -> list[torch.Tensor]:
    buffer = getattr(host_pool, "kv_buffer", None)
    if isinstance(buffer, torch.Tensor):
        return [buffer]
    if isinstance(buffer, (list, tuple)):
        return [b for b in buffer if isinstance(b, torch.Tensor)]
    return []


def _is_view(page: torch.Tensor, buffers: list[torch.Tensor]) -> bool:
    """Whether page shares its storage with one of the pool's buffers (a view, not a copy)."""
    storage = page.untyped_storage().data_ptr()
    return page.numel() > 0 and any(b.untyped_storage().data_ptr() == storage for b in buffers)


class HostPages:
    """One host pool's pages: the tensors a put copies from and a get copies into."""

    def __init__(self, host_pool: Any) -> None:
        self.pool = host_pool
        self.page_size = int(host_pool.page_size)
        self.layout = str(getattr(host_pool, "layout", "unknown"))
        probe = host_pool.get_data_page(0, flat=False)
        self.dtype: torch.dtype = probe.dtype
        self.shape: tuple[int, ...] = tuple(probe.shape)
        self.nbytes = probe.numel() * probe.element_size()
        # a view of the pool's memory (one copy each way) or a copy (SGLang's generic path)
        self.zero_copy = probe.device.type == "cpu" and _is_view(probe, _buffers(host_pool))

    def starts(self, nkeys: int, host_indices: torch.Tensor | Sequence[int]) -> list[int]:
        """The first token index of each page: host_indices holds page_size indices per key."""
        count = host_indices.numel() if isinstance(host_indices, torch.Tensor) else len(host_indices)
        if count != nkeys * self.page_size:
            raise ValueError(f"{count} host indices for {nkeys} keys of {self.page_size} tokens each")
        indices = host_indices[::self.page_size]
        return [int(i) for i in (indices.tolist() if isinstance(indices, torch.Tensor) else indices)]

    def sources(self, starts: list[int]) -> list[torch.Tensor]:
        """The pages to store: views of the pool (zero copy), or flat copies."""
        get = self.pool.get_data_page
        return [get(s, flat=False) for s in starts] if self.zero_copy else [get(s, flat=True) for s in starts]

    def targets(self, starts: list[int]) -> tuple[list[torch.Tensor], Callable[[list[bool]], None]]:
        """Where to read pages into, and what to call with the hits afterwards (nothing for
        views; for copies, SGLang's set_from_flat_data_page of each page found)."""
        if self.zero_copy:
            get = self.pool.get_data_page
            return [get(s, flat=False) for s in starts], lambda found: None
        outs = [self.pool.get_dummy_flat_data_page() for _ in starts]

        def land(found: list[bool]) -> None:
            for start, out, hit in zip(starts, outs, found, strict=False):
                if hit:
                    self.pool.set_from_flat_data_page(start, out)

        return outs, land
