"""Quantized experts kept for the CUDA fused experts kernel (cuda/moe_ops.cu, as vLLM's fused_moe keeps
them): each expert's pieces (gate, up or down, this rank's share) stacked into the kernel's layout, an
`ExpertMatrix` on the layer's device.

- GGUF Q8_0 pieces on a CUDA device: uint8 [E, rows, cols / 32 * 34], each row its blocks in file order
  (other GGUF types are dequantized at load on CUDA; on a CPU the Rust kernels take them, `stacked_quant`).
- FP8 e4m3 pieces (`Fp8`: a per-tensor or per-channel scale; `Fp8Block`: the block-FP8 checkpoints'
  `weight_scale_inv`, one scale per 128 x 128 tile): fp8 [E, rows, cols] with float32 scales per row or per
  block. The blocks are kept when every piece's rows are whole blocks (the scale rows of gate and up then
  follow each other as the kernel indexes them), else each weight row carries its own row of block scales
  (exact either way).

`dequantized` gives the float32 values (the layer's torch path off the GPU, and the tests' oracle)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from pagedrs.quantization.dequant import dequantize_fp8
from pagedrs.quantization.fp8_block import Fp8Block
from pagedrs.quantization.gguf_blocks import GGUFWeight
from pagedrs.quantization.packed_parts import Fp8

if TYPE_CHECKING:
    from pagedrs.kernels.moe_ops import ExpertMatrix

__all__ = ["dequantized", "kernel_piece", "kernel_device", "stack_for_kernel"]

_Q8_0 = 8  # gguf.GGMLQuantizationType.Q8_0
_Q8_0_BYTES = 34


def kernel_device(t: Tensor) -> bool:
    """Whether experts on this tensor's device (a parameter at load, the activations at run time) take the
    CUDA kernels (the tests patch this to run them on CPU tensors through the kernel emulator)."""
    return t.device.type == "cuda"


def kernel_piece(piece: Any) -> bool:
    """Whether a loaded piece is in a form the kernel multiplies: FP8 e4m3, or GGUF Q8_0."""
    if isinstance(piece, (Fp8, Fp8Block)):
        return piece.weight.dtype == torch.float8_e4m3fn
    return isinstance(piece, GGUFWeight) and piece.ggml_type == _Q8_0


def _as_blocks(p: Fp8 | Fp8Block) -> Fp8Block:
    """A per-tensor or per-channel piece as one block of 1 x cols per row."""
    if isinstance(p, Fp8Block):
        return p
    rows, cols = p.shape
    scale = p.scale.to(torch.float32).reshape(-1)
    scale = scale.expand(rows) if scale.numel() == 1 else scale
    return Fp8Block(p.weight, scale.reshape(rows, 1).contiguous(), (1, max(cols, 1)))


def _stack_fp8(pieces: list[Any], per: int, cols: int, device: torch.device) -> ExpertMatrix | None:
    from pagedrs.kernels.moe_ops import ExpertMatrix

    blocks = [_as_blocks(p) for p in pieces]
    bcs = {b.block[1] for b in blocks}
    if len(bcs) != 1:
        return None  # per-channel and block pieces in one weight: the caller dequantizes
    bc = bcs.pop()
    brs = {b.block[0] for b in blocks}
    br = brs.pop() if len(brs) == 1 else 1
    if br > 1 and any(b.shape[0] % br for b in blocks):
        br = 1
    if br == 1:
        blocks = [b.per_row() for b in blocks]
    experts = len(blocks) // per

    def stacked(part: str) -> Tensor:
        per_expert = [
            torch.cat([getattr(b, part) for b in blocks[e * per : (e + 1) * per]]) for e in range(experts)
        ]
        return torch.stack(per_expert).to(device).contiguous()

    weight, scale = stacked("weight"), stacked("scale").to(torch.float32)
    if br == 1 and bc >= cols:  # one scale per row: the kernel's per-channel form
        return ExpertMatrix(weight, "fp8", scale.reshape(experts, -1).contiguous())
    return ExpertMatrix(weight, "fp8", scale, block=(br, bc))


def stack_for_kernel(pieces: list[Any], per: int, cols: int, device: torch.device) -> ExpertMatrix | None:
    """The pieces (expert by expert, `per` pieces each, in row order) as one kernel weight on `device`, or
    None when they do not share a form the kernel takes (the caller dequantizes them)."""
    from pagedrs.kernels.moe_ops import ExpertMatrix

    if all(isinstance(p, GGUFWeight) and p.ggml_type == _Q8_0 for p in pieces):
        experts = len(pieces) // per
        data = np.stack(
            [np.concatenate([p.data for p in pieces[e * per : (e + 1) * per]]) for e in range(experts)]
        )
        blocks = torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8)).to(device)
        return ExpertMatrix(blocks, "q8_0", cols=cols)
    if all(isinstance(p, (Fp8, Fp8Block)) for p in pieces):
        return _stack_fp8(pieces, per, cols, device)
    return None


def dequantized(m: ExpertMatrix) -> Tensor:
    """float32 [E, rows, cols]: the values the kernel multiplies."""
    e, rows, cols = m.shape
    if m.form == "q8_0":
        blocks = m.data.reshape(e, rows, cols // 32, _Q8_0_BYTES)
        d = blocks[..., :2].contiguous().view(torch.float16).to(torch.float32)
        q = blocks[..., 2:].contiguous().view(torch.int8).to(torch.float32)
        return (d * q).reshape(e, rows, cols)
    if m.form == "fp8":
        assert m.scale is not None
        return torch.stack(
            [dequantize_fp8("expert", w, s, m.block) for w, s in zip(m.data, m.scale, strict=True)]
        )
    return m.data.to(torch.float32)
