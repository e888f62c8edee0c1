"""What the model runner, the KV pool and liquid scaling read from a model: one base class every
architecture derives from (the model code itself stays each architecture's own)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from pagedrs.layers.attention import ForwardContext

__all__ = ["CausalLM"]


class CausalLM(torch.nn.Module):
    """A decoder-only LM over the paged KV cache: `forward(input_ids, positions, ctx)` gives the final
    hidden states [T, H] of the flattened varlen batch, `compute_logits(hidden)` the logits [T, V]."""

    config: Any  # the HF config it was built from
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int  # on this rank
    head_size: int
    max_position: int
    # Per layer (KV heads on this rank, head size) where the layers differ (Gemma 4); 0 heads: the layer
    # reads another layer's KV and owns none. None: every layer has num_kv_heads x head_size.
    kv_cache_shapes: list[tuple[int, int]] | None = None

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: Tensor) -> Tensor | None:
        """None on tensor-parallel ranks other than 0 (the logits are gathered there)."""
        raise NotImplementedError
