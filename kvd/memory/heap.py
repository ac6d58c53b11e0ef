"""The daemon process's malloc tuning: keep ZeroMQ's receive buffers instead of faulting them in again.

libzmq mallocs a fresh buffer for every chunk it receives (4 MiB). By default glibc serves that
with mmap, or trims it off the heap once freed, so every chunk's pages are faulted in and zeroed
again. Serving them from the heap and keeping up to 64 MiB of freed heap removes those faults,
for 25-40 MB more RSS (measured in bench/RESULTS.md, "Where the CPU goes").
"""
from __future__ import annotations

import os
import platform

MALLOC_MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value
MALLOC_TRIM_THRESHOLD = 64 << 20  # freed heap kept: more than a window of chunks in flight


def keep_receive_buffers() -> bool:
    """Stop glibc from handing each received chunk's buffer back to the kernel. A no-op (False)
    off glibc, or when GLIBC_TUNABLES already tunes malloc (the operator's choice wins)."""
    if platform.libc_ver()[0] != "glibc" or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    import ctypes

    libc = ctypes.CDLL(None)
    m_trim_threshold, m_mmap_threshold = -1, -3  # from malloc.h
    return bool(libc.mallopt(m_mmap_threshold, MALLOC_MMAP_THRESHOLD)
                and libc.mallopt(m_trim_threshold, MALLOC_TRIM_THRESHOLD))


def give_back_heap() -> bool:
    """Hand the heap's free pages back to the kernel now (glibc's malloc_trim): after a burst of
    buffers was freed (local clients cut for unfinished messages), so that what they held leaves
    the daemon's RSS instead of staying kept for later. A no-op (False) off glibc."""
    if platform.libc_ver()[0] != "glibc":
        return False
    import ctypes

    return bool(ctypes.CDLL(None).malloc_trim(0))
