"""Decoder-only mixture-of-experts models built from Llama's attention block: each layer's MLP is either
a `SparseMoeBlock` (router, fused experts, optional shared expert) or a dense SiLU-gated MLP. What differs
between architectures is data read from the config (`MoeSpec`): the routing, which layers are sparse,
q/k norms and q/k/v biases; the concrete classes live in mixtral.py and qwen_moe.py.

Checkpoint names: HF's, with every expert tensor (per-expert or stacked) mapped onto the stacked expert
parameters (`layers.moe.expert_tensor_name`) and Mixtral's `block_sparse_moe` read as `mlp`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor
from transformers import PretrainedConfig

from pagedrs.distributed.group import TPGroup
from pagedrs.layers.attention import Attention
from pagedrs.layers.linear import Loaded, QKVParallelLinear
from pagedrs.layers.moe import ExpertActivation, RoutingConfig, SparseMoeBlock, expert_tensor_name
from pagedrs.layers.rotary import RotaryEmbedding
from pagedrs.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from pagedrs.models.utils import load_weights_into

__all__ = ["MoeForCausalLM", "MoeSpec"]


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """What an architecture reads from its config: routing, the experts' intermediate size, the layers
    whose MLP is sparse, per-head q/k RMSNorm (Qwen3), q/k/v biases, and gpt-oss's experts with biases
    and their activation, and attention sinks (a learned logit per head)."""

    routing: RoutingConfig
    moe_intermediate_size: int
    sparse_layers: frozenset[int]
    qk_norm: bool = False
    qkv_bias: bool = False
    expert_bias: bool = False
    expert_activation: ExpertActivation = ExpertActivation()
    attention_sinks: bool = False


class MoeAttention(LlamaAttention):
    """Llama's attention block with q/k/v biases set by the spec rather than by the model type."""

    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        rotary_emb: RotaryEmbedding | None,
        sliding_window: int | None,
        spec: MoeSpec,
        *,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(
            config,
            layer_idx,
            rotary_emb,
            sliding_window,
            qk_norm=spec.qk_norm,
            tp=tp,
            dtype=dtype,
            device=device,
        )
        if (self.qkv_proj.bias is not None) != spec.qkv_bias:
            old = self.qkv_proj
            self.qkv_proj = QKVParallelLinear(
                old.input_size,
                old.head_size,
                old.total_num_heads,
                old.total_num_kv_heads,
                bias=spec.qkv_bias,
                tp=tp,
                dtype=dtype,
                device=device,
            )
        if spec.attention_sinks:
            a = self.attn
            self.attn = Attention(
                a.num_heads, a.head_size, a.num_kv_heads, layer_idx, a.scale, a.sliding_window, sinks=True
            )
            assert self.attn.sinks is not None
            self.attn.sinks.weight_loader = _sinks_loader(tp, config.num_attention_heads)  # type: ignore[attr-defined]


def _sinks_loader(tp: TPGroup, total_heads: int) -> Callable[[Tensor, Loaded], None]:
    """Loads this rank's heads of a checkpoint's sinks [num_attention_heads]."""

    def load(param: Tensor, loaded: Loaded) -> None:
        if tuple(loaded.shape) != (total_heads,):
            raise ValueError(f"shape mismatch: expected ({total_heads},), got {tuple(loaded.shape)}")
        full = loaded.materialize() if hasattr(loaded, "materialize") else loaded
        n = param.shape[0]
        param.data.copy_(cast(Tensor, full)[tp.position * n : (tp.position + 1) * n])

    return load


class MoeForCausalLM(LlamaForCausalLM):
    """Base of the MoE architectures: Llama's layout whose layers take their attention and MLP blocks from
    `spec(config)` (what differs between architectures)."""

    @classmethod
    def spec(cls, config: PretrainedConfig) -> MoeSpec:
        raise NotImplementedError

    def make_model(
        self, config: PretrainedConfig, *, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> LlamaModel:
        spec = self.spec(config)

        def layer(i: int, rotary_emb: RotaryEmbedding | None, window: int | None) -> LlamaDecoderLayer:
            attn = MoeAttention(config, i, rotary_emb, window, spec, tp=tp, dtype=dtype, device=device)
            mlp: torch.nn.Module
            if i in spec.sparse_layers:
                mlp = SparseMoeBlock(
                    config.hidden_size,
                    spec.moe_intermediate_size,
                    spec.routing,
                    tp=tp,
                    dtype=dtype,
                    device=device,
                    expert_bias=spec.expert_bias,
                    activation=spec.expert_activation,
                )
            else:
                mlp = LlamaMLP(config, tp=tp, dtype=dtype, device=device)
            return LlamaDecoderLayer(
                config,
                i,
                rotary_emb,
                window,
                qk_norm=spec.qk_norm,
                tp=tp,
                dtype=dtype,
                device=device,
                self_attn=attn,
                mlp=mlp,
            )

        return LlamaModel(config, tp=tp, dtype=dtype, device=device, make_layer=layer)

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        """Load HF-named tensors; every parameter must be covered (ValueError naming what is missing)."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.tie_word_embeddings:
            skip = (*skip, "lm_head.weight")
        load_weights_into(
            self, _renamed(weights), self.stacked_params, skip=skip, name_map=expert_tensor_name
        )


def _renamed(weights: Iterable[tuple[str, Loaded]]) -> Iterator[tuple[str, Loaded]]:
    """Mixtral's checkpoints call the MoE block `block_sparse_moe` (transformers >= 5 holds it as `mlp`)."""
    for name, tensor in weights:
        yield name.replace(".block_sparse_moe.", ".mlp."), tensor
