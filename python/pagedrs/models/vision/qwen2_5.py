"""Qwen2.5-VL's vision transformer in torch, as HF's Qwen2_5_VisionTransformerPretrainedModel: patch
embedding (no bias), 2-D rotary, blocks of RMSNorm + attention + RMSNorm + gated MLP with window attention
(full attention at `fullatt_block_indexes`), and the patch merger (RMSNorm, then an MLP over each
spatial-merge block of patches) giving one row per LLM placeholder token. Parameter names are HF's."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from pagedrs.models.vision.common import (
    PatchEmbed,
    VisionAttention,
    VisionRMSNorm,
    VisionRotary,
    act_fn,
    grid_list,
    image_cu_seqlens,
    patch_positions,
    window_index,
)

__all__ = ["Qwen2_5VisionTransformer"]


class Qwen2_5VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=True)
        self.up_proj = nn.Linear(dim, hidden, bias=True)
        self.down_proj = nn.Linear(hidden, dim, bias=True)
        self.act = act_fn(act)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Qwen2_5VisionBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(config.hidden_size)
        self.norm2 = VisionRMSNorm(config.hidden_size)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = Qwen2_5VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x: Tensor, cu_seqlens: list[int], cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class Qwen2_5PatchMerger(nn.Module):
    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.ln_q = VisionRMSNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen2_5VisionTransformer(nn.Module):
    """pixel_values [patches, C * T * P * P] and image_grid_thw [N, 3] -> [patches / merge^2, out_hidden]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.merge = int(config.spatial_merge_size)
        self.patch_size = int(config.patch_size)
        self.window_size = int(config.window_size)
        self.fullatt_block_indexes = set(config.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(config, bias=False)
        head_dim = config.hidden_size // config.num_heads
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        self.rotary_pos_emb = VisionRotary(head_dim, theta)
        self.blocks = nn.ModuleList(Qwen2_5VisionBlock(config) for _ in range(config.depth))
        self.merger = Qwen2_5PatchMerger(config.out_hidden_size, config.hidden_size, self.merge)

    def forward(self, pixel_values: Tensor, grid_thw: Tensor) -> Tensor:
        grids = grid_list(grid_thw)
        unit = self.merge * self.merge
        order, window_bounds = window_index(grids, self.merge, self.window_size, self.patch_size)
        order = order.to(pixel_values.device)
        full_bounds = image_cu_seqlens(grids)
        x = self.patch_embed(pixel_values)
        n = x.shape[0]

        def permute(t: Tensor) -> Tensor:  # whole merge blocks into window order
            return t.reshape(n // unit, unit, -1)[order].reshape(n, -1)

        x = permute(x)
        cos, sin = self.rotary_pos_emb(patch_positions(grids, self.merge).to(x.device))
        cos, sin = permute(cos), permute(sin)
        for i, block in enumerate(self.blocks):
            bounds = full_bounds if i in self.fullatt_block_indexes else window_bounds
            x = block(x, bounds, cos, sin)
        merged = self.merger(x)
        return merged[torch.argsort(order)]
