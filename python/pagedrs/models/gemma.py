"""Gemma 2 and Gemma 3 (text) in one module, as HF's Gemma2ForCausalLM and Gemma3ForCausalLM compute them.

Both: RMSNorm with a (1 + w) weight in float32 (`GemmaRMSNorm`), four norms a layer (before and after the
attention and the MLP, the residual added after the post-norm), a GeGLU MLP (gelu tanh), embeddings
scaled by sqrt(hidden_size) in the model's dtype, attention scale query_pre_attn_scalar**-0.5, and
sliding-window layers interleaved with global ones (`layer_types`). Gemma 2 adds tanh soft-capping of
the attention scores and of the final logits; Gemma 3 adds a (1 + w) RMSNorm over each head of q and k
before RoPE, and gives local and global layers their own RoPE (`rope_parameters` per layer type:
rope_local_base_freq for sliding layers, rope_theta and its scaling for full ones). What differs between
the two is data on the class (`qk_norm`, `attn_soft_cap`). A layer is its description (`describe`:
pagedrs.models.layer_desc), which the forward runs.

Parameter names are HF's, except that q/k/v are fused into `qkv_proj` and gate/up into `gate_up_proj`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import Tensor
from transformers import PretrainedConfig

from pagedrs.distributed.group import TPGroup
from pagedrs.layers.activation import get_act_and_mul_fn
from pagedrs.layers.attention import Attention, ForwardContext
from pagedrs.layers.linear import (
    Loaded,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedrs.layers.norm import GemmaRMSNorm
from pagedrs.layers.rotary import RotaryEmbedding, get_rope
from pagedrs.models.interface import CausalLM
from pagedrs.models.layer_desc import (
    Act,
    AddResidual,
    Attend,
    DescribedModel,
    HeadNorm,
    Linear,
    ModelDesc,
    Norm,
    Op,
    QKVProj,
    Residual,
    Rope,
    TorchState,
    run_ops,
)
from pagedrs.models.llama import LlamaForCausalLM, _head_size, _layer_windows
from pagedrs.models.utils import load_weights_into
from pagedrs.multimodal import MultiModalBatch

__all__ = ["Gemma2ForCausalLM", "Gemma3ForCausalLM"]

_FULL, _SLIDING = "full_attention", "sliding_attention"


def _layer_types(config: PretrainedConfig) -> list[str]:
    types = getattr(config, "layer_types", None)
    return list(types) if types else [_FULL] * config.num_hidden_layers


class GemmaAttention(torch.nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
        *,
        qk_norm: bool,
        attn_soft_cap: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_size = _head_size(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.head_size = head_size
        self.qkv_proj = QKVParallelLinear(
            hidden, head_size, num_heads, num_kv_heads, bias=bias, tp=tp, dtype=dtype, device=device
        )
        self.o_proj = RowParallelLinear(
            num_heads * head_size, hidden, bias=bias, tp=tp, dtype=dtype, device=device
        )
        self.rotary_emb = rotary_emb  # shared by the layers of one type; registered on the model
        eps = config.rms_norm_eps
        self.q_norm = GemmaRMSNorm(head_size, eps, dtype=dtype, device=device) if qk_norm else None
        self.k_norm = GemmaRMSNorm(head_size, eps, dtype=dtype, device=device) if qk_norm else None
        cap = getattr(config, "attn_logit_softcapping", None) if attn_soft_cap else None
        self.attn = Attention(
            self.qkv_proj.num_heads,  # this rank's heads
            head_size,
            self.qkv_proj.num_kv_heads,
            layer_idx,
            scale=float(config.query_pre_attn_scalar) ** -0.5,
            sliding_window=sliding_window,
            logits_soft_cap=float(cap) if cap else None,
        )

    def describe(self) -> tuple[Op, ...]:
        """q/k/v projection, (1 + w) norm over each head of q and k (Gemma 3), rotary, attention, o proj."""
        head_norm: tuple[Op, ...] = ()
        if self.q_norm is not None and self.k_norm is not None:
            head_norm = (HeadNorm(self.q_norm, self.k_norm, self.head_size),)
        return (
            QKVProj(self.qkv_proj),
            *head_norm,
            Rope(self.rotary_emb),
            Attend(self.attn),
            Linear(self.o_proj),
        )

    def forward(self, positions: Tensor, hidden: Tensor, ctx: ForwardContext) -> Tensor:
        s = TorchState(positions, ctx, None, hidden)
        run_ops(self.describe(), s)
        return s.x


class GemmaMLP(torch.nn.Module):
    """down(act(gate(x)) * up(x)), act = gelu tanh in the released checkpoints (`hidden_activation`)."""

    def __init__(
        self, config: PretrainedConfig, *, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [inter, inter], bias=False, tp=tp, dtype=dtype, device=device
        )
        self.down_proj = RowParallelLinear(inter, hidden, bias=False, tp=tp, dtype=dtype, device=device)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        self.act_fn = get_act_and_mul_fn(str(act or "gelu_pytorch_tanh"))

    def describe(self) -> tuple[Op, ...]:
        return (Linear(self.gate_up_proj), Act(self.act_fn), Linear(self.down_proj))

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaDecoderLayer(torch.nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        attn: GemmaAttention,
        *,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = attn
        self.mlp = GemmaMLP(config, tp=tp, dtype=dtype, device=device)
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype=dtype, device=device)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype=dtype, device=device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype=dtype, device=device)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype=dtype, device=device)

    def describe(self) -> tuple[Op, ...]:
        """Sandwich norms: each block between a pre-norm (its input kept as the residual) and a post-norm,
        the residual added after the post-norm."""
        return (
            Norm(self.input_layernorm, Residual.SAVE),
            *self.self_attn.describe(),
            Norm(self.post_attention_layernorm, Residual.NONE),
            AddResidual(),
            Norm(self.pre_feedforward_layernorm, Residual.SAVE),
            *self.mlp.describe(),
            Norm(self.post_feedforward_layernorm, Residual.NONE),
            AddResidual(),
        )

    def forward(self, positions: Tensor, hidden: Tensor, ctx: ForwardContext) -> Tensor:
        s = TorchState(positions, ctx, None, hidden)
        run_ops(self.describe(), s)
        return s.x


def _rope_config(config: PretrainedConfig, layer_type: str) -> Any:
    """A view of `config` whose rope_parameters are those of one layer type (Gemma 3 keeps one dict per
    type; Gemma 2 one for all)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        return _RopeView(config, params[layer_type])
    return config


class _RopeView:
    def __init__(self, config: PretrainedConfig, params: dict[str, Any]) -> None:
        self._config, self.rope_parameters = config, params

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


class GemmaModel(DescribedModel):
    def __init__(
        self,
        config: PretrainedConfig,
        *,
        qk_norm: bool,
        attn_soft_cap: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        head_size = _head_size(config)
        types = _layer_types(config)
        windows = _layer_windows(config)
        self.rotary_emb = get_rope(_rope_config(config, _FULL), head_size, device=device)
        local = _rope_config(config, _SLIDING)
        # one RoPE per layer type when their parameters differ (Gemma 3: local base 10k, global 1M)
        self.local_rotary_emb = (
            get_rope(local, head_size, device=device) if local is not _rope_config(config, _FULL) else None
        )
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp=tp, dtype=dtype, device=device
        )
        # HF: a float32 scalar sqrt(hidden_size) cast to the weights' dtype before the multiply
        self.normalizer: Tensor
        self.register_buffer(
            "normalizer",
            torch.tensor(config.hidden_size**0.5).to(dtype=dtype, device=device),
            persistent=False,
        )
        layers = []
        for i in range(config.num_hidden_layers):
            rope = (
                self.local_rotary_emb if types[i] == _SLIDING and self.local_rotary_emb else self.rotary_emb
            )
            attn = GemmaAttention(
                config,
                i,
                rope,
                windows[i],
                qk_norm=qk_norm,
                attn_soft_cap=attn_soft_cap,
                tp=tp,
                dtype=dtype,
                device=device,
            )
            layers.append(GemmaDecoderLayer(config, attn, tp=tp, dtype=dtype, device=device))
        self.layers = torch.nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.embed_tokens(input_ids) * self.normalizer

    def describe(self) -> ModelDesc:
        layers = [cast(GemmaDecoderLayer, layer).describe() for layer in self.layers]
        return ModelDesc.of(self.embed, layers, Norm(self.norm, Residual.NONE))


class Gemma2ForCausalLM(CausalLM):
    """Gemma 2: soft-capped attention scores and final logits, no q/k norm."""

    stacked_params = LlamaForCausalLM.stacked_params
    qk_norm: bool = False
    attn_soft_cap: bool = True  # HF's Gemma 3 keeps attn_logit_softcapping in its config but never applies it

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
        self.model = GemmaModel(
            config, qk_norm=self.qk_norm, attn_soft_cap=self.attn_soft_cap, tp=tp, dtype=dtype, device=device
        )
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, tp=tp, dtype=dtype, device=device
        )
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        cap = getattr(config, "final_logit_softcapping", None)
        self.final_logit_softcapping: float | None = float(cap) if cap else None
        attn = cast(GemmaDecoderLayer, self.model.layers[0]).self_attn.attn
        self.num_layers: int = config.num_hidden_layers
        self.num_kv_heads: int = attn.num_kv_heads
        self.head_size: int = attn.head_size
        windows = [w for w in _layer_windows(config) if w is not None]
        self.sliding_window: int | None = max(windows) if windows else None
        self.max_position: int = int(getattr(config, "max_position_embeddings", 8192))

    def forward(
        self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext, mm: MultiModalBatch | None = None
    ) -> Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]. `mm`: encoder rows scattered into the
        scaled embeddings at `mm.mask` (as HF's masked_scatter after the embedding scale)."""
        if mm is None:
            return self.model(input_ids, positions, ctx)
        x = self.model.embed(input_ids)
        x[mm.mask] = mm.embeds[:, : x.shape[-1]].to(x.dtype)
        return self.model(input_ids, positions, ctx, inputs_embeds=x)

    def compute_logits(self, hidden: Tensor) -> Tensor | None:
        """[N, hidden] -> [N, vocab] float32, capped as ``cap * tanh(logits / cap)`` when the config sets
        final_logit_softcapping."""
        logits = self.lm_head.compute_logits(hidden)
        cap = self.final_logit_softcapping
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        """Load HF-named tensors; every parameter must be covered (ValueError naming what is missing)."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.tie_word_embeddings:
            skip = (*skip, "lm_head.weight")
        load_weights_into(self, weights, self.stacked_params, skip=skip)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text): Gemma 2's layout with a (1 + w) RMSNorm on each head of q and k, no attention
    soft-capping, and RoPE per layer type."""

    qk_norm = True
    attn_soft_cap = False
