"""The GPU staging pool (`--device cuda:N`) and its two paths: CUDA IPC to local clients, pinned
bounce buffers to the network (daemon process; worker processes map it through its IPC handle).

- The pool is one raw `cudaMalloc` allocation (through cupy, so its IPC handle names exactly
  this allocation, not a piece of a caching allocator's block). Its IPC handle goes to
  clients in hello_ok; a client opens it once and copies its tensors in and out with
  device-to-device copies on its own stream, synchronizing before it tells the daemon.
- Outbound chunks are copied device-to-host on a side stream into a ring of pinned buffers and
  sent zero-copy from there; a buffer is reused only once ZeroMQ's tracker says it is done, so
  the copy of chunk k+1 overlaps the network send of chunk k. Inbound frames are copied
  host-to-device through a pinned buffer on the same side stream.

Needs torch built with CUDA and the cupy built for the same CUDA major (`cupy_hint` says which:
the `cuda` extra, `pip install '.[cuda]'`, is cupy-cuda12x, for a CUDA 12 torch). Nothing here runs
without a GPU; tests marked `cuda` exercise it on one.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import torch

from kvd.errors import BadRequest
from kvd.wire.checksum import digest, hasher

from .io import Segments

log = logging.getLogger(__name__)


def cupy_hint(cuda: str | None = torch.version.cuda) -> str:
    """How to install the cupy that matches torch's CUDA (`cuda`: torch.version.cuda, e.g. "12.8"):
    one hint, the same in the daemon's error, the docs and the tests' skip reason."""
    major = (cuda or "12").split(".")[0]
    if major == "12":
        return "pip install '.[cuda]' from kvd's checkout ('kvd-daemon[cuda]'), i.e. cupy-cuda12x"
    return (f"pip install cupy-cuda{major}x (torch is built for CUDA {cuda}; the cuda extra's cupy-cuda12x is "
            "for CUDA 12)")


def _cupy():
    try:
        import cupy
    except ImportError:
        raise BadRequest(f"the CUDA pool needs cupy: {cupy_hint()}") from None
    return cupy


def _device_index(device: str) -> int:
    _, _, index = device.partition(":")
    if not index.isdigit():
        raise BadRequest(f"device must be cuda:N, got {device!r}")
    if not torch.cuda.is_available() or int(index) >= torch.cuda.device_count():
        raise BadRequest(f"--device {device}: no such CUDA device here ({torch.cuda.device_count()} visible)")
    return int(index)


def as_torch(ptr: int, size: int, index: int, owner: object) -> torch.Tensor:
    """A uint8 torch tensor over device memory we do not own (cupy's array interface, no copy)."""
    cupy = _cupy()
    memory = cupy.cuda.UnownedMemory(ptr, size, owner, device_id=index)
    array = cupy.ndarray((size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    return torch.as_tensor(array, device=f"cuda:{index}")


class CudaMemory:
    def __init__(self, size: int, device: str) -> None:
        cupy = _cupy()
        self.kind = device
        self.size = size
        self.index = _device_index(device)
        self.client_path = ""
        with cupy.cuda.Device(self.index):
            self._ptr = cupy.cuda.runtime.malloc(size)
            self.ipc_handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(self._ptr))
        self.tensor = as_torch(self._ptr, size, self.index, self)
        log.info("GPU pool: %d bytes on %s, exported by CUDA IPC", size, device)

    def io(self, chunk_size: int, window: int) -> CudaPoolIO:
        return CudaPoolIO(self.tensor, chunk_size, slots=2 * window + 2)

    def plane_region(self) -> tuple[int, int, str, int]:
        """Where a one-sided plane registers the pool: VRAM, for GPUDirect RDMA and NVLink (cuda_ipc)."""
        return self._ptr, self.size, "VRAM", self.index

    def close(self) -> None:
        if getattr(self, "_ptr", 0):
            cupy = _cupy()
            torch.cuda.synchronize(self.index)
            del self.tensor
            with cupy.cuda.Device(self.index):
                cupy.cuda.runtime.free(self._ptr)
            self._ptr = 0


class CudaPoolIO:
    """GPU pool <-> network through a ring of pinned host buffers."""

    def __init__(self, pool: torch.Tensor, chunk_size: int, slots: int) -> None:
        self.pool = pool
        self.stream = torch.cuda.Stream(device=pool.device)  # copies run beside the compute stream
        self.slots = [torch.empty(chunk_size, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        self.busy: list[Any] = [None] * slots  # per slot: the send future whose tracker still holds it
        self.next = 0
        self.inbound_slot = torch.empty(chunk_size, dtype=torch.uint8, pin_memory=True)

    def _free_slot(self) -> int:
        for _ in range(len(self.slots)):
            index = self.next
            self.next = (self.next + 1) % len(self.slots)
            if _released(self.busy[index]):
                self.busy[index] = None
                return index
        # every slot still with ZeroMQ: wait for the oldest (rare: the ring is twice the window)
        index = self.next
        future = self.busy[index]
        if future.done() and not future.cancelled() and future.exception() is None:
            future.result().wait()
        self.busy[index] = None
        return index

    def outbound(self, segments: Segments) -> tuple[list, object]:
        index = self._free_slot()
        slot = self.slots[index]
        pos = 0
        with torch.cuda.stream(self.stream):
            for off, n in segments:
                slot[pos:pos + n].copy_(self.pool[off:off + n], non_blocking=True)
                pos += n
        self.stream.synchronize()
        return [slot.numpy().data[:pos]], index

    def sent(self, hold: object, tracker_future) -> None:
        self.busy[cast(int, hold)] = tracker_future  # (a hold here is its slot's index)

    def inbound(self, segments: Segments, frames: list, checksum: str) -> int:
        received = digest(checksum, frames)
        staged = self.inbound_slot
        pos = 0
        for frame in frames:
            data = torch.frombuffer(frame, dtype=torch.uint8)
            staged[pos:pos + len(data)].copy_(data)
            pos += len(data)
        pos = 0
        with torch.cuda.stream(self.stream):
            for off, n in segments:
                self.pool[off:off + n].copy_(staged[pos:pos + n], non_blocking=True)
                pos += n
        self.stream.synchronize()  # the chunk is acknowledged only once it is in GPU memory
        return received

    def digest(self, segments: Segments, checksum: str) -> int:
        """Hashed on the host, a staging buffer at a time (a one-sided plane's slice, in GPU memory)."""
        running = hasher(checksum)
        staged, size = self.inbound_slot, len(self.inbound_slot)
        for off, n in segments:
            for pos in range(0, n, size):
                take = min(size, n - pos)
                with torch.cuda.stream(self.stream):
                    staged[:take].copy_(self.pool[off + pos:off + pos + take], non_blocking=True)
                self.stream.synchronize()
                running.update(staged.numpy().data[:take])
        return running.intdigest()


def _released(future) -> bool:
    if future is None:
        return True
    if not future.done():
        return False
    if future.cancelled() or future.exception() is not None:
        return True
    return future.result().done


def open_ipc_pool(handle: bytes, size: int, device: str) -> tuple[torch.Tensor, Callable[[], None]]:
    """Client side: map the daemon's GPU pool once. Returns the tensor and a closer."""
    cupy = _cupy()
    index = _device_index(device)
    with cupy.cuda.Device(index):
        ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle)

    def close() -> None:
        with cupy.cuda.Device(index):
            cupy.cuda.runtime.ipcCloseMemHandle(ptr)

    return as_torch(ptr, size, index, close), close
