"""The fused experts step on a CUDA device: the grouped GEMM kernels of cuda/moe_ops.cu (vLLM's
`fused_moe`) through `pagedrs.kernels.moe_ops`, for float16/bfloat16/float32 experts held dense in the
activations' dtype; SiLU-gated or gpt-oss's clamped SwiGLU, with or without the experts' biases."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = ["cuda_fused_experts"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class ExpertWeights(Protocol):
    """What the step reads of a stacked expert weight (`experts.ExpertWeights`): the dense weight
    [E, out, in], unless kept GGUF-quantized (`qweight`, then the step declines)."""

    @property
    def qweight(self) -> Any: ...

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
) -> Tensor | None:
    """The step through the kernels, or None where they do not take it (the caller's torch path): x and
    both weights dense, of one of their dtypes, on x's device. The caller selects this on CUDA devices
    only (the tests run it on CPU tensors through the kernel emulator)."""
    from pagedrs.kernels.moe_ops import ExpertMatrix, fused_experts

    if x.dim() != 2 or x.dtype not in _DTYPES or gate_up.qweight is not None or down.qweight is not None:
        return None
    tensors = [gate_up.weight, down.weight, *(b for b in (gate_up_bias, down_bias) if b is not None)]
    if any(t.dtype != x.dtype or t.device != x.device or not t.is_contiguous() for t in tensors):
        return None
    oai = activation.swiglu_limit is not None
    return fused_experts(
        x.contiguous(),
        ExpertMatrix(gate_up.weight.detach()),
        ExpertMatrix(down.weight.detach()),
        topk_weights,
        topk_ids.to(torch.int64),
        activation="swiglu_oai" if oai else "silu",
        swiglu_alpha=activation.swiglu_alpha,
        swiglu_limit=activation.swiglu_limit if activation.swiglu_limit is not None else 0.0,
        gate_up_bias=None if gate_up_bias is None else gate_up_bias.detach(),
        down_bias=None if down_bias is None else down_bias.detach(),
    )
