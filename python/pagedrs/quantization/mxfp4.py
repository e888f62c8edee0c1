"""MXFP4 (OCP microscaling FP4), as gpt-oss checkpoints ship their experts: a weight [..., rows, cols] is
stored as `<name>_blocks` uint8 [..., rows, cols / 32, 16] (two FP4 e2m1 values a byte, the even element
in the low nibble) and `<name>_scales` uint8 [..., rows, cols / 32] (an e8m0 exponent per 32-element
block: the block's values are multiplied by 2 ** (scale - 127)). The layout of OpenAI's format and of
HF's `integrations.mxfp4`.

Loaded dequantized at load (`mxfp4_checkpoint`): the pair becomes `<name>` in the layout HF's dequantizer
gives (the last two dims swapped: [..., cols, rows], as HF's GptOssExperts holds `gate_up_proj` and
`down_proj`), so a model's loader takes an MXFP4 and a float checkpoint alike.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = ["FP4_E2M1_VALUES", "dequantize_mxfp4", "mxfp4_checkpoint"]

logger = logging.getLogger("pagedrs.loader")

# FP4 e2m1 by its 4-bit code: sign bit 3, exponent bits 2-1, mantissa bit 0
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # elements per scale
_CHUNK = 1 << 20  # 32-element blocks dequantized at a time


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in `dtype` (exact in float32)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
            f"(blocks [..., G, {BLOCK // 2}], scales [..., G])"
        )
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    flat_blocks, flat_scales = blocks.reshape(-1, BLOCK // 2), scales.reshape(-1)
    out = torch.empty(flat_blocks.shape[0], BLOCK, dtype=dtype)
    for start in range(0, flat_blocks.shape[0], _CHUNK):  # bounded temporaries (a real layer is ~1e9 values)
        b = flat_blocks[start : start + _CHUNK]
        codes = torch.stack([b & 0x0F, b >> 4], dim=-1).long()  # [n, 16, 2]: the low nibble first
        values = lut[codes].reshape(-1, BLOCK)
        exps = flat_scales[start : start + _CHUNK].to(torch.int32)[:, None] - 127
        out[start : start + _CHUNK] = torch.ldexp(values, exps)
    return out.reshape(*blocks.shape[:-2], -1)


def mxfp4_checkpoint(weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """`weights` with each `<name>_blocks` / `<name>_scales` pair replaced by `<name>`, float32 [..., cols,
    rows] (HF's layout after dequantizing); other tensors pass through. ValueError naming the tensor when
    one of a pair is missing."""
    pending: dict[str, dict[str, Tensor]] = {}
    done = 0
    for name, t in weights:
        prefix, sep, part = name.rpartition("_")
        if not sep or part not in ("blocks", "scales"):
            yield name, t
            continue
        read = getattr(t, "materialize", None)
        got = pending.setdefault(prefix, {})
        got[part] = read() if read is not None else t
        if len(got) == 2:
            del pending[prefix]
            done += 1
            yield prefix, dequantize_mxfp4(got["blocks"], got["scales"]).transpose(-1, -2).contiguous()
    for prefix, got in pending.items():
        missing = "scales" if "blocks" in got else "blocks"
        raise ValueError(f"{prefix}: MXFP4 weight without its {prefix}_{missing}")
    if not done:
        raise ValueError("the checkpoint declares MXFP4 but holds no *_blocks / *_scales tensors")
    logger.info("MXFP4 weights dequantized at load: %d tensors", done)
