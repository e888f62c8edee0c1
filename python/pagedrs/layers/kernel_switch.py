"""Layers with two implementations: torch code (the CPU path, and the oracle the kernels are tested
against) and a fused CUDA kernel from cuda/layer_ops.cu (pagedrs.kernels.layer_ops).

A layer runs its kernel once `use_layer_kernels(model)` switched it on; the model runner does so with the
"cupy" attention backend (CUDA with CuPy), so the torch backend keeps the whole model on torch ops. The
kernel path handles the shapes the models produce (2-d [tokens, features] activations in the weights'
dtype); anything else takes the torch path.
"""

from __future__ import annotations

import torch

__all__ = ["KernelLayer", "use_layer_kernels"]


class KernelLayer(torch.nn.Module):
    """A module whose forward takes the fused kernel when `use_kernels` is set."""

    use_kernels: bool = False


def use_layer_kernels(model: torch.nn.Module, enabled: bool = True) -> int:
    """Switch every KernelLayer of `model` to its fused kernel (or back to torch); returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, KernelLayer):
            module.use_kernels = enabled
            count += 1
    return count
