"""Mixtral (mistralai/Mixtral-8x7B and its kind): Mistral's attention (sliding window when the config
sets one) and in every layer a mixture of `num_local_experts` SiLU-gated experts, each token routed to
`num_experts_per_tok` of them: softmax over the experts, top-k, the k weights renormalized (HF's
MixtralTopKRouter)."""

from __future__ import annotations

from transformers import PretrainedConfig

from pagedrs.layers.moe import RoutingConfig
from pagedrs.models.moe import MoeForCausalLM, MoeSpec

__all__ = ["MixtralForCausalLM"]


class MixtralForCausalLM(MoeForCausalLM):
    @classmethod
    def spec(cls, config: PretrainedConfig) -> MoeSpec:
        routing = RoutingConfig(
            num_experts=int(config.num_local_experts),
            top_k=int(config.num_experts_per_tok),
            softmax_before_topk=True,
            renormalize=True,
        )
        return MoeSpec(
            routing=routing,
            moe_intermediate_size=int(config.intermediate_size),
            sparse_layers=frozenset(range(config.num_hidden_layers)),
        )
