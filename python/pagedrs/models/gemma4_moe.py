"""Gemma 4's mixture-of-experts block (`enable_moe_block`: the 26B-A4B checkpoint), as HF's Gemma4TextRouter and
Gemma4TextExperts compute it. It runs beside the dense MLP of the same layer: the router reads the layer's
residual (RMS-normed without a weight, times a learned scale and hidden_size**-0.5), takes the top-k of a
float32 softmax, renormalises them to sum to 1 and multiplies each by its expert's learned scale; the
experts (gelu-tanh-gated, stacked as HF's `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]) read the
residual through their own pre-norm. The decoder layer adds the two outputs, each after its own post-norm.

The experts run as a torch loop over the active experts (`fused_experts_torch`), on every device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PretrainedConfig

from pagedrs.layers.moe import ExpertActivation, fused_experts_torch

__all__ = ["Gemma4Experts", "Gemma4Router"]


class _GeluTanhGated(ExpertActivation):
    """gelu_tanh(gate) * up (HF's ACT2FN["gelu_pytorch_tanh"])."""

    __slots__ = ()

    def __call__(self, gate: Tensor, up: Tensor) -> Tensor:
        return F.gelu(gate, approximate="tanh") * up


def _param(*shape: int, dtype: torch.dtype, device: torch.device, fill: float = 0.0) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.full(shape, fill, dtype=dtype, device=device), requires_grad=False)


class Gemma4Router(torch.nn.Module):
    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden, experts = config.hidden_size, int(config.num_experts)
        self.top_k, self.eps = int(config.top_k_experts), float(config.rms_norm_eps)
        self.root_size = hidden**-0.5
        self.proj = torch.nn.Linear(hidden, experts, bias=False, dtype=dtype, device=device)
        self.proj.weight.requires_grad_(False)
        self.scale = _param(hidden, dtype=dtype, device=device, fill=1.0)
        self.per_expert_scale = _param(experts, dtype=dtype, device=device, fill=1.0)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, H] -> (top-k weights [T, k], expert ids [T, k])."""
        xf = x.float()
        h = (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)).type_as(x)
        probs = torch.softmax(self.proj(h * self.scale * self.root_size), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4Experts(torch.nn.Module):
    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        experts, hidden, inter = (
            int(config.num_experts),
            config.hidden_size,
            int(config.moe_intermediate_size),
        )
        if config.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(f"Gemma 4 experts: unsupported hidden_activation {config.hidden_activation!r}")
        self.gate_up_proj = _param(experts, 2 * inter, hidden, dtype=dtype, device=device)
        self.down_proj = _param(experts, hidden, inter, dtype=dtype, device=device)
        self.activation = _GeluTanhGated()

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        return fused_experts_torch(
            x, self.gate_up_proj, self.down_proj, weights, ids, activation=self.activation
        )
