"""The fused experts step on a CUDA device: the grouped GEMM kernels of cuda/moe_ops.cu (vLLM's
`fused_moe`) through `pagedrs.kernels.moe_ops`, for float16/bfloat16/float32 activations with experts held
dense in the activations' dtype or kept quantized for the kernel (`kernel_weight`: GGUF Q8_0 blocks, FP8
e4m3 with per-row or block scales, dequantized in the kernel's tile); SiLU-gated or gpt-oss's clamped
SwiGLU, with or without the experts' biases."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from pagedrs.kernels.moe_ops import ExpertMatrix

__all__ = ["cuda_fused_experts"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class ExpertWeights(Protocol):
    """What the step reads of a stacked expert weight (`expert_weights.ExpertWeights`): the kernel's
    quantized form (`kernel_weight`) when kept so, else the dense weight [E, out, in] (never the GGUF blocks
    kept for the CPU kernels, `qweight`)."""

    @property
    def qweight(self) -> Any: ...

    @property
    def kernel_weight(self) -> ExpertMatrix | None: ...

    @property
    def weight(self) -> Tensor: ...


class Activation(Protocol):
    @property
    def swiglu_limit(self) -> float | None: ...

    @property
    def swiglu_alpha(self) -> float: ...


def cuda_fused_experts(
    x: Tensor,
    gate_up: ExpertWeights,
    down: ExpertWeights,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    activation: Activation,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
) -> Tensor:
    """The step through the kernels: x [T, H] of one of their dtypes, both weights kept for the kernel or
    dense in x's dtype, all on x's device (ValueError otherwise: the experts method checked the weights
    when it was chosen). The method is chosen on CUDA devices only (the tests run it on CPU tensors
    through the kernel emulator)."""
    from pagedrs.kernels.moe_ops import fused_experts

    if x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(
            f"the CUDA experts kernels take float16/bfloat16/float32 [tokens, hidden] activations, got "
            f"{x.dtype} {tuple(x.shape)}"
        )
    mgu, md = _matrix(gate_up, x, "gate_up"), _matrix(down, x, "down")
    for name, b in (("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
        if b is not None and _unfit(b, x):
            raise ValueError(
                f"{name} must be contiguous {x.dtype} on {x.device}, got {b.dtype} on {b.device}"
            )
    oai = activation.swiglu_limit is not None
    return fused_experts(
        x.contiguous(),
        mgu,
        md,
        topk_weights,
        topk_ids.to(torch.int64),
        activation="swiglu_oai" if oai else "silu",
        swiglu_alpha=activation.swiglu_alpha,
        swiglu_limit=activation.swiglu_limit if activation.swiglu_limit is not None else 0.0,
        gate_up_bias=None if gate_up_bias is None else gate_up_bias.detach(),
        down_bias=None if down_bias is None else down_bias.detach(),
    )


def _unfit(t: Tensor, x: Tensor) -> bool:
    return t.dtype != x.dtype or t.device != x.device or not t.is_contiguous()


def _matrix(w: ExpertWeights, x: Tensor, what: str) -> ExpertMatrix:
    """The weight as the kernels take it (its kernel form, or the dense weight in x's dtype and device)."""
    from pagedrs.kernels.moe_ops import ExpertMatrix

    m = w.kernel_weight
    if m is not None:
        if m.data.device != x.device:
            raise ValueError(f"{what} is kept for the kernel on {m.data.device}, activations on {x.device}")
        return m
    if w.qweight is not None:
        raise ValueError(
            f"{what} is kept as GGUF blocks for the CPU kernels, which the CUDA kernels do not take"
        )
    if _unfit(w.weight, x):
        p = w.weight
        raise ValueError(f"{what} must be contiguous {x.dtype} on {x.device}, got {p.dtype} on {p.device}")
    return ExpertMatrix(w.weight.detach())
