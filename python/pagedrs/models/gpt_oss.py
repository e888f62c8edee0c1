"""gpt-oss (openai/gpt-oss-20b, -120b), as HF's GptOssForCausalLM: Llama's decoder layer with q/k/v/o
biases, attention sinks (a learned logit per head in every softmax's denominator), sliding-window and
full layers alternating (`layer_types`), YaRN rope, and in every layer a mixture of experts: a router with
a bias, top-k over its logits then softmax over the k (HF's GptOssTopKRouter), experts with biases and the
clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`; HF's GptOssExperts).

Checkpoints hold the experts stacked as HF's GptOssExperts does: `experts.gate_up_proj` [E, H, 2I] with
gate and up interleaved column by column (gate 0, up 0, gate 1, ...) and `experts.down_proj` [E, I, H];
MXFP4 checkpoints ship them as `*_blocks` / `*_scales` (`pagedrs.quantization.mxfp4`): on the CPU with
dtype "auto" kept 4-bit (`Mxfp4Experts`, handed over per expert as GGUF MXFP4 rows, gate rows then up
rows, which the stacked experts kernel multiplies), elsewhere dequantized at load. Both are turned into
the stacked parameters [E, out, in] here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor
from transformers import PretrainedConfig

from pagedrs.layers.linear import Loaded
from pagedrs.layers.moe import ExpertActivation, RoutingConfig, expert_tensor_name
from pagedrs.models.moe import MoeForCausalLM, MoeSpec
from pagedrs.models.utils import load_weights_into
from pagedrs.quantization.mxfp4 import Mxfp4Experts

__all__ = ["GptOssForCausalLM"]


def _full(t: Any) -> Tensor:
    read = getattr(t, "materialize", None)
    return read() if read is not None else t


def _gate_then_up(t: Tensor, dim: int) -> Tensor:
    """Interleaved gate/up (gate at even, up at odd indices of `dim`) -> gate half then up half."""
    n = t.shape[dim]
    order = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)]).to(t.device)
    return t.index_select(dim, order)


def _mxfp4_pieces(name: str, w: Mxfp4Experts, pieces: tuple[str, ...]) -> Iterator[tuple[str, Loaded]]:
    """An MXFP4 stacked weight as per-expert GGUF rows named as the per-expert checkpoints name them
    (`experts.<e>.<piece>.weight`): with pieces ("gate_proj", "up_proj") the interleaved rows are split,
    gate at even rows and up at odd ones (the order `_gate_then_up` gives the float weight)."""
    base = name.rpartition(".")[0]
    for e in range(w.shape[0]):
        for p, piece in enumerate(pieces):
            yield f"{base}.{e}.{piece}.weight", w.expert_rows(e, p, len(pieces))


def _hf_to_stacked(weights: Iterable[tuple[str, Loaded]]) -> Iterator[tuple[str, Loaded]]:
    """HF's gpt-oss names and layouts -> this model's: router -> gate, sinks into the attention layer,
    experts transposed to [E, out, in] with gate rows before up rows (biases likewise)."""
    for name, t in weights:
        if ".mlp.router." in name:
            yield name.replace(".mlp.router.", ".mlp.gate."), t
        elif name.endswith(".self_attn.sinks"):
            yield name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), t
        elif isinstance(t, Mxfp4Experts) and name.endswith(".experts.gate_up_proj"):
            yield from _mxfp4_pieces(name, t, ("gate_proj", "up_proj"))
        elif isinstance(t, Mxfp4Experts) and name.endswith(".experts.down_proj"):
            yield from _mxfp4_pieces(name, t, ("down_proj",))
        elif name.endswith(".experts.gate_up_proj"):
            yield name, _gate_then_up(_full(t).transpose(-1, -2), 1).contiguous()
        elif name.endswith(".experts.down_proj"):
            yield name, _full(t).transpose(-1, -2).contiguous()
        elif name.endswith(".experts.gate_up_proj_bias"):
            yield name.replace("gate_up_proj_bias", "gate_up_bias"), _gate_then_up(_full(t), 1).contiguous()
        elif name.endswith(".experts.down_proj_bias"):
            yield name.replace("down_proj_bias", "down_bias"), t
        else:
            yield name, t


class GptOssForCausalLM(MoeForCausalLM):
    @classmethod
    def spec(cls, config: PretrainedConfig) -> MoeSpec:
        routing = RoutingConfig(
            num_experts=int(config.num_local_experts),
            top_k=int(config.num_experts_per_tok),
            softmax_before_topk=False,
            renormalize=False,
            router_bias=True,
        )
        activation = ExpertActivation(
            swiglu_limit=float(getattr(config, "swiglu_limit", 7.0)),
            swiglu_alpha=float(getattr(config, "swiglu_alpha", 1.702)),
        )
        return MoeSpec(
            routing=routing,
            moe_intermediate_size=int(config.intermediate_size),
            sparse_layers=frozenset(range(config.num_hidden_layers)),
            qkv_bias=bool(getattr(config, "attention_bias", True)),
            expert_bias=True,
            expert_activation=activation,
            attention_sinks=True,
        )

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        """Load HF-named tensors (float or MXFP4-dequantized experts); every parameter must be covered."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.tie_word_embeddings:
            skip = (*skip, "lm_head.weight")
        load_weights_into(
            self, _hf_to_stacked(weights), self.stacked_params, skip=skip, name_map=expert_tensor_name
        )
