"""GPT-2 (openai-community/gpt2, distilgpt2, gpt2-medium/large/xl).

Same structure and parameter names as HF's GPT2LMHeadModel: learned absolute position embeddings (`wpe`),
pre-LayerNorm blocks, GELU with the tanh approximation ("gelu_new"), a fused `c_attn` (q|k|v) and the LM
head tied to `wte`. HF stores every projection as a `Conv1D`, whose weight is `[in, out]` (the transpose
of `nn.Linear`); load_weights transposes those four tensors per block.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
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
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedrs.layers.norm import LayerNorm
from pagedrs.models.interface import CausalLM
from pagedrs.models.utils import load_weights_into, mha_head_size
from pagedrs.multimodal import MultiModalBatch

__all__ = ["GPT2LMHeadModel"]

# HF Conv1D modules (weight [in, out]) inside a block.
_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
# Checkpoint entries that are not weights: the causal-mask buffers of old checkpoints.
_BUFFERS = (".attn.bias", ".attn.masked_bias")


class GPT2Attention(torch.nn.Module):
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
        scale = head_size**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.c_attn = QKVParallelLinear(
            hidden, head_size, num_heads, num_heads, bias=True, tp=tp, dtype=dtype, device=device
        )
        self.c_proj = RowParallelLinear(hidden, hidden, bias=True, tp=tp, dtype=dtype, device=device)
        self.attn = Attention(
            self.c_attn.num_heads, head_size, self.c_attn.num_kv_heads, layer_idx, scale=scale
        )

    def forward(self, hidden: Tensor, ctx: ForwardContext) -> Tensor:
        q, k, v = self.c_attn.split_qkv(self.c_attn(hidden))
        return self.c_proj(self.attn(q, k, v, ctx))


class GPT2MLP(torch.nn.Module):
    def __init__(
        self, config: PretrainedConfig, *, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        inner = getattr(config, "n_inner", None) or 4 * hidden
        self.c_fc = ColumnParallelLinear(hidden, inner, bias=True, tp=tp, dtype=dtype, device=device)
        self.act = get_act_fn(getattr(config, "activation_function", "gelu_new"))
        self.c_proj = RowParallelLinear(inner, hidden, bias=True, tp=tp, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(torch.nn.Module):
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
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.ln_1 = LayerNorm(hidden, eps, dtype=dtype, device=device)
        self.attn = GPT2Attention(config, layer_idx, tp=tp, dtype=dtype, device=device)
        self.ln_2 = LayerNorm(hidden, eps, dtype=dtype, device=device)
        self.mlp = GPT2MLP(config, tp=tp, dtype=dtype, device=device)

    def forward(self, hidden: Tensor, ctx: ForwardContext) -> Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden), ctx)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(torch.nn.Module):
    def __init__(
        self, config: PretrainedConfig, *, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        if getattr(config, "add_cross_attention", False):
            raise ValueError("GPT-2 with cross-attention (an encoder-decoder) is not supported")
        hidden = config.hidden_size
        self.wte = VocabParallelEmbedding(config.vocab_size, hidden, tp=tp, dtype=dtype, device=device)
        self.wpe = ReplicatedEmbedding(config.max_position_embeddings, hidden, dtype=dtype, device=device)
        self.h = torch.nn.ModuleList(
            GPT2Block(config, i, tp=tp, dtype=dtype, device=device) for i in range(config.num_hidden_layers)
        )
        self.ln_f = LayerNorm(hidden, config.layer_norm_epsilon, dtype=dtype, device=device)

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        hidden = self.wte(input_ids) + self.wpe(positions)
        for block in self.h if ctx.exit_layer is None else self.h[: ctx.exit_layer]:
            hidden = block(hidden, ctx)
        return self.ln_f(hidden)


class GPT2LMHeadModel(CausalLM):
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
        self.transformer = GPT2Model(config, tp=tp, dtype=dtype, device=device)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, tp=tp, dtype=dtype, device=device
        )
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.transformer.wte)
        first = cast(GPT2Block, self.transformer.h[0])  # ModuleList items are typed Module
        attn = first.attn.attn
        self.num_layers: int = config.num_hidden_layers
        self.num_kv_heads: int = attn.num_kv_heads
        self.head_size: int = attn.head_size
        self.sliding_window: int | None = None
        self.max_position: int = int(config.max_position_embeddings)

    def forward(
        self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext, mm: MultiModalBatch | None = None
    ) -> Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]."""
        return self.transformer(input_ids, positions, ctx)

    def compute_logits(self, hidden: Tensor) -> Tensor | None:
        """[N, hidden] -> [N, vocab] float32."""
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Load HF-named tensors (with or without the "transformer." prefix of GPT2LMHeadModel); every
        parameter must be covered (ValueError naming the tensor otherwise)."""
        skip: tuple[str, ...] = _BUFFERS
        if self.tie_word_embeddings:
            skip = (*skip, "lm_head.weight")
        renames = [(p, f"transformer.{p}") for p in ("wte.", "wpe.", "h.", "ln_f.")]
        load_weights_into(self, self._linear_layout(weights), skip=skip, renames=renames)

    def _linear_layout(self, weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """Conv1D weights [in, out] -> nn.Linear layout [out, in], shape-checked in the HF layout so the
        error shows the shape the checkpoint should have."""
        modules = dict(self.named_modules())
        for name, tensor in weights:
            if name.endswith(_CONV1D):
                module = modules.get(_module_name(name))
                if isinstance(module, ColumnParallelLinear | RowParallelLinear):
                    expected = (module.input_size, module.output_size)
                    if tuple(tensor.shape) != expected:
                        raise ValueError(
                            f"checkpoint tensor {name!r}: shape mismatch: expected {expected} "
                            f"(Conv1D layout [in, out]), got {tuple(tensor.shape)}"
                        )
                tensor = tensor.t()
            yield name, tensor


def _module_name(hf_name: str) -> str:
    """The module a (possibly unprefixed) HF weight name belongs to."""
    module = hf_name.rsplit(".", 1)[0]
    return module if module.startswith("transformer.") else f"transformer.{module}"
