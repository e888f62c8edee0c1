"""Qwen3.5 / Qwen3.6 MoE text (HF's Qwen3_5MoeForCausalLM, and the text part of
Qwen3_5MoeForConditionalGeneration): Qwen3.5's hybrid stack (`pagedrs.models.qwen3_5`) with a sparse MoE block
on every layer: softmax over the experts, top-k, the k weights renormalized, plus a shared expert scaled by
sigmoid(x @ shared_expert_gate) (HF's Qwen3_5MoeSparseMoeBlock), on the existing MoE layers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from transformers import PretrainedConfig

from pagedrs.distributed.group import TPGroup
from pagedrs.layers.linear import Loaded
from pagedrs.layers.moe import RoutingConfig, SparseMoeBlock, expert_tensor_name
from pagedrs.models.qwen3_5 import Qwen3_5ForCausalLM, text_weights
from pagedrs.models.utils import StackedParam, load_weights_into

__all__ = ["Qwen3_5MoeForCausalLM"]


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    # the shared expert's gate/up are fused (the routed experts load through `expert_tensor_name`)
    stacked_params: tuple[StackedParam, ...] = (
        StackedParam(".shared_expert.gate_proj.", ".shared_expert.gate_up_proj.", 0),
        StackedParam(".shared_expert.up_proj.", ".shared_expert.gate_up_proj.", 1),
    )

    def make_mlp(
        self, config: PretrainedConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> Any:
        routing = RoutingConfig(
            num_experts=int(config.num_experts),
            top_k=int(config.num_experts_per_tok),
            softmax_before_topk=True,
            renormalize=True,
            shared_expert=int(config.shared_expert_intermediate_size),
            shared_expert_gate=True,
        )

        def mlp(i: int) -> SparseMoeBlock:
            return SparseMoeBlock(
                config.hidden_size,
                int(config.moe_intermediate_size),
                routing,
                tp=tp,
                dtype=dtype,
                device=device,
            )

        return mlp

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.tie_word_embeddings:
            skip = (*skip, "lm_head.weight")
        load_weights_into(
            self, text_weights(weights), self.stacked_params, skip=skip, name_map=expert_tensor_name
        )
