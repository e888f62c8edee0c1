"""A mixture-of-experts MLP: router, fused experts and (optionally) an always-on shared expert, with one
all-reduce per layer under tensor parallelism (the experts' and the shared expert's partial sums are added
first)."""

from __future__ import annotations

import torch
from torch import Tensor

from pagedrs.distributed.group import TPGroup
from pagedrs.layers.activation import SiluAndMul
from pagedrs.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedrs.layers.moe.experts import SILU, ExpertActivation, FusedExperts
from pagedrs.layers.moe.routing import RoutingConfig, route

__all__ = ["SharedExpert", "SparseMoeBlock"]


class SharedExpert(torch.nn.Module):
    """A SiLU-gated MLP whose down projection leaves its partial sum unreduced (the block reduces)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, tp=tp, dtype=dtype, device=device
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, reduce_results=False, tp=tp, dtype=dtype, device=device
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class SparseMoeBlock(torch.nn.Module):
    """x [T, H] -> sum of its top-k experts' outputs, weighted by the router (+ the shared expert, gated
    by sigmoid(x @ shared_expert_gate) where `routing.shared_expert_gate`). Parameter names follow HF's
    Qwen2MoeSparseMoeBlock: `gate`, `experts`, `shared_expert`, `shared_expert_gate`."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        routing: RoutingConfig,
        *,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        expert_bias: bool = False,
        activation: ExpertActivation = SILU,
    ) -> None:
        super().__init__()
        self.routing = routing
        self.tp = tp
        self.gate = ReplicatedLinear(
            hidden_size, routing.num_experts, bias=routing.router_bias, dtype=dtype, device=device
        )
        self.experts = FusedExperts(
            routing.num_experts,
            hidden_size,
            intermediate_size,
            tp=tp,
            dtype=dtype,
            device=device,
            bias=expert_bias,
            activation=activation,
        )
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if routing.shared_expert:
            self.shared_expert = SharedExpert(
                hidden_size, routing.shared_expert, tp=tp, dtype=dtype, device=device
            )
        if routing.shared_expert_gate:
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        topk_weights, topk_ids = route(self.gate(x), self.routing)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        if self.tp.size > 1:
            self.tp.all_reduce(out)
        return out
