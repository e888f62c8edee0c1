"""Qwen2.5-VL (HF's Qwen2_5_VLForConditionalGeneration): the Qwen2 text decoder (q/k/v biases) with
blocked M-RoPE (`mrope_section`), and its window-attention vision transformer (models.vision.qwen2_5).

What a multimodal model gives the runner (shared with Qwen3-VL, which builds on this class):
- `embed_multimodal(items)`: per image item (the processor's `pixel_values`, `image_grid_thw`) its
  encoder rows [placeholder tokens, D] (D = hidden, or hidden * (1 + DeepStack layers) for Qwen3-VL);
- `forward(input_ids, positions, ctx, mm)`: `mm.embeds` [N, D] replace the token embeddings of the rows
  `mm.mask` [T] marks (the first `hidden` columns; Qwen3-VL adds the next slices to those rows after its
  first decoder layers), as HF's `masked_scatter` of the image features;
- `get_mrope_input_positions(prompt_token_ids, mm_items, hf_config)`: HF's `get_rope_index` for one prompt
  ([3, L] positions, and the delta decode positions add). `positions` may be [3, T] or [T] (text only).

The config is the checkpoint's (text_config, vision_config) or, as the loader gives it
(`registry.VISION_PARTS`), its text config carrying `vision_config` and the image token ids.
Tensors load from both checkpoint layouts: `model.language_model.*` / `model.visual.*` (transformers 5)
and `model.*` / `visual.*` (the released checkpoints).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
from torch import Tensor
from transformers import PretrainedConfig

from pagedrs.distributed.group import TPGroup
from pagedrs.layers.attention import ForwardContext
from pagedrs.layers.linear import Loaded
from pagedrs.layers.mrope import get_mrope, mrope_positions
from pagedrs.models.layer_desc import DescribedModel, TorchState, run_ops
from pagedrs.models.llama import LlamaForCausalLM, LlamaModel, _head_size
from pagedrs.models.utils import load_weights_into
from pagedrs.models.vision import Qwen2_5VisionTransformer
from pagedrs.multimodal import MultiModalBatch, MultiModalItem, item_tensors

__all__ = ["Qwen2_5_VLForConditionalGeneration", "QwenVisionParts", "multimodal_forward", "scatter_rows"]


def multimodal_forward(
    model: DescribedModel,
    input_ids: Tensor,
    positions: Tensor,
    ctx: ForwardContext,
    mm: MultiModalBatch | None,
    deepstack_layers: int = 0,
) -> Tensor:
    """The decoder stack's description run with the encoder rows scattered into the embeddings and
    (DeepStack) the next `hidden`-wide slices added to those rows' hidden states after each of the first
    `deepstack_layers` layers, as HF's Qwen3-VL `_deepstack_process`. A step without encoder rows (every
    decode step) is the stack's own forward, which a quantized CPU model's decode step replaces."""
    if mm is None or not mm.embeds.shape[0]:
        return cast(Tensor, model(input_ids, positions, ctx))
    desc = model.desc
    x = desc.embed(input_ids)
    width = x.shape[-1]
    embeds = mask = None
    if mm is not None and mm.embeds.shape[0]:
        mask = mm.mask.to(x.device)
        embeds = mm.embeds.to(device=x.device, dtype=x.dtype)
        x = scatter_rows(x, mm, positions)
    s = TorchState(positions, ctx, None, x)
    layers = desc.layers if ctx.exit_layer is None else desc.layers[: ctx.exit_layer]
    for i, layer in enumerate(layers):
        run_ops(layer, s)
        if embeds is not None and i < deepstack_layers and embeds.shape[1] >= width * (i + 2):
            assert s.residual is not None
            h = s.residual + s.x  # the layer's output, as HF's decoder layer returns it
            h[mask] = h[mask] + embeds[:, width * (i + 1) : width * (i + 2)]
            s.x, s.residual = h, None  # the next pre-norm takes h as its residual
    desc.final.run(s)
    return s.x


def _grid(data: dict[str, Tensor]) -> list[int]:
    """An image item's (t, h, w) patch grid."""
    grid = data.get("image_grid_thw")
    if grid is None:
        raise ValueError("an image item needs its image_grid_thw")
    return [int(v) for v in grid.reshape(-1)[:3].tolist()]


def scatter_rows(x: Tensor, mm: MultiModalBatch | None, positions: Tensor) -> Tensor:
    """The embeddings with `mm`'s encoder rows (their first `hidden` columns) in the rows it marks.
    ValueError for image rows at [T] positions: an image's tokens need their M-RoPE rows ([3, T])."""
    if mm is None or not mm.embeds.shape[0]:
        return x
    if positions.dim() != 2:
        raise ValueError("image tokens need M-RoPE positions [3, T] (get_mrope_input_positions), got [T]")
    x = x.clone()
    x[mm.mask.to(x.device)] = mm.embeds[:, : x.shape[-1]].to(device=x.device, dtype=x.dtype)
    return x


class QwenVisionParts:
    """What the Qwen VL families share around their towers: encoding a step's images and the prompt's
    M-RoPE positions."""

    supports_multimodal = True
    uses_mrope = True
    config: Any
    visual: torch.nn.Module

    @staticmethod
    def vl_text_config(config: PretrainedConfig) -> PretrainedConfig:
        """The text decoder's config (a copy) with the checkpoint's `tie_word_embeddings`."""
        text = copy.deepcopy(config.get_text_config())
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        return text

    def embed_multimodal(self, items: list[dict[str, Tensor]]) -> list[Tensor]:
        """Per image item its encoder rows [t * h * w / merge^2, D], the tower run once over all items."""
        if not items:
            return []
        device = next(self.visual.parameters()).device
        pixels = torch.cat([item["pixel_values"] for item in items]).to(device)
        grids = torch.tensor([_grid(item) for item in items])
        rows = self.visual(pixels, grids)
        merge = int(self.config.vision_config.spatial_merge_size)
        sizes = (grids.prod(-1) // (merge * merge)).tolist()
        return list(torch.split(rows, sizes))

    @staticmethod
    def get_mrope_input_positions(
        prompt_token_ids: Sequence[int], mm_items: Sequence[MultiModalItem], hf_config: PretrainedConfig
    ) -> tuple[Tensor, int]:
        """HF's `get_rope_index` for one prompt: each item's grid (its `image_grid_thw`) placed at its
        `offset` (the first placeholder token)."""
        merge = int(hf_config.vision_config.spatial_merge_size)
        images = [(int(item.offset), _grid(item_tensors(item))) for item in mm_items]
        return mrope_positions(len(prompt_token_ids), images, merge)


class Qwen2_5_VLForConditionalGeneration(QwenVisionParts, LlamaForCausalLM):
    mrope_interleaved = False  # blocked sections, as HF's Qwen2_5_VLRotaryEmbedding
    default_mrope_section = (16, 24, 24)  # HF's when the config names none

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
        self.visual = self.make_visual(config.vision_config).to(device=device, dtype=dtype)

    def make_visual(self, vision_config: Any) -> torch.nn.Module:
        return Qwen2_5VisionTransformer(vision_config)

    def make_model(
        self, config: PretrainedConfig, *, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> LlamaModel:
        rope = get_mrope(
            config,
            _head_size(config),
            interleaved=self.mrope_interleaved,
            default_section=self.default_mrope_section,
            device=device,
        )
        return LlamaModel(config, qk_norm=self.qk_norm, tp=tp, dtype=dtype, device=device, rotary_emb=rope)

    @property
    def deepstack_layers(self) -> int:
        return 0

    def forward(
        self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext, mm: MultiModalBatch | None = None
    ) -> Tensor:
        """input_ids [T], positions [3, T] (or [T]: text only) -> hidden states [T, hidden]."""
        return multimodal_forward(self.model, input_ids, positions, ctx, mm, self.deepstack_layers)

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        """HF-named tensors of either layout; the vision tower's load as they are (no fused shards)."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.tie_word_embeddings:
            skip = (*skip, "lm_head.weight")
        renames = (("model.language_model.", "model."), ("model.visual.", "visual."))

        def vision(name: str) -> tuple[str, object] | None:
            return (name, None) if name.startswith("visual.") else None

        load_weights_into(self, weights, self.stacked_params, skip=skip, renames=renames, name_map=vision)
