"""Launching a kernel: a `Launch` record (what to run, grid, arguments) and where it runs.

On CUDA the kernel runs on torch's current stream (so it orders with torch's own kernels and is captured
by CUDA graphs) with raw device pointers of the torch tensors as arguments: zero-copy, and cheaper per
launch than building DLPack views. A host executor can be installed for CPU tensors; the test suite
installs its C++ emulator of the kernels (tests/kernels/emu) there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pagedrs.kernels._loader import get_kernel, vector_width

__all__ = ["HostExecutor", "Launch", "launch", "ptr", "same_device", "set_host_executor", "vector_access"]


@dataclass(frozen=True, slots=True)
class Launch:
    source: str  # "cache_kernels" or "paged_attention"
    names: tuple[str, ...]  # the module's instantiations (compiled together)
    name: str  # the kernel's name expression
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int  # dynamic shared memory, bytes
    args: tuple[np.generic, ...]  # exact C types: pointers as np.uint64, int as np.int32, ...


HostExecutor = Callable[[Launch], None]
_host_executor: HostExecutor | None = None
_streams: dict[tuple[int, int], Any] = {}


def set_host_executor(executor: HostExecutor | None) -> HostExecutor | None:
    """Run launches on CPU tensors with `executor` (None: refuse them). Returns the previous one."""
    global _host_executor
    previous, _host_executor = _host_executor, executor
    return previous


def ptr(t: Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def same_device(device: torch.device, **tensors: Tensor) -> None:
    """ValueError naming the first tensor not on `device`."""
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device}")


def vector_access(
    ctype: str, element_size: int, *, elements: tuple[int, ...], tensors: tuple[Tensor, ...]
) -> int:
    """Elements per access: 16-byte vectors when every size/stride/offset (in elements) and every address
    allows them, else 1."""
    vec = vector_width(ctype)
    ok = all(n % vec == 0 for n in elements) and all(t.data_ptr() % 16 == 0 for t in tensors)
    return vec if ok and vec * element_size == 16 else 1


def _cupy_stream(device_index: int, stream: torch.cuda.Stream) -> Any:
    key = (device_index, stream.cuda_stream)
    s = _streams.get(key)
    if s is None:
        import cupy

        from_external = getattr(cupy.cuda.Stream, "from_external", None)
        if from_external is not None:  # CuPy >= 14
            s = from_external(stream)
        else:
            s = cupy.cuda.ExternalStream(stream.cuda_stream, device_index)
        _streams[key] = s
    return s


_DEFAULT_SMEM = 48 * 1024  # dynamic shared memory a kernel gets without opting in
_smem_allowed: dict[int, int] = {}


def _allow_shared_mem(kernel: Any, nbytes: int) -> None:
    """Opt the kernel in to `nbytes` of dynamic shared memory (past 48 KiB; once per kernel and size)."""
    key = id(kernel)
    if _smem_allowed.get(key, 0) < nbytes:
        kernel.max_dynamic_shared_size_bytes = nbytes
        _smem_allowed[key] = nbytes


def launch(spec: Launch, device: torch.device) -> None:
    if any(g <= 0 for g in spec.grid):
        return
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        kernel = get_kernel(spec.source, spec.names, spec.name, index)
        if spec.shared_mem > _DEFAULT_SMEM:
            _allow_shared_mem(kernel, spec.shared_mem)
        with _cupy_stream(index, torch.cuda.current_stream(device)):
            kernel(spec.grid, spec.block, spec.args, shared_mem=spec.shared_mem)
        return
    if _host_executor is None:
        raise RuntimeError(f"pagedrs CUDA kernels need tensors on a CUDA device, got {device}")
    _host_executor(spec)
