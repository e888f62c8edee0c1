"""The fused experts step on a CPU: one Rust call for the whole step (`_core.moe_experts`), float32 or
GGUF-quantized experts, on the kernels' warm thread pool."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from pagedrs import _core

__all__ = ["cpu_fused_experts"]

# Rows above which float32 experts take torch's per-expert GEMMs instead of the Rust kernel (the dense
# float32 method's rule, `method.CpuExperts`): bench/moe.py's shape (32 experts, top 4, hidden 768, 384
# per expert), 1 thread, interleaved loop / kernel time on a loaded 2-core Zen 4 EPYC: 256 rows 1.3-1.7x, 512 rows 1.15x, 1024 rows 0.9x (torch's GEMMs win once an
# expert has ~100 rows). Quantized experts always take the kernel.
F32_KERNEL_MAX_ROWS = 512


class ExpertWeights(Protocol):
    """What the kernel reads of a stacked expert weight (`expert_weights.ExpertWeights`): the GGUF blocks
    when kept quantized (`qweight.data`, `qweight.ggml_type`, `qweight.packed`), else the float weight
    [E, out, in]."""

    @property
    def qweight(self) -> Any: ...

    @property
    def weight(self) -> Tensor: ...


def _operand(w: ExpertWeights, what: str) -> tuple[object, int | None, bool]:
    """(array, GGML type or None for float32, whether in the x8 layout) of a stacked expert weight."""
    if w.qweight is not None:
        return w.qweight.data, w.qweight.ggml_type, bool(getattr(w.qweight, "packed", False))
    p = w.weight
    if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
        raise ValueError(
            f"the CPU experts kernel takes {what} as GGUF blocks or contiguous float32 on the CPU, got "
            f"{p.dtype} on {p.device}"
        )
    return p.detach().numpy(), None, False


def cpu_fused_experts(
    x: Tensor,
    gate_up: ExpertWeights,
    down: ExpertWeights,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    swiglu: tuple[float, float] | None = None,
) -> Tensor:
    """The step through the Rust kernels: x float32 [T, H] on the CPU and both weights float32 or
    quantized there (ValueError otherwise: the experts method checked the weights when it was chosen).
    Biases [E, 2I] / [E, H] and `swiglu` (alpha, limit): as `_core.moe_experts` takes them (gpt-oss)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(
            f"the CPU experts kernel takes float32 [tokens, hidden] activations on the CPU, got "
            f"{x.dtype} {tuple(x.shape)} on {x.device}"
        )
    biases = [b for b in (gate_up_bias, down_bias) if b is not None]
    if any(b.device.type != "cpu" or b.dtype != torch.float32 for b in biases):
        raise ValueError("the CPU experts kernel takes float32 biases on the CPU")
    gu, dn = _operand(gate_up, "gate_up"), _operand(down, "down")
    out = torch.empty_like(x)
    _core.moe_experts(
        x.contiguous().numpy(),
        gu[0],  # type: ignore[arg-type]  # float32 or uint8, as the type says
        dn[0],  # type: ignore[arg-type]
        topk_ids.to(torch.int64).contiguous().numpy(),
        topk_weights.to(torch.float32).contiguous().numpy(),
        out.numpy(),
        gate_up_type=gu[1],
        down_type=dn[1],
        num_threads=torch.get_num_threads(),
        gate_up_bias=None if gate_up_bias is None else gate_up_bias.detach().contiguous().numpy(),
        down_bias=None if down_bias is None else down_bias.detach().contiguous().numpy(),
        swiglu=swiglu,
        gate_up_packed=gu[2],
        down_packed=dn[2],
    )
    return out
