"""Qwen3-VL (HF's Qwen3VLForConditionalGeneration): the Qwen3 text decoder (per-head q/k RMSNorm) with
interleaved M-RoPE, its vision transformer with learned position embeddings (models.vision.qwen3), and
DeepStack: the rows of the tower's DeepStack mergers travel with each item (`embed_multimodal` gives
[tokens, hidden * (1 + len(deepstack_visual_indexes))]) and are added to the image rows' hidden states after
decoder layers 0, 1, ... as HF's `_deepstack_process`. Everything else is Qwen2.5-VL's
(models.qwen2_5_vl).

Qwen3.5's multimodal checkpoints (Qwen3_5ForConditionalGeneration and its MoE) carry the same tower
without DeepStack over the Gated DeltaNet hybrid text model (models.qwen3_5) with interleaved M-RoPE; they
are built here too."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from transformers import PretrainedConfig

from pagedrs.distributed.group import TPGroup
from pagedrs.layers.attention import ForwardContext
from pagedrs.layers.linear import Loaded
from pagedrs.layers.mrope import get_mrope
from pagedrs.models.qwen2_5_vl import (
    Qwen2_5_VLForConditionalGeneration,
    QwenVisionParts,
    multimodal_forward,
)
from pagedrs.models.qwen3_5 import GatedAttention, Qwen3_5ForCausalLM
from pagedrs.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
from pagedrs.models.vision import Qwen3VisionTransformer
from pagedrs.multimodal import MultiModalBatch

__all__ = [
    "Qwen3VLForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
]


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    qk_norm = True
    mrope_interleaved = True  # as HF's Qwen3VLTextRotaryEmbedding
    default_mrope_section = (24, 20, 20)

    def make_visual(self, vision_config: Any) -> torch.nn.Module:
        return Qwen3VisionTransformer(vision_config)

    @property
    def deepstack_layers(self) -> int:
        return len(getattr(self.config.vision_config, "deepstack_visual_indexes", None) or [])


def _qwen3_5_vl(base: type[Qwen3_5ForCausalLM]) -> Any:
    """Qwen3.5's multimodal checkpoints over `base` (the dense or the MoE text model): the hybrid text
    decoder with interleaved M-RoPE, and the Qwen3-VL-style tower (no DeepStack) whose rows replace the
    image placeholders' embeddings, as HF's Qwen3_5ForConditionalGeneration."""

    class VL(QwenVisionParts, base):  # type: ignore[misc, valid-type]  # a class built per base
        def __init__(
            self,
            config: PretrainedConfig,
            *,
            dtype: torch.dtype,
            device: torch.device | str,
            tp: TPGroup | None = None,
        ) -> None:
            text = self.vl_text_config(config)
            super().__init__(text, dtype=dtype, device=device, tp=tp)
            self.text_config = text
            self.config = config
            head = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
            rope = get_mrope(text, head, interleaved=True, default_section=(11, 11, 10), device=device)
            self.model.rotary_emb = rope
            for module in self.model.modules():
                if isinstance(module, GatedAttention):
                    module.rotary_emb = rope
            self.visual = Qwen3VisionTransformer(config.vision_config).to(device=device, dtype=dtype)

        def forward(
            self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext, mm: MultiModalBatch | None = None
        ) -> Tensor:
            """input_ids [T], positions [3, T] (or [T]: text only) -> hidden states [T, hidden]: the text
            decoder's description run with the image rows scattered in."""
            return multimodal_forward(self.model, input_ids, positions, ctx, mm)

        def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
            """The text model's tensors as the text class loads them, the tower's (`model.visual.*` or
            `visual.*`) into `visual`."""
            prefix = "model.visual."
            super().load_weights(
                ("visual." + name[len(prefix) :] if name.startswith(prefix) else name, t)
                for name, t in weights
            )

    return VL


class Qwen3_5ForConditionalGeneration(_qwen3_5_vl(Qwen3_5ForCausalLM)):  # type: ignore[misc]
    """Qwen3.5 (dense) with its vision tower."""


class Qwen3_5MoeForConditionalGeneration(_qwen3_5_vl(Qwen3_5MoeForCausalLM)):  # type: ignore[misc]
    """Qwen3.5 MoE with its vision tower."""
