"""Gemma 3 with images, as HF's Gemma3ForConditionalGeneration computes it: a SigLIP vision tower (one
image of `image_size` pixels -> patches x vision hidden), the multimodal projector (average pooling of the
patch grid down to `mm_tokens_per_image` tokens, a (1 + w) RMSNorm, a matmul into the text hidden size),
and Gemma 3's text model, whose embeddings take the projected rows at the image tokens (after the
sqrt(hidden) scale, as HF's masked_scatter) and whose image tokens attend to each other both ways in the
prompt (HF's `token_type_ids` mask; `mm_bidirectional`).

The vision tower is transformers' SiglipVisionModel run on torch (CPU or CUDA), in the model's dtype. Both
checkpoint layouts load: transformers 5's (`model.language_model.`, `model.vision_tower.`,
`model.multi_modal_projector.`) and the original one (`language_model.model.`,
`vision_tower.vision_model.`, `multi_modal_projector.`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
import transformers
from torch import Tensor
from transformers import PretrainedConfig

from pagedrs.distributed.group import TPGroup
from pagedrs.layers.linear import Loaded
from pagedrs.models.gemma import Gemma3ForCausalLM
from pagedrs.models.utils import load_weights_into

__all__ = ["Gemma3ForConditionalGeneration", "Gemma3Projector"]

_VISION = ("vision_tower.", "multi_modal_projector.")

# (checkpoint prefix, parameter prefix), the first that matches
_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


class Gemma3Projector(torch.nn.Module):
    """HF's Gemma3MultiModalProjector: [B, patches, vision hidden] -> [B, mm_tokens_per_image, hidden]."""

    def __init__(
        self, vision: PretrainedConfig, hidden: int, tokens_per_image: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.mm_input_projection_weight = torch.nn.Parameter(
            torch.zeros(vision.hidden_size, hidden, dtype=dtype), requires_grad=False
        )
        self.mm_soft_emb_norm = transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm(
            vision.hidden_size, eps=vision.layer_norm_eps
        ).to(dtype)
        self.patches_per_side = int(vision.image_size // vision.patch_size)
        tokens_per_side = int(tokens_per_image**0.5)
        if tokens_per_side * tokens_per_side != tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ValueError(
                f"mm_tokens_per_image {tokens_per_image} must be a square dividing the "
                f"{self.patches_per_side}x{self.patches_per_side} patch grid"
            )
        self.kernel = self.patches_per_side // tokens_per_side

    def forward(self, x: Tensor) -> Tensor:
        b, _, d = x.shape
        grid = x.transpose(1, 2).reshape(b, d, self.patches_per_side, self.patches_per_side).contiguous()
        pooled = torch.nn.functional.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(x)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3's text model with its SigLIP tower and projector (`supports_multimodal`)."""

    supports_multimodal: ClassVar[bool] = True
    mm_bidirectional: ClassVar[bool] = True

    def __init__(
        self,
        config: PretrainedConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__(config, dtype=dtype, device=device, tp=tp)
        vision = config.vision_config
        self.vision_tower = transformers.AutoModel.from_config(vision).to(dtype=dtype, device=device).eval()
        for p in self.vision_tower.parameters():
            p.requires_grad_(False)
        self.multi_modal_projector = Gemma3Projector(
            vision, config.hidden_size, int(config.mm_tokens_per_image), dtype
        ).to(device)
        self.image_token_id = int(config.image_token_id)

    def embed_multimodal(self, items: list[dict[str, Tensor]]) -> list[Tensor]:
        """Per item (`pixel_values` [1, 3, S, S]: one image or one pan-and-scan crop), its projected rows
        [mm_tokens_per_image, hidden]; the items run as one batch through the tower."""
        if not items:
            return []
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        pixels = torch.cat([it["pixel_values"].reshape(-1, *it["pixel_values"].shape[-3:]) for it in items])
        hidden = self.vision_tower(pixel_values=pixels.to(dtype)).last_hidden_state
        feats = self.multi_modal_projector(hidden)
        if feats.shape[0] != len(items):
            raise ValueError(
                f"{len(items)} image items gave {feats.shape[0]} encoder outputs (one each expected)"
            )
        return list(feats.unbind(0))

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        """Load HF-named tensors of either layout; every parameter must be covered."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.tie_word_embeddings:
            skip = (*skip, "lm_head.weight")

        def vision_name(name: str) -> tuple[str, object] | None:
            return (name, None) if name.startswith(_VISION) else None

        load_weights_into(
            self, weights, self.stacked_params, skip=skip, renames=_RENAMES, name_map=vision_name
        )
