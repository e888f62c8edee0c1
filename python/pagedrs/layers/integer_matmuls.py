"""Batch invariance's device form (`DeviceConfig.batch_invariant`; vLLM's VLLM_BATCH_INVARIANT): every
GGUF-quantized weight of a model multiplies through the integer kernels at any row count, so a row's bits
do not depend on the rows beside it."""

from __future__ import annotations

import torch

from pagedrs.layers.device_form import DeviceForm, PrepareOptions, apply_forms
from pagedrs.layers.linear import VocabParallelEmbedding, _LinearBase
from pagedrs.layers.quantized import QuantizedWeight

__all__ = ["IntegerMatmuls", "use_integer_matmuls"]


class IntegerMatmuls(DeviceForm):
    """Batch invariance (`DeviceConfig.batch_invariant`): every GGUF-quantized weight (linear layers,
    embedding tables and output heads) multiplies through the integer kernels at any row count."""

    name = "integer_matmuls"

    def __init__(self) -> None:
        self.weights: dict[int, QuantizedWeight] = {}

    @staticmethod
    def wanted(opts: PrepareOptions) -> bool:
        return opts.integer_matmuls

    def visit(self, name: str, module: torch.nn.Module) -> None:
        w: object = None
        if isinstance(module, _LinearBase):
            w = module.qweight
        elif isinstance(module, VocabParallelEmbedding):
            w = module.quant.weight
        if isinstance(w, QuantizedWeight):
            self.weights[id(w)] = w  # a tied head shares its table's weight: once

    def finish(self, model: torch.nn.Module) -> int:
        for w in self.weights.values():
            w.keep_integer_kernels()
        return len(self.weights)


def use_integer_matmuls(model: torch.nn.Module) -> int:
    """`model`'s GGUF-quantized weights on the integer kernels at any row count (`IntegerMatmuls`);
    returns how many weights."""
    return apply_forms(model, [IntegerMatmuls()])[IntegerMatmuls.name]
