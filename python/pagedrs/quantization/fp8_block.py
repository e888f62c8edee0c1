"""A block-scaled FP8 weight as the block-FP8 checkpoints ship it (`quant_method: fp8` with
`weight_block_size`, as Qwen3-*-FP8 and DeepSeek-V3 write it; compressed-tensors' `block` strategy):
`weight` float8_e4m3fn [out, in] and `weight_scale_inv` float32 [ceil(out / br), ceil(in / bc)], one scale
per br x bc tile, w = fp8 * scale (the name is DeepSeek's; the scale multiplies).

`Fp8Block` answers the lazy checkpoint-slice protocol the layers' weight loaders use (`shape`, `dim()`,
`narrow()`, `materialize()`: float32 dequantized), so a layer that keeps only dense weights loads it
dequantized, as before; the mixture-of-experts layer keeps its experts' pieces in fp8 for the fused
experts kernel (`pagedrs.layers.moe.kernel_form`). A tensor-parallel rank's cut of the rows keeps the
blocks when it falls on them, else carries one scale row per weight row (exact either way); a cut of the
columns inside a block (a row-parallel share that is not whole blocks, which vLLM refuses) gives the
float32 dequantized slice instead, logged once: that projection is then held dense.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from pagedrs.quantization.dequant import dequantize_fp8

__all__ = ["Fp8Block"]

logger = logging.getLogger("pagedrs.loader")
_warned: set[tuple[int, int]] = set()


def _warn_cut(start: int, length: int, block: tuple[int, int]) -> None:
    if block not in _warned:
        _warned.add(block)
        logger.warning(
            "FP8 columns %d..%d cut inside their %dx%d scale blocks (a tensor-parallel share that is not "
            "whole blocks): those weights are held dequantized; a tensor-parallel size that keeps whole "
            "blocks per rank keeps them fp8",
            start,
            start + length,
            *block,
        )


@dataclass(frozen=True)
class Fp8Block:
    """An fp8 weight [out, in] with a float32 scale per `block` (rows, cols) tile: `scale`
    [ceil(out / rows), ceil(in / cols)]."""

    weight: Tensor
    scale: Tensor
    block: tuple[int, int]

    def __post_init__(self) -> None:
        out_f, in_f = self.weight.shape
        br, bc = self.block
        want = (-(-out_f // br), -(-in_f // bc))
        if self.weight.dtype != torch.float8_e4m3fn or tuple(self.scale.shape) != want:
            raise ValueError(
                f"a block-FP8 weight of shape {(out_f, in_f)} with blocks {self.block} needs "
                f"float8_e4m3fn data and a scale of shape {want}, got {self.weight.dtype} and "
                f"{tuple(self.scale.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.weight.shape[0]), int(self.weight.shape[1])

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel() * 4

    def dim(self) -> int:
        return 2

    def per_row(self) -> Fp8Block:
        """The same weight with one scale row per weight row (blocks of 1 x cols): exact."""
        if self.block[0] == 1:
            return self
        rows = self.scale.repeat_interleave(self.block[0], 0)[: self.shape[0]].contiguous()
        return Fp8Block(self.weight, rows, (1, self.block[1]))

    def narrow(self, dim: int, start: int, length: int) -> Fp8Block | Tensor:
        """Rows (dim 0), or columns (dim 1) on whole blocks; a column cut inside a block gives the float32
        dequantized slice (the layer holds it dense)."""
        br, bc = self.block
        if dim == 0:
            if start % br:
                return self.per_row().narrow(0, start, length)
            end = -(-(start + length) // br)
            return Fp8Block(self.weight.narrow(0, start, length), self.scale[start // br : end], self.block)
        if dim != 1:
            raise ValueError(f"an FP8 weight has 2 dimensions, got dim={dim}")
        if start % bc or (length % bc and start + length != self.shape[1]):
            _warn_cut(start, length, self.block)
            return self.materialize().narrow(1, start, length)
        end = -(-(start + length) // bc)
        return Fp8Block(self.weight.narrow(1, start, length), self.scale[:, start // bc : end], self.block)

    def materialize(self) -> Tensor:
        """float32 [out, in]: the format's dequantized values (the loader's)."""
        return dequantize_fp8("", self.weight, self.scale, self.block)
