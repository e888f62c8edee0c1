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
from pagedrs.layers.attention import Attention, ForwardContext, token_seq_lens
from pagedrs.layers.linear import Loaded, ParallelLMHead, QKVParallelLinear, VocabParallelEmbedding
from pagedrs.layers.moe import ExpertActivation, RoutingConfig, SparseMoeBlock, expert_tensor_name
from pagedrs.layers.norm import RMSNorm
from pagedrs.layers.rotary import RotaryEmbedding, get_rope
from pagedrs.models.interface import CausalLM
from pagedrs.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, _head_size, _layer_windows
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
        rotary_emb: RotaryEmbedding,
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


class MoeDecoderLayer(torch.nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
        spec: MoeSpec,
        *,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.self_attn = MoeAttention(
            config, layer_idx, rotary_emb, sliding_window, spec, tp=tp, dtype=dtype, device=device
        )
        self.mlp: torch.nn.Module
        if layer_idx in spec.sparse_layers:
            self.mlp = SparseMoeBlock(
                hidden,
                spec.moe_intermediate_size,
                spec.routing,
                tp=tp,
                dtype=dtype,
                device=device,
                expert_bias=spec.expert_bias,
                activation=spec.expert_activation,
            )
        else:
            self.mlp = LlamaMLP(config, tp=tp, dtype=dtype, device=device)
        self.input_layernorm = RMSNorm(hidden, eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype=dtype, device=device)

    def forward(
        self,
        positions: Tensor,
        hidden: Tensor,
        residual: Tensor | None,
        ctx: ForwardContext,
        seq_lens: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, ctx, seq_lens)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class MoeModel(torch.nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        spec: MoeSpec,
        *,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.rotary_emb = get_rope(config, _head_size(config), device=device)
        windows = _layer_windows(config)
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp=tp, dtype=dtype, device=device
        )
        self.layers = torch.nn.ModuleList(
            MoeDecoderLayer(config, i, self.rotary_emb, windows[i], spec, tp=tp, dtype=dtype, device=device)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        seq_lens = None
        if self.rotary_emb.long_cos_sin_cache is not None and ctx.attn_metadata is not None:
            seq_lens = token_seq_lens(ctx.attn_metadata)
        hidden = self.embed_tokens(input_ids)
        residual: Tensor | None = None
        for layer in self.layers if ctx.exit_layer is None else self.layers[: ctx.exit_layer]:
            hidden, residual = layer(positions, hidden, residual, ctx, seq_lens)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class MoeForCausalLM(CausalLM):
    """Base of the MoE architectures: `spec(config)` says what differs."""

    stacked_params = LlamaForCausalLM.stacked_params

    @classmethod
    def spec(cls, config: PretrainedConfig) -> MoeSpec:
        raise NotImplementedError

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
        self.config, self.dtype = config, dtype
        self.model = MoeModel(config, self.spec(config), tp=tp, dtype=dtype, device=device)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, tp=tp, dtype=dtype, device=device
        )
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        attn = cast(MoeDecoderLayer, self.model.layers[0]).self_attn.attn  # ModuleList items are typed Module
        self.num_layers: int = config.num_hidden_layers
        self.num_kv_heads: int = attn.num_kv_heads
        self.head_size: int = attn.head_size
        windows = [w for w in _layer_windows(config) if w is not None]
        self.sliding_window: int | None = max(windows) if windows else None
        self.max_position: int = int(getattr(config, "max_position_embeddings", 2048))

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: Tensor) -> Tensor | None:
        """[N, hidden] -> [N, vocab] float32."""
        return self.lm_head.compute_logits(hidden)

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
