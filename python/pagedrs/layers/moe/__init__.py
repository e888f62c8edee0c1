"""Mixture-of-experts layers: the routing step (`routing`), the fused experts step (`experts`: its stacked
weights in `expert_weights`, the way they are held and run chosen once per layer in `method`, the kernels'
calls in `cpu` and `cuda`) and the MLP block that joins them (`block`)."""

from pagedrs.layers.moe.block import SharedExpert, SparseMoeBlock
from pagedrs.layers.moe.experts import (
    ExpertActivation,
    ExpertWeights,
    FusedExperts,
    expert_tensor_name,
    fused_experts_torch,
)
from pagedrs.layers.moe.method import (
    CpuExperts,
    CudaExperts,
    ExpertsMethod,
    GgufCpuExperts,
    TorchExperts,
)
from pagedrs.layers.moe.routing import RoutingConfig, route, sort_by_expert

__all__ = [
    "CpuExperts",
    "CudaExperts",
    "ExpertActivation",
    "ExpertsMethod",
    "ExpertWeights",
    "FusedExperts",
    "GgufCpuExperts",
    "RoutingConfig",
    "SharedExpert",
    "SparseMoeBlock",
    "TorchExperts",
    "expert_tensor_name",
    "fused_experts_torch",
    "route",
    "sort_by_expert",
]
