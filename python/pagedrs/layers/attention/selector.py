"""Picks the attention backend by name: "auto", "torch" or "cupy".

The "cupy" backend is the class `CupyAttentionBackend` of `pagedrs.layers.attention.cupy` (imported only
when asked for); its constructor takes the device, or nothing."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from pagedrs.layers.attention import AttentionBackend

__all__ = ["BACKEND_NAMES", "get_attention_backend"]

BACKEND_NAMES = ("auto", "torch", "cupy")


def _cupy_available() -> bool:
    try:
        importlib.import_module("cupy")
    except Exception:
        return False
    return True


def get_attention_backend(
    name: str, device: torch.device | str, *, batch_invariant: bool = False
) -> AttentionBackend:
    """ "auto": "cupy" on CUDA when cupy imports, else "torch"; "torch": the reference; "cupy": CUDA kernels.
    `batch_invariant`: the torch backend's every query through the per-token CPU kernel (`DeviceConfig`)."""
    device = torch.device(device)
    if name == "auto":
        name = "cupy" if device.type == "cuda" and _cupy_available() and _has_cupy_backend() else "torch"
    if name == "torch":
        from pagedrs.layers.attention.torch_ref import TorchAttentionBackend

        return TorchAttentionBackend(batch_invariant=batch_invariant)
    if batch_invariant:
        raise ValueError(f"batch_invariant runs on the 'torch' attention backend (on a CPU), not {name!r}")
    if name == "cupy":
        if device.type != "cuda":
            raise ValueError(f"attention backend 'cupy' needs a CUDA device, got {device}")
        module = importlib.import_module("pagedrs.layers.attention.cupy")
        backend_cls = getattr(module, "CupyAttentionBackend", None)
        if backend_cls is None:
            raise ValueError("pagedrs.layers.attention.cupy defines no CupyAttentionBackend")
        return backend_cls(device) if _takes_device(backend_cls) else backend_cls()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")


def _has_cupy_backend() -> bool:
    return importlib.util.find_spec("pagedrs.layers.attention.cupy") is not None


def _takes_device(cls: type) -> bool:
    import inspect

    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
    return len(params) > 0
