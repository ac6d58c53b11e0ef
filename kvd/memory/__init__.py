"""Pool memory, at both ends of its mapping: the one device interface (daemon and worker processes).

`StagingMemory` is what the daemon needs from memory: a size, a path or handle clients use to
map the same bytes, and how chunk bytes move between it and the network (`io`). `HostMemory`
(`host.py`) is the CPU default; `CudaMemory` (`cuda.py`, torch and cupy, imported only for
`--device cuda:N`) is a GPU pool behind the same interface. A client maps a host pool with
`host.map_pool` and a GPU pool with `cuda.open_ipc_pool`.
"""
from __future__ import annotations

import typing

from kvd.errors import BadRequest

from .host import HostMemory, check_fits_in_ram  # noqa: F401 (kvd.daemon's, from here)
from .io import PoolIO


class StagingMemory(typing.Protocol):
    kind: str  # "cpu" or "cuda:N"
    size: int
    client_path: str  # what a local client opens to map a host pool ("" for a GPU pool)
    @property
    def ipc_handle(self) -> bytes | None:
        """CUDA IPC handle of a GPU pool (None for a host pool)."""
        ...

    def io(self, chunk_size: int, window: int) -> PoolIO:
        """How peer transfers move chunk bytes between this memory and the network."""
        ...

    def plane_region(self) -> tuple[int, int, str, int]:
        """Where a one-sided plane registers the pool: (address, size, "DRAM" or "VRAM", device)."""
        ...

    def close(self) -> None: ...


def open_staging_memory(device: str, size: int, path: str = "", prefault: bool = True) -> StagingMemory:
    if device == "cpu":
        return HostMemory(size, path, prefault)
    if device.startswith("cuda"):
        from .cuda import CudaMemory  # needs torch with CUDA and its cupy (cuda.cupy_hint says which)

        return CudaMemory(size, device)
    raise BadRequest(f"unknown device {device!r}: expected cpu or cuda:N")
