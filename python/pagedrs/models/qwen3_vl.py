"""Qwen3-VL (HF's Qwen3VLForConditionalGeneration): the Qwen3 text decoder (per-head q/k RMSNorm) with
interleaved M-RoPE, its vision transformer with learned position embeddings (models.vision.qwen3), and
DeepStack: the rows of the tower's DeepStack mergers travel with each item (`embed_multimodal` gives
[tokens, hidden * (1 + len(deepstack_visual_indexes))]) and are added to the image rows' hidden states after
decoder layers 0, 1, ... as HF's `_deepstack_process`. Everything else is Qwen2.5-VL's
(models.qwen2_5_vl)."""

from __future__ import annotations

from typing import Any

import torch

from pagedrs.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from pagedrs.models.vision import Qwen3VisionTransformer

__all__ = ["Qwen3VLForConditionalGeneration"]


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    qk_norm = True
    mrope_interleaved = True  # as HF's Qwen3VLTextRotaryEmbedding

    def make_visual(self, vision_config: Any) -> torch.nn.Module:
        return Qwen3VisionTransformer(vision_config)

    @property
    def deepstack_layers(self) -> int:
        return len(getattr(self.config.vision_config, "deepstack_visual_indexes", None) or [])
