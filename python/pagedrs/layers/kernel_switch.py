"""Layers with two implementations: torch code (the CPU path, and the oracle the kernels are tested
against) and a fused CUDA kernel from cuda/layer_ops.cu (pagedrs.kernels.layer_ops).

A layer runs its kernel once `use_layer_kernels(model)` switched it on; the model runner does so with the
"cupy" attention backend (CUDA with CuPy), so the torch backend keeps the whole model on torch ops. The
kernel path handles the shapes the models produce (2-d [tokens, features] activations with a contiguous last
dim, in the weights' dtype); anything else takes the torch path.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from pagedrs.layers.device_form import DeviceForm, PrepareOptions, apply_forms

__all__ = ["KERNEL_DTYPES", "KernelLayer", "LayerKernels", "SwitchesKernels", "use_layer_kernels"]


KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class KernelLayer(torch.nn.Module):
    """A module whose forward takes the fused kernel when `use_kernels` is set and `fits` its inputs."""

    use_kernels: bool = False

    def fits(self, *tensors: Tensor) -> bool:
        """Kernels on, and every tensor 2-d with a contiguous last dim in one kernel dtype."""
        dtype = tensors[0].dtype
        return (
            self.use_kernels
            and dtype in KERNEL_DTYPES
            and all(t.dim() == 2 and t.stride(1) == 1 and t.dtype == dtype for t in tensors)
        )


@runtime_checkable
class SwitchesKernels(Protocol):
    """A layer that re-chooses how it runs when the layer kernels are switched (moe.FusedExperts: its
    experts method, the CUDA kernels of cuda/moe_ops.cu or not)."""

    def use_cuda_kernels(self, enabled: bool) -> None: ...


class LayerKernels(DeviceForm):
    """Every KernelLayer switched to its fused kernel, or back to torch; every SwitchesKernels told."""

    name = "layer_kernels"

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.count = 0

    @classmethod
    def for_options(cls, opts: PrepareOptions) -> LayerKernels | None:
        return None if opts.layer_kernels is None else cls(opts.layer_kernels)

    @staticmethod
    def wanted(opts: PrepareOptions) -> bool:
        return opts.layer_kernels is not None

    def visit(self, name: str, module: torch.nn.Module) -> None:
        if isinstance(module, KernelLayer):
            module.use_kernels = self.enabled
            self.count += 1
        elif isinstance(module, SwitchesKernels):
            module.use_cuda_kernels(self.enabled)
            self.count += 1

    def finish(self, model: torch.nn.Module) -> int:
        return self.count


def use_layer_kernels(model: torch.nn.Module, enabled: bool = True) -> int:
    """Switch every KernelLayer of `model` to its fused kernel (or back to torch); returns how many."""
    return apply_forms(model, [LayerKernels(enabled)])[LayerKernels.name]
