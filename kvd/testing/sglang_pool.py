"""A host KV pool with the buffer and page methods of SGLang's MHATokenToKVPoolHost (the test and
benchmark processes; no SGLang import).

Why it exists: SGLang's own host pool module (sglang.srt.mem_cache.pool_host.mha, 0.5.23) imports
SGLang's model configs, which import torchvision and gguf at module level. PyPI's torchvision is
a CUDA build that does not load with the CPU torch ("operator torchvision::nms does not exist"),
and the CPU build lives on PyTorch's index, which CI does not reach. So tests and the benchmark on
a CPU-only machine build this one. It holds the same `kv_buffer` with the same dimensions per
layout and the same `get_data_page` / `get_dummy_flat_data_page` / `set_from_flat_data_page` /
`get_page_buffer_meta` arithmetic as SGLang 0.5.23's class (read from its source);
tests/system/test_sglang_tier.py (slow) checks it against the real class where that imports.
"""
from __future__ import annotations

import torch

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class MHAHostPool:
    """kv_buffer[2 (K, V), ...] of `pages` pages of `page_size` tokens, in SGLang's layouts."""

    def __init__(self, *, layer_num: int, head_num: int, head_dim: int, page_size: int, pages: int,
                 dtype: torch.dtype = torch.bfloat16, layout: str = "page_first") -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.layer_num, self.head_num, self.head_dim, self.v_head_dim = layer_num, head_num, head_dim, head_dim
        self.page_size, self.dtype, self.layout = page_size, dtype, layout
        self.page_num = pages
        self.size = pages * page_size
        self.device, self.pin_memory = "cpu", False
        dims: tuple[int, ...]
        if layout == "layer_first":
            dims = (2, layer_num, self.size, head_num, head_dim)
        elif layout == "page_first":
            dims = (2, self.size, layer_num, head_num, head_dim)
        else:
            dims = (2, pages, layer_num, page_size, head_num, head_dim)
        self.kv_buffer = torch.empty(dims, dtype=dtype)

    def fill_random(self, seed: int) -> None:
        """Random bits in every element (NaN payloads and -0.0 included): bytes, viewed."""
        raw = self.kv_buffer.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index:index + self.page_size]
        elif self.layout == "page_first":
            page = self.kv_buffer[:, index:index + self.page_size]
        else:
            real = index // self.page_size
            page = self.kv_buffer[:, real:real + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        shape = (2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        shape: tuple[int, ...]
        if self.layout == "layer_first":
            shape = (2, self.layer_num, self.page_size, self.head_num, self.head_dim)
            self.kv_buffer[:, :, index:index + self.page_size] = data_page.reshape(shape)
        elif self.layout == "page_first":
            shape = (2, self.page_size, self.layer_num, self.head_num, self.head_dim)
            self.kv_buffer[:, index:index + self.page_size] = data_page.reshape(shape)
        else:
            real = index // self.page_size
            shape = (2, 1, self.layer_num, self.page_size, self.head_num, self.head_dim)
            self.kv_buffer[:, real:real + 1] = data_page.reshape(shape)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """Pointers and byte sizes of each page's K and V (per layer for layer_first), as SGLang's."""
        assert len(indices) % self.page_size == 0
        item = self.head_num * self.head_dim * self.dtype.itemsize
        base = self.kv_buffer.data_ptr()
        v_offset = self.layer_num * self.size * item
        ptrs: list[int] = []
        starts = indices.tolist()[::self.page_size]
        if self.layout == "layer_first":
            for start in starts:
                for layer in range(self.layer_num):
                    k = base + start * item + layer * self.size * item
                    ptrs += [k, k + v_offset]
            return ptrs, [self.page_size * item] * len(ptrs)
        for start in starts:
            k = base + start * self.layer_num * item
            ptrs += [k, k + v_offset]
        return ptrs, [self.layer_num * self.page_size * item] * len(ptrs)
