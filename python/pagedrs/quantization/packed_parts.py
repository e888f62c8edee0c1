"""GPTQ / AWQ and FP8 layers' parts as a checkpoint holds them, kept packed for the GPU kernels.

- `PackedInt`: one layer's GPTQ (2/4/8-bit, any group size, act-order `g_idx`, AutoGPTQ's v1 or
  GPTQModel's v2 zeros) or AWQ (4-bit GEMM layout) parts; `dequantize_into` runs the CUDA kernels of
  cuda/quant_ops.cu (pagedrs.kernels.quant_ops).
- `Fp8`: an e4m3 weight [out, in] with a per-tensor or per-output-channel scale.

Both answer the lazy checkpoint-slice protocol the layers' weight loaders use (`shape`, `dim()`,
`narrow()`, `materialize()`: float32 dequantized, the loader's values), so a tensor-parallel rank cuts its
shard of the packed tensors: output rows on whole packed words, input columns on whole words (GPTQ: the
groups are kept whole and `g_idx` cut) or on whole groups (AWQ); a cut elsewhere is a ValueError naming
the numbers. `pagedrs.layers.packed.DevicePackedWeight` multiplies a layer's pieces.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from pagedrs.quantization.config import QuantConfig
from pagedrs.quantization.dequant import dequantize_awq, dequantize_fp8, dequantize_gptq

__all__ = ["Fp8", "PackedInt", "PackedPiece"]


def _cut_error(what: str, start: int, length: int, unit: int, name: str) -> ValueError:
    return ValueError(
        f"cannot cut {what} {start}..{start + length} of a {name} weight: the cut must fall on its "
        f"{unit}-{what[:-1]} boundaries (use a tensor-parallel size that keeps whole {unit}s per rank)"
    )


@dataclass(frozen=True)
class PackedInt:
    """A GPTQ or AWQ layer's parts (see pagedrs.quantization.dequant for the layouts; a tensor-parallel
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
        """float32 [out, in]: the format's dequantized values (the loader's)."""
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
        """float32 [out, in]: the format's dequantized values (the loader's)."""
        return dequantize_fp8("", self.weight, self.scale, None)

    def to(self, device: torch.device) -> Fp8:
        scale = self.scale.to(device, torch.float32).reshape(-1)
        if scale.numel() == 1:
            scale = scale.expand(self.weight.shape[0]).contiguous()
        return Fp8(self.weight.to(device).contiguous(), scale)


PackedPiece = PackedInt | Fp8
