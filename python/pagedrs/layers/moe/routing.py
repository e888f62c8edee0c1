"""The routing step of a mixture-of-experts layer: router logits -> each token's top-k experts and their
weights. Every variant the supported checkpoints use is a field of `RoutingConfig`, not a subclass:

- Mixtral, Qwen2-MoE, Qwen3-MoE: softmax over all experts (float32), then top-k, then (Mixtral always,
  Qwen when `norm_topk_prob`) the k weights renormalized to sum to 1 (HF's MixtralTopKRouter,
  Qwen3MoeTopKRouter).
- gpt-oss: a router with a bias, top-k over the logits, then softmax over the k (HF's GptOssTopKRouter).

Ties are broken as HF breaks them: the same `torch.topk` over the same values (equal logits give equal
probabilities bit for bit, so softmax-then-top-k picks the same experts in the same order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["RoutingConfig", "route", "sort_by_expert"]


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """How a token picks its experts.

    softmax_before_topk: softmax over all experts then top-k (True), or top-k over the logits then softmax
        over the k chosen (False, gpt-oss).
    renormalize: the k weights divided by their sum (only meaningful with softmax_before_topk).
    router_bias: the router's linear layer has a bias.
    shared_expert: hidden size of an always-on shared expert (0: none).
    shared_expert_gate: the shared expert's output is scaled by sigmoid(x @ w_gate) (Qwen2-MoE)."""

    num_experts: int
    top_k: int
    softmax_before_topk: bool = True
    renormalize: bool = True
    router_bias: bool = False
    shared_expert: int = 0
    shared_expert_gate: bool = False

    def __post_init__(self) -> None:
        if self.num_experts <= 0:
            raise ValueError(f"num_experts must be > 0, got {self.num_experts}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in 1..num_experts ({self.num_experts}), got {self.top_k}")
        if self.shared_expert < 0:
            raise ValueError(f"shared_expert must be >= 0, got {self.shared_expert}")
        if self.shared_expert_gate and not self.shared_expert:
            raise ValueError("shared_expert_gate needs a shared expert (shared_expert > 0)")


def route(logits: Tensor, cfg: RoutingConfig) -> tuple[Tensor, Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k] int64), each row's
    experts in torch.topk's order (HF's)."""
    if logits.shape[-1] != cfg.num_experts:
        raise ValueError(f"router logits have {logits.shape[-1]} experts, expected {cfg.num_experts}")
    if cfg.softmax_before_topk:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, cfg.top_k, dim=-1)
        if cfg.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        top, ids = torch.topk(logits, cfg.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=torch.float32)
    return weights.to(logits.dtype), ids


def sort_by_expert(ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """The step's (token, slot) pairs sorted by expert once: (order [T*k] int64, the flat pair index of
    each sorted row; counts [E] int64, rows per expert). Pair p is token p // k, slot p % k; within one
    expert the pairs keep token order (a stable sort)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts
