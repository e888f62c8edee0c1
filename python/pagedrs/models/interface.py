"""What the model runner, the KV pool and liquid scaling read from a model: one base class every
architecture derives from (the model code itself stays each architecture's own)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

if TYPE_CHECKING:
    from pagedrs.layers.attention import ForwardContext
    from pagedrs.multimodal import MultiModalBatch

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

    # Multimodal models (`pagedrs.multimodal`): images become encoder rows scattered into the embeddings.
    supports_multimodal: ClassVar[bool] = False
    # The image tokens attend to each other both ways in prefill (Gemma 3's token_type_ids mask).
    mm_bidirectional: ClassVar[bool] = False
    # positions are [3, T] (M-RoPE); the class provides a static `get_mrope_input_positions`.
    uses_mrope: ClassVar[bool] = False

    def forward(
        self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext, mm: MultiModalBatch | None = None
    ) -> Tensor:
        raise NotImplementedError

    def embed_multimodal(self, items: list[dict[str, Tensor]]) -> list[Tensor]:
        """Per item (its processor tensors), the encoder rows [length, D] of its placeholder tokens."""
        raise NotImplementedError(f"{type(self).__name__} takes no images")

    def compute_logits(self, hidden: Tensor) -> Tensor | None:
        """None on tensor-parallel ranks other than 0 (the logits are gathered there)."""
        raise NotImplementedError
