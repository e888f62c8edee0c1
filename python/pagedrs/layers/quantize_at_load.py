"""`quantization="q8_0"`: a 16/32-bit checkpoint's linear layers and vocabulary table quantized at load to
llama.cpp's Q8_0 blocks and multiplied by the same CPU kernels as a GGUF file's (8-bit weights, 8-bit
activations, integer dot products).

Q8_0 (llama.cpp's reference quantizer, as gguf-py computes it): every 32 consecutive weights of a row get
an f16 scale d = max|w| / 127 and int8 values round(w / d). Each tensor-parallel rank quantizes its own
shard after loading it, so the blocks are the same as one rank's (a row-parallel shard's input size must be
a multiple of 32). A layer whose input size is not a multiple of 32 stays float32 (logged).
"""

from __future__ import annotations

import logging

import gguf
import numpy as np
import torch

from pagedrs.layers.linear import (
    ColumnParallelLinear,
    ReplicatedEmbedding,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedrs.layers.quantized import GGUFWeight, QuantizedWeight

__all__ = ["Q8_0_BLOCK", "quantize_q8_0", "quantize_to_q8_0"]

logger = logging.getLogger("pagedrs.loader")

Q8_0_BLOCK = 32
_Q8_0 = gguf.GGMLQuantizationType.Q8_0


def quantize_to_q8_0(w: torch.Tensor) -> GGUFWeight:
    """A float weight [rows, cols] (cols a multiple of 32) as Q8_0 blocks."""
    rows, cols = w.shape
    if cols % Q8_0_BLOCK:
        raise ValueError(
            f"Q8_0 needs a multiple of {Q8_0_BLOCK} columns, got a weight of shape {(rows, cols)}"
        )
    data = gguf.quants.quantize(np.ascontiguousarray(w.detach().to(torch.float32).numpy()), _Q8_0)
    return GGUFWeight(int(_Q8_0), (int(rows), int(cols)), np.ascontiguousarray(data, dtype=np.uint8))


def quantize_q8_0(model: torch.nn.Module) -> int:
    """Quantize every dense float32 CPU linear weight and vocabulary table of `model` to Q8_0 in place (the
    dense copy is dropped); returns how many were quantized."""
    done = 0
    skipped: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear)):
            w = m.weight
            if m.qweight is not None or w.numel() == 0:
                continue
            if w.device.type != "cpu" or w.dtype != torch.float32 or w.shape[1] % Q8_0_BLOCK:
                skipped.append(f"{name} {tuple(w.shape)}")
                continue
            m.qweight = QuantizedWeight([quantize_to_q8_0(w.data)])
            w.data = torch.empty(0, w.shape[1], dtype=w.dtype)
            done += 1
        elif isinstance(m, VocabParallelEmbedding) and not isinstance(m, ReplicatedEmbedding):
            if m.quant.weight is not None or m.weight.numel() == 0:
                continue  # a tied output head shares its table's slot, quantized once
            held = max(0, min(m.num_embeddings_per_partition, m.num_embeddings - m.vocab_start))
            if not held or m.weight.dtype != torch.float32 or m.embedding_dim % Q8_0_BLOCK:
                skipped.append(f"{name} {tuple(m.weight.shape)}")
                continue
            m.quant.weight = QuantizedWeight([quantize_to_q8_0(m.weight.data[:held])])
            m.weight.data = torch.empty(0, m.embedding_dim, dtype=m.weight.dtype)
            done += 1
    if skipped:
        logger.info(
            "Q8_0 at load: %d layers stay float32 (not %d-column blocks): %s",
            len(skipped),
            Q8_0_BLOCK,
            ", ".join(skipped),
        )
    return done
