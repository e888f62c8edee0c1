"""OPT (facebook/opt-125m ... opt-66b).

Same structure and parameter names as HF's OPTForCausalLM, except that q/k/v are fused into `qkv_proj`
(load_weights maps HF's separate tensors into its shards). Learned positions with OPT's offset of 2 (row
`position + 2` of `embed_positions`), ReLU, biases everywhere, LayerNorm before (`do_layer_norm_before`,
all sizes but 350m) or after each sub-block, and `project_in`/`project_out` when the embeddings are
narrower than the hidden size (`word_embed_proj_dim`, opt-350m). The LM head is tied to `embed_tokens`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import Tensor
from transformers import PretrainedConfig

from pagedrs.distributed.group import TPGroup
from pagedrs.layers.activation import get_act_fn
from pagedrs.layers.attention import Attention, ForwardContext
from pagedrs.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedEmbedding,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedrs.layers.norm import LayerNorm
from pagedrs.models.interface import CausalLM
from pagedrs.models.utils import StackedParam, load_weights_into, mha_head_size
from pagedrs.multimodal import MultiModalBatch

__all__ = ["OPTForCausalLM"]

# Row of embed_positions that holds position 0 (fairseq reserved the first two rows for padding).
POSITION_OFFSET = 2


def _layer_norm(config: PretrainedConfig, *, dtype: torch.dtype, device: torch.device) -> LayerNorm:
    norm = LayerNorm(config.hidden_size, 1e-5, dtype=dtype, device=device)  # HF: nn.LayerNorm's default eps
    if not getattr(config, "layer_norm_elementwise_affine", True):
        # HF builds these without weight or bias, so the checkpoint has none to load.
        norm.register_parameter("weight", None)
        norm.register_parameter("bias", None)
    return norm


class OPTAttention(torch.nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        *,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        head_size = mha_head_size(config)
        bias = bool(getattr(config, "enable_bias", True))
        self.qkv_proj = QKVParallelLinear(
            hidden, head_size, num_heads, num_heads, bias=bias, tp=tp, dtype=dtype, device=device
        )
        self.out_proj = RowParallelLinear(hidden, hidden, bias=bias, tp=tp, dtype=dtype, device=device)
        self.attn = Attention(
            self.qkv_proj.num_heads, head_size, self.qkv_proj.num_kv_heads, layer_idx, scale=head_size**-0.5
        )

    def forward(self, hidden: Tensor, ctx: ForwardContext) -> Tensor:
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(hidden))
        return self.out_proj(self.attn(q, k, v, ctx))


class OPTDecoderLayer(torch.nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        *,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        bias = bool(getattr(config, "enable_bias", True))
        self.do_layer_norm_before = bool(config.do_layer_norm_before)
        self.self_attn = OPTAttention(config, layer_idx, tp=tp, dtype=dtype, device=device)
        self.self_attn_layer_norm = _layer_norm(config, dtype=dtype, device=device)
        self.fc1 = ColumnParallelLinear(hidden, config.ffn_dim, bias=bias, tp=tp, dtype=dtype, device=device)
        self.activation_fn = get_act_fn(config.activation_function)
        self.fc2 = RowParallelLinear(config.ffn_dim, hidden, bias=bias, tp=tp, dtype=dtype, device=device)
        self.final_layer_norm = _layer_norm(config, dtype=dtype, device=device)

    def forward(self, hidden: Tensor, ctx: ForwardContext) -> Tensor:
        pre = self.do_layer_norm_before
        x = self.self_attn_layer_norm(hidden) if pre else hidden
        hidden = hidden + self.self_attn(x, ctx)
        if not pre:
            hidden = self.self_attn_layer_norm(hidden)
        x = self.final_layer_norm(hidden) if pre else hidden
        hidden = hidden + self.fc2(self.activation_fn(self.fc1(x)))
        return hidden if pre else self.final_layer_norm(hidden)


class OPTDecoder(torch.nn.Module):
    def __init__(
        self, config: PretrainedConfig, *, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        hidden, embed_dim = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, embed_dim, tp=tp, dtype=dtype, device=device
        )
        self.embed_positions = ReplicatedEmbedding(
            config.max_position_embeddings + POSITION_OFFSET, hidden, dtype=dtype, device=device
        )
        self.project_in: ReplicatedLinear | None = None
        self.project_out: ReplicatedLinear | None = None
        if embed_dim != hidden:
            self.project_in = ReplicatedLinear(embed_dim, hidden, bias=False, dtype=dtype, device=device)
            self.project_out = ReplicatedLinear(hidden, embed_dim, bias=False, dtype=dtype, device=device)
        self.layers = torch.nn.ModuleList(
            OPTDecoderLayer(config, i, tp=tp, dtype=dtype, device=device)
            for i in range(config.num_hidden_layers)
        )
        # As in HF: post-LN models end with the last layer's norm; old checkpoints may lack the final one.
        self.final_layer_norm: LayerNorm | None = None
        if config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False):
            self.final_layer_norm = _layer_norm(config, dtype=dtype, device=device)

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers if ctx.exit_layer is None else self.layers[: ctx.exit_layer]:
            hidden = layer(hidden, ctx)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden


class OPTModel(torch.nn.Module):
    def __init__(
        self, config: PretrainedConfig, *, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config, tp=tp, dtype=dtype, device=device)


class OPTForCausalLM(CausalLM):
    stacked_params = (
        StackedParam(".q_proj.", ".qkv_proj.", "q"),
        StackedParam(".k_proj.", ".qkv_proj.", "k"),
        StackedParam(".v_proj.", ".qkv_proj.", "v"),
    )

    def __init__(
        self,
        config: PretrainedConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        tp = tp or TPGroup()
        self.config = config
        self.dtype = dtype
        self.model = OPTModel(config, tp=tp, dtype=dtype, device=device)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        decoder = self.model.decoder
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.word_embed_proj_dim, tp=tp, dtype=dtype, device=device
        )
        if self.tie_word_embeddings:
            self.lm_head.tie_to(decoder.embed_tokens)
        first = cast(OPTDecoderLayer, decoder.layers[0])  # ModuleList items are typed Module
        attn = first.self_attn.attn
        self.num_layers: int = config.num_hidden_layers
        self.num_kv_heads: int = attn.num_kv_heads
        self.head_size: int = attn.head_size
        self.sliding_window: int | None = None
        self.max_position: int = int(config.max_position_embeddings)

    def forward(
        self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext, mm: MultiModalBatch | None = None
    ) -> Tensor:
        """input_ids, positions [T] -> hidden states [T, word_embed_proj_dim]."""
        return self.model.decoder(input_ids, positions, ctx)

    def compute_logits(self, hidden: Tensor) -> Tensor | None:
        """[N, word_embed_proj_dim] -> [N, vocab] float32."""
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Load HF-named tensors ("model.decoder.*", or "decoder.*" as the facebook/opt-* checkpoints store
        them); every parameter must be covered (ValueError naming the tensor otherwise)."""
        skip: tuple[str, ...] = ("lm_head.weight",) if self.tie_word_embeddings else ()
        load_weights_into(
            self, weights, self.stacked_params, skip=skip, renames=[("decoder.", "model.decoder.")]
        )
