"""The Llama family in one module: Llama 2, Llama 3 / 3.1 (rope scaling), Mistral (sliding window),
Qwen2 (q/k/v bias), Qwen3 (per-head RMSNorm on q and k before RoPE, explicit head_dim), SmolLM2 (tied
embeddings). A layer is its description (`describe`: pagedrs.models.layer_desc), which the forward runs.

Same structure as HF's LlamaForCausalLM and the same parameter names, except that q/k/v are fused into
`qkv_proj` and gate/up into `gate_up_proj` (load_weights maps HF's separate tensors into the shards).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

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
from pagedrs.layers.norm import RMSNorm
from pagedrs.layers.rotary import RotaryEmbedding, get_rope
from pagedrs.models.interface import CausalLM
from pagedrs.models.layer_desc import (
    Act,
    Attend,
    Block,
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
from pagedrs.models.utils import StackedParam, load_weights_into
from pagedrs.multimodal import MultiModalBatch

__all__ = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


def _head_size(config: PretrainedConfig) -> int:
    """config.head_dim when the config sets one, else hidden_size / num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _layer_windows(config: PretrainedConfig) -> list[int | None]:
    """Per layer, its sliding window (None = full attention)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window:
        return [None] * n
    if getattr(config, "use_sliding_window", True) is False:  # Qwen2 ships a window it does not use
        return [None] * n
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [int(window)] * n


class LlamaAttention(torch.nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        rotary_emb: RotaryEmbedding | None,
        sliding_window: int | None,
        *,
        qk_norm: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """`rotary_emb` None: a layer without position embedding (NoPE)."""
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_size = _head_size(config)
        qwen2 = config.model_type in ("qwen2", "qwen2_5_vl_text")  # q/k/v biases, no o bias
        qkv_bias = bool(getattr(config, "attention_bias", False)) or qwen2
        o_bias = bool(getattr(config, "attention_bias", False)) and not qwen2
        self.qkv_proj = QKVParallelLinear(
            hidden, head_size, num_heads, num_kv_heads, bias=qkv_bias, tp=tp, dtype=dtype, device=device
        )
        self.o_proj = RowParallelLinear(
            num_heads * head_size, hidden, bias=o_bias, tp=tp, dtype=dtype, device=device
        )
        self.rotary_emb = rotary_emb  # shared by every layer; registered on the model
        self.attn = Attention(
            self.qkv_proj.num_heads,  # this rank's heads
            head_size,
            self.qkv_proj.num_kv_heads,
            layer_idx,
            scale=head_size**-0.5,
            sliding_window=sliding_window,
        )
        self.head_size = head_size
        # Qwen3: RMSNorm over each head's q and k before RoPE (weights [head_size], replicated across ranks)
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(head_size, eps, dtype=dtype, device=device) if qk_norm else None
        self.k_norm = RMSNorm(head_size, eps, dtype=dtype, device=device) if qk_norm else None

    def describe(self) -> tuple[Op, ...]:
        """q/k/v projection, per-head q/k norm (Qwen3), rotary (none on a NoPE layer), attention, o proj."""
        head_norm: tuple[Op, ...] = ()
        if self.q_norm is not None and self.k_norm is not None:
            head_norm = (HeadNorm(self.q_norm, self.k_norm, self.head_size),)
        rope: tuple[Op, ...] = () if self.rotary_emb is None else (Rope(self.rotary_emb),)
        return (QKVProj(self.qkv_proj), *head_norm, *rope, Attend(self.attn), Linear(self.o_proj))

    def forward(
        self, positions: Tensor, hidden: Tensor, ctx: ForwardContext, seq_lens: Tensor | None
    ) -> Tensor:
        s = TorchState(positions, ctx, seq_lens, hidden)
        run_ops(self.describe(), s)
        return s.x


class LlamaMLP(torch.nn.Module):
    def __init__(
        self, config: PretrainedConfig, *, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [inter, inter], bias=bias, tp=tp, dtype=dtype, device=device
        )
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias, tp=tp, dtype=dtype, device=device)
        self.act_fn = get_act_and_mul_fn(getattr(config, "hidden_act", "silu"))

    def describe(self) -> tuple[Op, ...]:
        return (Linear(self.gate_up_proj), Act(self.act_fn), Linear(self.down_proj))

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        rotary_emb: RotaryEmbedding | None,
        sliding_window: int | None,
        *,
        qk_norm: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        self_attn: LlamaAttention | None = None,
        mlp: torch.nn.Module | None = None,
    ) -> None:
        """`self_attn` / `mlp`: the blocks an architecture built on this layout brings (a mixture of experts,
        attention with sinks); by default Llama's."""
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = self_attn or LlamaAttention(
            config, layer_idx, rotary_emb, sliding_window, qk_norm=qk_norm, tp=tp, dtype=dtype, device=device
        )
        self.mlp = mlp or LlamaMLP(config, tp=tp, dtype=dtype, device=device)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)

    def describe(self) -> tuple[Op, ...]:
        """Pre-norm with the residual add fused in, attention, pre-norm, MLP (dense, or a block such as a
        mixture of experts called as one op)."""
        mlp = self.mlp
        mlp_ops = mlp.describe() if isinstance(mlp, LlamaMLP) else (Block(mlp),)
        return (
            Norm(self.input_layernorm, Residual.FUSED),
            *self.self_attn.describe(),
            Norm(self.post_attention_layernorm, Residual.FUSED),
            *mlp_ops,
        )

    def forward(
        self,
        positions: Tensor,
        hidden: Tensor,
        residual: Tensor | None,
        ctx: ForwardContext,
        seq_lens: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        s = TorchState(positions, ctx, seq_lens, hidden, residual)
        run_ops(self.describe(), s)
        return s.x, s.residual


# builds decoder layer `layer_idx` around the model's shared rotary embedding (None: a NoPE layer), with
# its sliding window
LayerFactory = Callable[[int, "RotaryEmbedding | None", "int | None"], LlamaDecoderLayer]


class LlamaModel(DescribedModel):
    def __init__(
        self,
        config: PretrainedConfig,
        *,
        qk_norm: bool = False,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        make_layer: LayerFactory | None = None,
        rotary_emb: RotaryEmbedding | None = None,
    ) -> None:
        """`make_layer(layer_idx, rotary_emb, sliding_window)`: builds each decoder layer (default: Llama's).
        `rotary_emb`: the rotary every layer shares (default: the config's, `get_rope`)."""
        super().__init__()
        self.rotary_emb = rotary_emb or get_rope(config, _head_size(config), device=device)
        windows = _layer_windows(config)
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp=tp, dtype=dtype, device=device
        )

        def llama_layer(i: int, rotary_emb: RotaryEmbedding, window: int | None) -> LlamaDecoderLayer:
            return LlamaDecoderLayer(
                config, i, rotary_emb, window, qk_norm=qk_norm, tp=tp, dtype=dtype, device=device
            )

        make = make_layer or llama_layer
        self.layers = torch.nn.ModuleList(
            make(i, self.rotary_emb, windows[i]) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)

    def describe(self) -> ModelDesc:
        layers = [cast(LlamaDecoderLayer, layer).describe() for layer in self.layers]
        return ModelDesc.of(self.embed_tokens, layers, Norm(self.norm, Residual.FUSED))


class LlamaForCausalLM(CausalLM):
    # HF tensor name piece -> (fused parameter name piece, shard id)
    stacked_params: tuple[StackedParam, ...] = (
        StackedParam(".q_proj.", ".qkv_proj.", "q"),
        StackedParam(".k_proj.", ".qkv_proj.", "k"),
        StackedParam(".v_proj.", ".qkv_proj.", "v"),
        StackedParam(".gate_proj.", ".gate_up_proj.", 0),
        StackedParam(".up_proj.", ".gate_up_proj.", 1),
    )
    # per-head RMSNorm on q and k before RoPE (Qwen3)
    qk_norm: bool = False

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
        self.model = self.make_model(config, tp=tp, dtype=dtype, device=device)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, tp=tp, dtype=dtype, device=device
        )
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        first = cast(LlamaDecoderLayer, self.model.layers[0])  # ModuleList items are typed Module
        attn = first.self_attn.attn
        self.num_layers: int = config.num_hidden_layers
        self.num_kv_heads: int = attn.num_kv_heads
        self.head_size: int = attn.head_size
        windows = [w for w in _layer_windows(config) if w is not None]
        self.sliding_window: int | None = max(windows) if windows else None
        self.max_position: int = int(getattr(config, "max_position_embeddings", 2048))

    def make_model(
        self, config: PretrainedConfig, *, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> LlamaModel:
        """The decoder stack; architectures on this layout with other blocks override it."""
        return LlamaModel(config, qk_norm=self.qk_norm, tp=tp, dtype=dtype, device=device)

    def forward(
        self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext, mm: MultiModalBatch | None = None
    ) -> Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: Tensor) -> Tensor | None:
        """[N, hidden] -> [N, vocab] float32."""
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        """Load HF-named tensors; every parameter must be covered (ValueError naming what is missing)."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
        if self.tie_word_embeddings:
            skip = (*skip, "lm_head.weight")
        load_weights_into(self, weights, self.stacked_params, skip=skip)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with a sliding window (read from config.sliding_window)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with q/k/v biases (config.model_type == "qwen2")."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with RMSNorm over each head of q and k before RoPE (`q_norm`, `k_norm`), an explicit
    head_dim, no q/k/v bias, tied or untied lm_head (as HF's Qwen3ForCausalLM)."""

    qk_norm = True
