"""Qwen3-VL's vision transformer in torch, as HF's Qwen3VLVisionModel (and Qwen3.5's Qwen3_5VisionModel,
the same tower without DeepStack): patch embedding (with bias) plus learned position embeddings resampled
bilinearly (align_corners) from their square grid to each image's grid, 2-D rotary, LayerNorm blocks with a
plain MLP and full attention within each image, the patch merger, and at each of
`deepstack_visual_indexes` a DeepStack merger of that block's output (LayerNorm after the merge-block
shuffle). Parameter names are HF's."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from pagedrs.models.vision.common import (
    PatchEmbed,
    VisionAttention,
    VisionRotary,
    act_fn,
    grid_list,
    image_cu_seqlens,
    patch_positions,
)

__all__ = ["Qwen3VisionTransformer", "bilinear_taps"]


class Qwen3VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=True)
        self.act = act_fn(act)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = Qwen3VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x: Tensor, cu_seqlens: list[int], cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class Qwen3PatchMerger(nn.Module):
    """LayerNorm per patch (or, `postshuffle`, over each merge block's concatenated patches), then
    Linear-GELU-Linear over each merge block."""

    def __init__(self, config: Any, *, postshuffle: bool) -> None:
        super().__init__()
        merge = int(config.spatial_merge_size)
        self.hidden = config.hidden_size * merge * merge
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.hidden if postshuffle else config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.hidden, self.hidden)
        self.linear_fc2 = nn.Linear(self.hidden, config.out_hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm(x.view(-1, self.hidden) if self.postshuffle else x).view(-1, self.hidden)
        return self.linear_fc2(nn.functional.gelu(self.linear_fc1(x)))


def _axis_taps(index: Tensor, size: int, side: int) -> tuple[Tensor, Tensor]:
    """Bilinear (align_corners) taps into a `side`-long table for positions `index` on an axis of `size`."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def bilinear_taps(grids: list[tuple[int, int, int]], side: int, merge: int) -> tuple[Tensor, Tensor]:
    """Per patch (in merge-block order, repeated per frame) the 4 rows of the `side` x `side` position table
    and their bilinear weights that resample it to the image's grid (F.interpolate, align_corners)."""
    indices, weights = [], []
    for t, h, w in grids:
        pos = patch_positions([(t, h, w)], merge)
        h_taps, h_w = _axis_taps(pos[:, 0], h, side)
        w_taps, w_w = _axis_taps(pos[:, 1], w, side)
        indices.append((h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4))
        weights.append((h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4))
    return torch.cat(indices), torch.cat(weights)


class Qwen3VisionTransformer(nn.Module):
    """pixel_values [patches, C * T * P * P] and image_grid_thw [N, 3] -> [patches / merge^2,
    out_hidden * (1 + DeepStack layers)]: the merger's rows, then each DeepStack merger's, side by side."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.merge = int(config.spatial_merge_size)
        self.patch_embed = PatchEmbed(config, bias=True)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.side = int(config.num_position_embeddings**0.5)
        head_dim = config.hidden_size // config.num_heads
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        self.rotary_pos_emb = VisionRotary(head_dim, theta)
        self.blocks = nn.ModuleList(Qwen3VisionBlock(config) for _ in range(config.depth))
        self.merger = Qwen3PatchMerger(config, postshuffle=False)
        self.deepstack_visual_indexes = list(getattr(config, "deepstack_visual_indexes", None) or [])
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(config, postshuffle=True) for _ in self.deepstack_visual_indexes
        )

    def forward(self, pixel_values: Tensor, grid_thw: Tensor) -> Tensor:
        grids = grid_list(grid_thw)
        x = self.patch_embed(pixel_values)
        idx, weights = bilinear_taps(grids, self.side, self.merge)
        pos = (self.pos_embed(idx.to(x.device)) * weights.to(x.device)[:, :, None]).sum(1)
        x = x + pos.to(x.dtype)
        cos, sin = self.rotary_pos_emb(patch_positions(grids, self.merge).to(x.device))
        bounds = image_cu_seqlens(grids)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, bounds, cos, sin)
            if i in self.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)]
                deepstack.append(merger(x))
        return torch.cat([self.merger(x), *deepstack], dim=-1)
