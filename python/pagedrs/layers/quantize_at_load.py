"""`quantization="q8_0"`: a 16/32-bit checkpoint's linear layers and vocabulary table quantized at load to
llama.cpp's Q8_0 blocks (`pagedrs.quantization.gguf_blocks.quantize_to_q8_0`) and multiplied by the same
CPU kernels as a GGUF file's (8-bit weights, 8-bit activations, integer dot products).

Each tensor-parallel rank quantizes its own shard after loading it, so the blocks are the same as one
rank's (a row-parallel shard's input size must be a multiple of 32). A layer whose input size is not a
multiple of 32 stays float32 (logged).
"""

from __future__ import annotations

import logging

import torch

from pagedrs.layers.device_form import DeviceForm, PrepareOptions, apply_forms
from pagedrs.layers.linear import (
    ColumnParallelLinear,
    ReplicatedEmbedding,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedrs.layers.quantized import QuantizedWeight
from pagedrs.quantization.gguf_blocks import Q8_0_BLOCK, quantize_to_q8_0

__all__ = ["QuantizeQ8_0", "quantize_q8_0"]

logger = logging.getLogger("pagedrs.loader")


class QuantizeQ8_0(DeviceForm):
    """Every dense float32 CPU linear weight and vocabulary table to Q8_0, in place (the dense copy is
    dropped)."""

    name = "q8_0"

    def __init__(self) -> None:
        self.done = 0
        self.skipped: list[str] = []

    @staticmethod
    def wanted(opts: PrepareOptions) -> bool:
        return opts.quantize_q8_0

    def visit(self, name: str, m: torch.nn.Module) -> None:
        if isinstance(m, (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear)):
            w = m.weight
            if m.qweight is not None or w.numel() == 0:
                return
            if w.device.type != "cpu" or w.dtype != torch.float32 or w.shape[1] % Q8_0_BLOCK:
                self.skipped.append(f"{name} {tuple(w.shape)}")
                return
            m.qweight = QuantizedWeight([quantize_to_q8_0(w.data)])
            w.data = torch.empty(0, w.shape[1], dtype=w.dtype)
            self.done += 1
        elif isinstance(m, VocabParallelEmbedding) and not isinstance(m, ReplicatedEmbedding):
            if m.quant.weight is not None or m.weight.numel() == 0:
                return  # a tied output head shares its table's slot, quantized once
            held = max(0, min(m.num_embeddings_per_partition, m.num_embeddings - m.vocab_start))
            if not held or m.weight.dtype != torch.float32 or m.embedding_dim % Q8_0_BLOCK:
                self.skipped.append(f"{name} {tuple(m.weight.shape)}")
                return
            m.quant.weight = QuantizedWeight([quantize_to_q8_0(m.weight.data[:held])])
            m.weight.data = torch.empty(0, m.embedding_dim, dtype=m.weight.dtype)
            self.done += 1

    def finish(self, model: torch.nn.Module) -> int:
        if self.skipped:
            logger.info(
                "Q8_0 at load: %d layers stay float32 (not %d-column blocks): %s",
                len(self.skipped),
                Q8_0_BLOCK,
                ", ".join(self.skipped),
            )
        logger.info("weights quantized at load to Q8_0 (the CPU kernels multiply them): %d layers", self.done)
        return self.done


def quantize_q8_0(model: torch.nn.Module) -> int:
    """Quantize `model`'s dense float32 CPU weights to Q8_0 (`QuantizeQ8_0`); returns how many."""
    return apply_forms(model, [QuantizeQ8_0()])[QuantizeQ8_0.name]
