"""Qwen2-MoE and Qwen3-MoE: Qwen2's / Qwen3's attention (q/k/v biases; per-head q/k RMSNorm) with MoE MLPs
on the layers HF makes sparse (`(i + 1) % decoder_sparse_step == 0` and not in `mlp_only_layers`; the
others a dense MLP of `intermediate_size`). Routing: softmax over the experts, top-k, the k weights
renormalized when `norm_topk_prob` (HF's Qwen3MoeTopKRouter). Qwen2-MoE adds a shared expert of
`shared_expert_intermediate_size` that every token goes through, scaled by sigmoid(x @ shared_expert_gate).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from pagedrs.layers.moe import RoutingConfig
from pagedrs.models.moe import MoeForCausalLM, MoeSpec

__all__ = ["Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"]


def _sparse_layers(config: PretrainedConfig) -> frozenset[int]:
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    if int(config.num_experts) <= 0:
        return frozenset()
    return frozenset(i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)


def _routing(config: PretrainedConfig, shared: int) -> RoutingConfig:
    return RoutingConfig(
        num_experts=int(config.num_experts),
        top_k=int(config.num_experts_per_tok),
        softmax_before_topk=True,
        renormalize=bool(config.norm_topk_prob),
        shared_expert=shared,
        shared_expert_gate=bool(shared),
    )


class Qwen2MoeForCausalLM(MoeForCausalLM):
    @classmethod
    def spec(cls, config: PretrainedConfig) -> MoeSpec:
        shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
        return MoeSpec(
            routing=_routing(config, shared),
            moe_intermediate_size=int(config.moe_intermediate_size),
            sparse_layers=_sparse_layers(config),
            qkv_bias=bool(getattr(config, "qkv_bias", True)),
        )


class Qwen3MoeForCausalLM(MoeForCausalLM):
    @classmethod
    def spec(cls, config: PretrainedConfig) -> MoeSpec:
        return MoeSpec(
            routing=_routing(config, 0),
            moe_intermediate_size=int(config.moe_intermediate_size),
            sparse_layers=_sparse_layers(config),
            qk_norm=True,
            qkv_bias=bool(getattr(config, "attention_bias", False)),
        )
