"""kvd's KV tier as SGLang's HiCache L3 storage backend (SGLang's scheduler process):

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "kvd", "module_path": "kvd.integrations.sglang",
        "class_name": "KvdHiCacheStorage", "interface_v1": 1}'

`KvdHiCacheStorage` (storage.py) imports SGLang, so it is loaded on first use (SGLang's factory
asks for it by name); naming, pages, guard and settings are pure and import without SGLang.
"""
from __future__ import annotations

from typing import Any

__all__ = ["KvdHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "KvdHiCacheStorage":
        from .storage import KvdHiCacheStorage

        return KvdHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
