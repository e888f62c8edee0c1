"""Mixture-of-experts layers: the routing step (`routing`), the fused experts step (`experts`, with the
CPU kernels' dispatch in `cpu`) and the MLP block that joins them (`block`)."""

from pagedrs.layers.moe.block import SharedExpert, SparseMoeBlock
from pagedrs.layers.moe.experts import (
    ExpertActivation,
    ExpertWeights,
    FusedExperts,
    expert_tensor_name,
    fused_experts_torch,
)
from pagedrs.layers.moe.routing import RoutingConfig, route, sort_by_expert

__all__ = [
    "ExpertActivation",
    "ExpertWeights",
    "FusedExperts",
    "RoutingConfig",
    "SharedExpert",
    "SparseMoeBlock",
    "expert_tensor_name",
    "fused_experts_torch",
    "route",
    "sort_by_expert",
]
