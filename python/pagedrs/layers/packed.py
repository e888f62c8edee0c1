"""GPTQ / AWQ int weights and FP8 weights kept in their checkpoint form in GPU memory.

On a GPU a quantized checkpoint's linear layers keep their packed tensors (weight memory is the packed
size) and multiply through them, as vLLM does:

- `PackedInt`: one layer's GPTQ (2/4/8-bit, any group size, act-order `g_idx`, AutoGPTQ's v1 or
  GPTQModel's v2 zeros) or AWQ (4-bit GEMM layout) parts. A matmul dequantizes the weight with the CUDA
  kernels of cuda/quant_ops.cu into a scratch buffer shared by every layer (transposed, [in, out]) and
  multiplies with cuBLAS (`torch.mm`): vLLM's dequantize-then-GEMM path for large batches.
- `Fp8`: an e4m3 weight [out, in] with a per-tensor or per-output-channel scale. Where the device
  multiplies fp8 (sm_89 and later), the activations are bfloat16 and both sizes are multiples of 16 (what
its kernels take), `torch._scaled_mm` takes the
  activations quantized per token to e4m3 (vLLM's dynamic per-token W8A8); elsewhere the weight is
  converted to the activations' dtype and scaled per call (weight-only, W8A16).

Both answer the lazy checkpoint-slice protocol the layers' weight loaders use (`shape`, `dim()`,
`narrow()`, `materialize()`: float32 dequantized, the loader's values), so a tensor-parallel rank cuts its
shard of the packed tensors: output rows on whole packed words, input columns on whole words (GPTQ: the
groups are kept whole and `g_idx` cut) or on whole groups (AWQ); a cut elsewhere is a ValueError naming
the numbers. `DevicePackedWeight` is a layer's weight format once its pieces (q|k|v, gate|up) are in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from pagedrs.loader.quant_config import QuantConfig

__all__ = ["DevicePackedWeight", "Fp8", "PackedInt", "PackedPiece"]

_FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _cut_error(what: str, start: int, length: int, unit: int, name: str) -> ValueError:
    return ValueError(
        f"cannot cut {what} {start}..{start + length} of a {name} weight: the cut must fall on its "
        f"{unit}-{what[:-1]} boundaries (use a tensor-parallel size that keeps whole {unit}s per rank)"
    )


@dataclass(frozen=True)
class PackedInt:
    """A GPTQ or AWQ layer's parts (see pagedrs.loader.quant_weights for the layouts; a tensor-parallel
    shard's are cut by `narrow`)."""

    cfg: QuantConfig
    qweight: Tensor
    qzeros: Tensor
    scales: Tensor
    g_idx: Tensor | None  # GPTQ: int32 [in]

    @property
    def per_word(self) -> int:
        return 32 // self.cfg.bits

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.qweight.shape
        if self.cfg.method == "gptq":
            return int(cols), int(rows) * self.per_word
        return int(cols) * self.per_word, int(rows)

    @property
    def nbytes(self) -> int:
        parts = (self.qweight, self.qzeros, self.scales) + ((self.g_idx,) if self.g_idx is not None else ())
        return sum(t.numel() * t.element_size() for t in parts)

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> PackedInt:
        name = self.cfg.describe()
        k = self.per_word
        gptq = self.cfg.method == "gptq"
        if dim == 0:  # output rows: columns of every part, whole packed words of qzeros (and AWQ's qweight)
            if start % k or length % k:
                raise _cut_error("rows", start, length, k, name)
            w = start // k, length // k
            q = self.qweight[:, start : start + length] if gptq else self.qweight[:, w[0] : w[0] + w[1]]
            return replace(
                self,
                qweight=q,
                qzeros=self.qzeros[:, w[0] : w[0] + w[1]],
                scales=self.scales[:, start : start + length],
            )
        if dim != 1:
            raise ValueError(f"a packed weight has 2 dimensions, got dim={dim}")
        if gptq:  # input columns: whole words of qweight; every group kept, each row's group id cut
            if start % k or length % k:
                raise _cut_error("columns", start, length, k, name)
            assert self.g_idx is not None
            return replace(
                self,
                qweight=self.qweight[start // k : (start + length) // k],
                g_idx=self.g_idx[start : start + length],
            )
        if self.cfg.group_size <= 0:  # one group over every input row: any cut keeps it whole
            return replace(self, qweight=self.qweight[start : start + length])
        group = self.cfg.group_size
        if start % group or length % group:
            raise _cut_error("columns", start, length, group, name)
        g0, gn = start // group, length // group
        return replace(
            self,
            qweight=self.qweight[start : start + length],
            qzeros=self.qzeros[g0 : g0 + gn],
            scales=self.scales[g0 : g0 + gn],
        )

    def materialize(self) -> Tensor:
        """float32 [out, in]: the loader's dequantized values."""
        from pagedrs.loader.quant_weights import dequantize_awq, dequantize_gptq

        parts = {"qweight": self.qweight, "qzeros": self.qzeros, "scales": self.scales}
        if self.cfg.method == "awq":
            return dequantize_awq("", parts, self.cfg)
        assert self.g_idx is not None
        return dequantize_gptq("", {**parts, "g_idx": self.g_idx}, self.cfg)

    def to(self, device: torch.device) -> PackedInt:
        """On `device`, contiguous (the kernels' layout)."""
        g = self.g_idx.to(device, torch.int32).contiguous() if self.g_idx is not None else None
        return replace(
            self,
            qweight=self.qweight.to(device, torch.int32).contiguous(),
            qzeros=self.qzeros.to(device, torch.int32).contiguous(),
            scales=self.scales.to(device).contiguous(),  # the kernels read fp16/bf16/fp32 scales as stored
            g_idx=g,
        )

    def dequantize_into(self, out: Tensor) -> Tensor:
        """Wt [in, out] in `out`'s dtype, by the CUDA kernels (the test suite runs them on its emulator)."""
        from pagedrs.kernels import quant_ops

        if self.cfg.method == "awq":
            return quant_ops.dequantize_awq(
                self.qweight, self.qzeros, self.scales, group_size=self.cfg.group_size, out=out
            )
        assert self.g_idx is not None
        return quant_ops.dequantize_gptq(
            self.qweight,
            self.qzeros,
            self.scales,
            self.g_idx,
            bits=self.cfg.bits,
            zero_plus_one=self.cfg.zero_plus_one,
            out=out,
        )


@dataclass(frozen=True)
class Fp8:
    """An fp8 weight [out, in] and its scale: one value, or one per output row ([out])."""

    weight: Tensor
    scale: Tensor

    def __post_init__(self) -> None:
        if self.scale.numel() not in (1, self.weight.shape[0]):
            raise ValueError(
                f"an FP8 weight of shape {tuple(self.weight.shape)} needs one scale or one per output row, "
                f"got {tuple(self.scale.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.weight.shape[0]), int(self.weight.shape[1])

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel() * self.scale.element_size()

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> Fp8:
        scale = self.scale.reshape(-1)
        if dim == 0 and scale.numel() > 1:
            scale = scale[start : start + length]
        return Fp8(self.weight.narrow(dim, start, length), scale)

    def materialize(self) -> Tensor:
        """float32 [out, in]: the loader's dequantized values."""
        from pagedrs.loader.quant_weights import dequantize_fp8

        return dequantize_fp8("", self.weight, self.scale, None)

    def to(self, device: torch.device) -> Fp8:
        scale = self.scale.to(device, torch.float32).reshape(-1)
        if scale.numel() == 1:
            scale = scale.expand(self.weight.shape[0]).contiguous()
        return Fp8(self.weight.to(device).contiguous(), scale)


PackedPiece = PackedInt | Fp8

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
