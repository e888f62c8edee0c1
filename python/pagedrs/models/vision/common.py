"""Pieces the Qwen vision towers share, in torch (CPU and CUDA), as HF transformers computes them: the patch
embedding, the 2-D rotary over (row, column) patch positions, the bidirectional attention within each
image (or each window), and the grid bookkeeping (patch positions in spatial-merge-block order, the
window permutation of Qwen2.5-VL, the per-image segment boundaries)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "PatchEmbed",
    "VisionAttention",
    "VisionRMSNorm",
    "VisionRotary",
    "act_fn",
    "grid_list",
    "image_cu_seqlens",
    "patch_positions",
    "window_index",
]


def act_fn(name: str) -> Callable[[Tensor], Tensor]:
    """The vision MLP's activation by its HF name."""
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name in ("silu", "swish"):
        return F.silu
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    raise ValueError(f"unsupported vision activation {name!r}")


def grid_list(grid_thw: Tensor) -> list[tuple[int, int, int]]:
    """[N, 3] (or [3]) patch grids -> [(t, h, w), ...] as ints."""
    rows = grid_thw.reshape(-1, 3).tolist()
    return [(int(t), int(h), int(w)) for t, h, w in rows]


class VisionRMSNorm(nn.Module):
    """RMSNorm computed in float32, weight applied in the input dtype (HF's Qwen2_5_VLRMSNorm)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class PatchEmbed(nn.Module):
    """HF's Conv3d over (temporal, patch, patch) cubes with stride = kernel, one cube per row of the
    processor's flattened patches [N, C * T * P * P] (run as the convolution, not as the linear map it
    equals, so the sums round as HF's do)."""

    def __init__(self, config: Any, *, bias: bool) -> None:
        super().__init__()
        self.kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.in_channels = config.in_channels
        self.proj = nn.Conv3d(
            config.in_channels, config.hidden_size, self.kernel, stride=self.kernel, bias=bias
        )
        self.hidden_size = config.hidden_size

    def forward(self, pixels: Tensor) -> Tensor:
        cubes = pixels.to(self.proj.weight.dtype).view(-1, self.in_channels, *self.kernel)
        return self.proj(cubes).view(-1, self.hidden_size)


class VisionRotary(nn.Module):
    """Axial 2-D RoPE: a quarter of the head's frequencies per axis (theta from the vision config), the row
    angles then the column angles, the whole head rotated (neox halves), in float32."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        spatial = head_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.inv_freq: Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [N, 2] (row, column) -> cos, sin [N, head_dim] float32."""
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)  # [N, 2, head_dim/4]
        hw = freqs.flatten(1)
        emb = torch.cat([hw, hw], dim=-1)
        return emb.cos(), emb.sin()


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class VisionAttention(nn.Module):
    """Fused qkv, 2-D rotary, attention without a mask within each segment of `cu_seqlens` (an image, or a
    window of one), output projection."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, cu_seqlens: list[int], cos: Tensor, sin: Tensor) -> Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
        c, s = cos[:, None, :], sin[:, None, :]
        q = (q.float() * c + _rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(x.dtype)
        out = torch.empty_like(q)
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
            if end == start:
                continue
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
            out[start:end] = F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1)
        return self.proj(out.reshape(n, -1))


def patch_positions(grids: list[tuple[int, int, int]], merge: int) -> Tensor:
    """Per patch (row, column) [N, 2], the patches of each image ordered by spatial-merge block (the
    `merge` x `merge` patches one LLM token merges are consecutive), repeated per frame."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        block = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(block).transpose(1, 2).flatten()
        cols = cols.reshape(block).transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def image_cu_seqlens(grids: list[tuple[int, int, int]]) -> list[int]:
    """Segment boundaries of full attention: one segment per frame of each image."""
    bounds = [0]
    for t, h, w in grids:
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds


def window_index(
    grids: list[tuple[int, int, int]], merge: int, window_size: int, patch_size: int
) -> tuple[Tensor, list[int]]:
    """Qwen2.5-VL's windows: the permutation of merged tokens that makes each window's tokens consecutive
    (windows of `window_size` pixels, raster order within and across windows), and the windows' patch
    boundaries (empty windows dropped)."""
    index: list[Tensor] = []
    bounds = [0]
    base = 0
    side = window_size // merge // patch_size
    unit = merge * merge
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        grid = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = side - gh % side, side - gw % side
        nh, nw = (gh + pad_h) // side, (gw + pad_w) // side
        padded = F.pad(grid, (0, pad_w, 0, pad_h), "constant", -100)
        padded = padded.reshape(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, side, side)
        sizes = (padded != -100).sum([2, 3]).reshape(-1)
        flat = padded.reshape(-1)
        index.append(flat[flat != -100] + base)
        for size in sizes.tolist():
            if size:
                bounds.append(bounds[-1] + size * unit)
        base += t * gh * gw
    return torch.cat(index), bounds
