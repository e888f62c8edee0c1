"""The quantized CPU path's fused ops: RMSNorms, SiLU-and-muls and rotary embeddings switched to the Rust
CPU ops (one call each instead of several torch ops; the norm's residual add fused in, norm and rotary in
place), and the layers that declare a Rust op of their own (`cpu_fusable`: a Gated DeltaNet's decode
step). For the quantized CPU path only, whose results already differ from the float32 oracle's by more than
the ops' summation order does."""

from __future__ import annotations

from typing import Any, cast

import torch

from pagedrs.layers.activation import SiluAndMul
from pagedrs.layers.device_form import DeviceForm, PrepareOptions, apply_forms
from pagedrs.layers.norm import RMSNorm
from pagedrs.layers.rotary import RotaryEmbedding

__all__ = ["CpuFusedOps", "use_cpu_fused_ops"]


class CpuFusedOps(DeviceForm):
    name = "cpu_fused_ops"

    def __init__(self) -> None:
        self.count = 0

    @staticmethod
    def wanted(opts: PrepareOptions) -> bool:
        return opts.cpu_quantized

    def visit(self, name: str, module: torch.nn.Module) -> None:
        if isinstance(module, (RMSNorm, SiluAndMul, RotaryEmbedding)):
            module.cpu_fused = True
            self.count += 1
        elif getattr(module, "cpu_fusable", False):  # a layer with a Rust CPU op of its own (Gated DeltaNet)
            cast(Any, module).cpu_fused = True
            self.count += 1

    def finish(self, model: torch.nn.Module) -> int:
        return self.count


def use_cpu_fused_ops(model: torch.nn.Module) -> int:
    """Switch `model`'s RMSNorms, SiLU-and-muls and rotary embeddings to the Rust CPU ops; returns how many."""
    return apply_forms(model, [CpuFusedOps()])[CpuFusedOps.name]
