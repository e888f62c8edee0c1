"""GPTQ / AWQ int weights and FP8 weights kept in their checkpoint form in GPU memory.

On a GPU a quantized checkpoint's linear layers keep their packed tensors (weight memory is the packed
size) and multiply through them, as vLLM does. `DevicePackedWeight` is a layer's weight format once its
pieces (q|k|v, gate|up; `pagedrs.quantization.packed_parts`) are in:

- `PackedInt` pieces (GPTQ, AWQ): a matmul dequantizes the weight with the CUDA kernels of
  cuda/quant_ops.cu into a scratch buffer shared by every layer (transposed, [in, out]) and multiplies with
  cuBLAS (`torch.mm`): vLLM's dequantize-then-GEMM path for large batches.
- `Fp8` pieces: where the device multiplies fp8 (sm_89 and later), the activations are bfloat16 and both
  sizes are multiples of 16 (what its kernels take), `torch._scaled_mm` takes the activations quantized
  per token to e4m3 (vLLM's dynamic per-token W8A8); elsewhere the weight is converted to the activations'
  dtype and scaled per call (weight-only, W8A16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedrs.quantization.packed_parts import Fp8, PackedInt, PackedPiece

__all__ = ["DevicePackedWeight", "fp8_matmul_supported"]

_FP8_MAX = 448.0  # largest finite float8_e4m3fn

_scratch: dict[tuple[torch.device, torch.dtype], Tensor] = {}


def _scratch_wt(device: torch.device, dtype: torch.dtype, rows: int, cols: int) -> Tensor:
    """A [rows, cols] buffer shared by every packed layer on the device (layers run one at a time on one
    stream); grown to the largest layer, so weight memory stays the packed size plus one layer."""
    key = (device, dtype)
    buf = _scratch.get(key)
    if buf is None or buf.numel() < rows * cols:
        buf = torch.empty(rows * cols, dtype=dtype, device=device)
        _scratch[key] = buf
    return buf[: rows * cols].view(rows, cols)


def fp8_matmul_supported(device: torch.device) -> bool:
    """Whether the device multiplies fp8 (CUDA sm_89 and later, where `torch._scaled_mm` runs)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _fits_scaled_mm(p: Fp8) -> bool:
    return p.shape[0] % 16 == 0 and p.shape[1] % 16 == 0


class DevicePackedWeight:
    """W [out_features, in_features] as packed pieces stacked along the output rows; owns `x @ W^T`."""

    def __init__(self, pieces: list[PackedPiece], device: torch.device) -> None:
        if not pieces or any(p.shape[1] != pieces[0].shape[1] for p in pieces):
            raise ValueError(f"packed pieces must share their input size, got {[p.shape for p in pieces]}")
        self.pieces: list[PackedPiece] = [p.to(device) for p in pieces]
        self.in_features = pieces[0].shape[1]
        self.out_features = sum(p.shape[0] for p in pieces)
        self.nbytes = sum(p.nbytes for p in self.pieces)
        # fp8 pieces through torch._scaled_mm (per-token activation scales) rather than weight-only
        self.scaled_mm = fp8_matmul_supported(device)

    def matmul(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if len(self.pieces) == 1:
            out = self._piece(self.pieces[0], x2)
        else:
            out = x2.new_empty(x2.shape[0], self.out_features)
            col = 0
            for p in self.pieces:
                out[:, col : col + p.shape[0]] = self._piece(p, x2)
                col += p.shape[0]
        if bias is not None:
            out = out + bias
        return out.view(*lead, self.out_features)

    def _piece(self, p: PackedPiece, x: Tensor) -> Tensor:
        if isinstance(p, PackedInt):
            wt = p.dequantize_into(_scratch_wt(x.device, x.dtype, p.shape[1], p.shape[0]))
            return torch.mm(x, wt)
        if self.scaled_mm and x.dtype == torch.bfloat16 and x.shape[0] > 0 and _fits_scaled_mm(p):
            amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
            sx = amax / _FP8_MAX
            xq = (x.float() / sx).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
            return torch._scaled_mm(
                xq, p.weight.t(), scale_a=sx, scale_b=p.scale.view(1, -1), out_dtype=x.dtype
            )
        return F.linear(x, p.weight.to(x.dtype) * p.scale.to(x.dtype).view(-1, 1))
