"""The fused experts step in torch: what an expert applies between its projections (`ExpertActivation`)
and the step as a loop over the active experts (`fused_experts_torch`), the oracle every kernel is tested
against and the forward of the torch experts method."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedrs.layers.moe.routing import sort_by_expert

__all__ = ["SILU", "ExpertActivation", "fused_experts_torch"]


@dataclass(frozen=True, slots=True)
class ExpertActivation:
    """What an expert applies between its gate/up and down projections.

    swiglu_limit None: silu(gate) * up (Mixtral, Qwen). Otherwise gpt-oss's clamped SwiGLU (HF's
    GptOssExperts._apply_gate): gate clamped to at most `swiglu_limit`, up to +-`swiglu_limit`, then
    (up + 1) * gate * sigmoid(`swiglu_alpha` * gate)."""

    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __call__(self, gate: Tensor, up: Tensor) -> Tensor:
        if self.swiglu_limit is None:
            return F.silu(gate) * up
        gate = gate.clamp(max=self.swiglu_limit)
        up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.swiglu_alpha))


SILU = ExpertActivation()


def fused_experts_torch(
    x: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    activation: ExpertActivation = SILU,
    b_gate_up: Tensor | None = None,
    b_down: Tensor | None = None,
) -> Tensor:
    """sum over a token's k experts of weight * down(act(gate(x), up(x))): [T, H]. The pairs sorted by
    expert once, each active expert's rows in one matmul; the k products summed in top-k order (as HF's
    grouped experts forward). `b_gate_up` [E, 2I] / `b_down` [E, H]: the experts' biases (gpt-oss)."""
    num_tokens, k = topk_ids.shape
    order, counts = sort_by_expert(topk_ids, w_gate_up.shape[0])
    xs = x[order // k]
    ys = torch.empty(num_tokens * k, w_down.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            bias = None if b_gate_up is None else b_gate_up[e]
            gate, up = F.linear(xs[start : start + n], w_gate_up[e], bias).chunk(2, dim=-1)
            bias = None if b_down is None else b_down[e]
            ys[start : start + n] = F.linear(activation(gate, up), w_down[e], bias)
            start += n
    pairs = torch.empty_like(ys)
    pairs[order] = ys * topk_weights.reshape(-1)[order, None].to(ys.dtype)
    return pairs.view(num_tokens, k, -1).sum(dim=1)
