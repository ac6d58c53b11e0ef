"""Tensors <-> pool bytes in a worker process: dtype mapping and the copies themselves.

Each tensor's bytes are copied exactly once, between the caller's tensor and the shared
pool, with torch's copy (bitwise for equal dtypes: NaN payloads and -0.0 survive).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvd.errors import BadRequest
from kvd.wire.dtypes import DTYPE_ITEMSIZE
from kvd.wire.layout import TensorSpec

# the wire's dtype names are torch's own attribute names (float32, bfloat16, float8_e4m3fn, ...)
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_ITEMSIZE}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}


def memory_problem(tensor: torch.Tensor) -> str | None:
    """Why kvd cannot copy this tensor's bytes as they lie (it copies a dense tensor's memory), or None."""
    if tensor.is_nested:
        return "a nested tensor, which has no one shape: give its components (or torch.nested.to_padded_tensor)"
    if tensor.layout != torch.strided:
        return f"a {tensor.layout} tensor, not a dense one: give tensor.to_dense()"
    if tensor.device.type == "meta":  # has no memory: the bytes would come from, or go to, nowhere
        return "a meta tensor; give one with memory"
    return None


def as_tensor(name: str, value: Any) -> torch.Tensor:
    """A torch tensor for a put value (torch tensors as they are; numpy arrays shared, not copied)."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
    elif isinstance(value, np.ndarray):
        try:
            tensor = torch.from_numpy(np.ascontiguousarray(value))
        except TypeError:
            raise BadRequest(f"tensor {name!r}: numpy dtype {value.dtype} is not supported") from None
    else:
        raise BadRequest(f"tensor {name!r}: expected a torch.Tensor or numpy.ndarray, got {type(value).__name__}")
    if (problem := memory_problem(tensor)) is not None:
        raise BadRequest(f"tensor {name!r} is {problem}")
    if tensor.dtype not in DTYPE_NAMES:
        raise BadRequest(f"tensor {name!r}: dtype {tensor.dtype} is not supported; use one of "
                         f"{', '.join(TORCH_DTYPES)}")
    return tensor


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    if not isinstance(name, str):
        raise BadRequest(f"tensor names must be strings, got {type(name).__name__}")
    return TensorSpec(name, DTYPE_NAMES[tensor.dtype], tuple(tensor.shape))


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _host_bytes(tensor: torch.Tensor) -> np.ndarray | None:
    """A numpy uint8 view of a contiguous CPU tensor, else None.

    Host copies go through numpy: one plain memcpy in this thread. torch would split them over
    its OpenMP threads, whose spin-waiting after each copy steals the CPU the daemons need
    (measured: 64 concurrent 4 MiB puts ran at 0.5 GB/s through torch's copy)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    return _flat_bytes(tensor).numpy()


def host_strided_bytes(tensor: torch.Tensor) -> np.ndarray | None:
    """A strided numpy uint8 view of a non-contiguous CPU tensor whose last dim is dense, else None.

    The same reason as _host_bytes: a page of SGLang's layer-first host pool is such a view, and
    torch's copy of it took 10-23 ms a 512 KiB page on a loaded 2-core host; numpy's, about 1 ms."""
    if tensor.device.type != "cpu" or tensor.is_contiguous() or tensor.dim() == 0 or tensor.stride(-1) != 1:
        return None
    try:
        return tensor.view(torch.uint8).numpy()
    except (RuntimeError, TypeError):  # strides that a byte view cannot express
        return None


def copy_in(pool: torch.Tensor, tensor: torch.Tensor, segments: list) -> None:
    """Caller's tensor -> its pool segments."""
    src = _host_bytes(tensor) if pool.device.type == "cpu" else None
    if src is not None:
        dst, pos = pool.numpy(), 0
        for off, n in segments:
            np.copyto(dst[off:off + n], src[pos:pos + n])
            pos += n
        return
    if len(segments) == 1:
        off, n = segments[0]
        strided = host_strided_bytes(tensor) if pool.device.type == "cpu" else None
        if strided is not None:  # one strided memcpy in this thread
            np.copyto(pool.numpy()[off:off + n].reshape(strided.shape), strided)
            return
        # one typed copy: handles non-contiguous and GPU sources without a temporary
        pool[off:off + n].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        return
    src_t = _flat_bytes(tensor.contiguous().to(pool.device))
    pos = 0
    for off, n in segments:
        pool[off:off + n].copy_(src_t[pos:pos + n])
        pos += n


def copy_out(pool: torch.Tensor, spec: TensorSpec, segments: list, out: torch.Tensor | None) -> torch.Tensor:
    """Pool segments -> `out` (checked to match) or a new tensor on the pool's device."""
    dtype = TORCH_DTYPES[spec.dtype]
    if out is None:
        out = torch.empty(spec.shape, dtype=dtype, device=pool.device)
    # out of the pool, torch's threaded copy wins: a single-thread memcpy from the shared mapping
    # into process memory measured only ~3 GB/s here (into the pool: ~12 GB/s)
    if len(segments) == 1:
        off, n = segments[0]
        out.copy_(pool[off:off + n].view(dtype).view(spec.shape))
        return out
    target = torch.empty(spec.shape, dtype=dtype, device=pool.device)
    flat = _flat_bytes(target)
    pos = 0
    for off, n in segments:
        flat[pos:pos + n].copy_(pool[off:off + n])
        pos += n
    out.copy_(target)
    return out


def check_out(spec: TensorSpec, out: Any) -> None:
    if not isinstance(out, torch.Tensor):
        raise BadRequest(f"out[{spec.name!r}] must be a torch.Tensor")
    if (problem := memory_problem(out)) is not None:  # (the entry is given back, unread)
        raise BadRequest(f"out[{spec.name!r}] is {problem}")
    if DTYPE_NAMES.get(out.dtype) != spec.dtype or tuple(out.shape) != spec.shape:
        raise BadRequest(
            f"out[{spec.name!r}] is {out.dtype} {tuple(out.shape)}, the cache holds {spec.dtype} {spec.shape}"
        )
