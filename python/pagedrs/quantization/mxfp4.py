"""MXFP4 (OCP microscaling FP4), as gpt-oss checkpoints ship their experts: a weight [..., rows, cols] is
stored as `<name>_blocks` uint8 [..., rows, cols / 32, 16] (two FP4 e2m1 values a byte, the even element
in the low nibble) and `<name>_scales` uint8 [..., rows, cols / 32] (an e8m0 exponent per 32-element
block: the block's values are multiplied by 2 ** (scale - 127)). The layout of OpenAI's format and of
HF's `integrations.mxfp4`.

`mxfp4_checkpoint` turns the pair into `<name>` in the layout HF's dequantizer gives (the last two dims
swapped: [..., cols, rows], as HF's GptOssExperts holds `gate_up_proj` and `down_proj`), so a model's
loader takes an MXFP4 and a float checkpoint alike. Where the CPU kernels run (`keep=True`: CPU, dtype
"auto") the weight stays 4-bit: an `Mxfp4Experts` holding ggml's MXFP4 blocks (`block_mxfp4`, GGML type
39), which the stacked experts kernel multiplies; elsewhere (CUDA, an explicit dtype) it is dequantized
to float32 at load.

OpenAI's blocks and ggml's hold the same values exactly: ggml stores the e8m0 byte then the codes with
element j in the low nibble of byte j and element j + 16 in its high nibble, and its table is the e2m1
values doubled with the scale halved (`kvalues_mxfp4` x 2^(e - 128)), so only the nibbles move.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from pagedrs.quantization.gguf_blocks import GGUFWeight

__all__ = [
    "FP4_E2M1_VALUES",
    "GGML_MXFP4",
    "Mxfp4Experts",
    "dequantize_mxfp4",
    "mxfp4_checkpoint",
    "to_ggml_mxfp4",
]

logger = logging.getLogger("pagedrs.loader")

# FP4 e2m1 by its 4-bit code: sign bit 3, exponent bits 2-1, mantissa bit 0
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # elements per scale
_CHUNK = 1 << 20  # 32-element blocks dequantized at a time
GGML_MXFP4 = 39  # gguf.GGMLQuantizationType.MXFP4: ggml's block_mxfp4, 17 bytes a block of 32


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in `dtype` (exact in float32)."""
    _check_pair(blocks, scales)
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


def _check_pair(blocks: Tensor, scales: Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
            f"(blocks [..., G, {BLOCK // 2}], scales [..., G])"
        )


def to_ggml_mxfp4(blocks: Tensor, scales: Tensor) -> npt.NDArray[np.uint8]:
    """OpenAI's blocks uint8 [..., G, 16] (element 2j in the low nibble of byte j) and e8m0 scales [..., G]
    -> ggml's MXFP4 rows uint8 [..., G * 17] (per block: the scale byte, then element j in the low nibble
    of byte j and j + 16 in the high one). Lossless: the same values, the same e8m0 byte."""
    _check_pair(blocks, scales)
    flat = blocks.reshape(-1, BLOCK // 2).numpy()
    out = np.empty((flat.shape[0], 1 + BLOCK // 2), dtype=np.uint8)
    out[:, 0] = scales.reshape(-1).numpy()
    for start in range(0, flat.shape[0], _CHUNK):  # bounded temporaries, as `dequantize_mxfp4`
        b = flat[start : start + _CHUNK]
        codes = np.empty((b.shape[0], BLOCK), dtype=np.uint8)
        codes[:, 0::2], codes[:, 1::2] = b & 0x0F, b >> 4
        out[start : start + _CHUNK, 1:] = codes[:, : BLOCK // 2] | (codes[:, BLOCK // 2 :] << 4)
    return out.reshape(*blocks.shape[:-2], -1)


@dataclass(frozen=True, slots=True)
class Mxfp4Experts:
    """A stacked expert weight kept in MXFP4: `data` uint8 [E, rows, cols / 32 * 17], ggml MXFP4 blocks,
    one row per output of an expert (its blocks along the input). `shape` is HF's layout of the same
    tensor, [E, cols, rows] (GptOssExperts' `gate_up_proj` [E, H, 2I], `down_proj` [E, I, H]), and
    `materialize()` gives it as float32, equal to what the dequantize-at-load path gives."""

    data: npt.NDArray[np.uint8]
    shape: tuple[int, int, int]

    def expert_rows(self, e: int, start: int = 0, step: int = 1) -> GGUFWeight:
        """Rows start, start + step, ... of expert `e` (gpt-oss's interleaved gate/up: step 2), as a
        GGUF weight [rows, cols]."""
        rows = self.data[e, start::step]
        return GGUFWeight(GGML_MXFP4, (int(rows.shape[0]), self.shape[1]), rows)

    def materialize(self) -> Tensor:
        import gguf

        e, cols, rows = self.shape
        w = gguf.quants.dequantize(self.data, gguf.GGMLQuantizationType(GGML_MXFP4))
        return (
            torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).view(e, rows, cols).transpose(-1, -2)
        )


def mxfp4_checkpoint(weights: Iterator[tuple[str, Any]], *, keep: bool = False) -> Iterator[tuple[str, Any]]:
    """`weights` with each `<name>_blocks` / `<name>_scales` pair replaced by `<name>`, float32 [..., cols,
    rows] (HF's layout after dequantizing), or with `keep` an `Mxfp4Experts` of that shape (stacked
    [E, rows, G, 16] pairs; others are dequantized); other tensors pass through. ValueError naming the
    tensor when one of a pair is missing."""
    pending: dict[str, dict[str, Tensor]] = {}
    done = kept = 0
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
            blocks, scales = got["blocks"], got["scales"]
            if keep and blocks.dim() == 4:
                e, rows, groups, _ = blocks.shape
                kept += 1
                yield prefix, Mxfp4Experts(to_ggml_mxfp4(blocks, scales), (e, groups * BLOCK, rows))
            else:
                yield prefix, dequantize_mxfp4(blocks, scales).transpose(-1, -2).contiguous()
    for prefix, got in pending.items():
        missing = "scales" if "blocks" in got else "blocks"
        raise ValueError(f"{prefix}: MXFP4 weight without its {prefix}_{missing}")
    if not done:
        raise ValueError("the checkpoint declares MXFP4 but holds no *_blocks / *_scales tensors")
    if kept:
        logger.info("MXFP4 weights kept 4-bit (the CPU experts kernel multiplies them): %d tensors", kept)
    if done > kept:
        logger.info("MXFP4 weights dequantized at load: %d tensors", done - kept)
