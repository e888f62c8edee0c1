"""Multimodal RoPE (M-RoPE) of the Qwen vision-language models, as HF transformers computes it: each token
has three positions (temporal, height, width; all three equal for text), and each rotary frequency pair
takes its angle from one of them.

Which axis a frequency pair reads is the layout:
- blocked (Qwen2-VL / Qwen2.5-VL): the first `mrope_section[0]` pairs read t, the next `mrope_section[1]`
  read h, the last `mrope_section[2]` read w;
- interleaved (Qwen3-VL, Qwen3.5): pairs cycle t, h, w (pair j reads h when j % 3 == 1 and
  j < 3 * mrope_section[1], w when j % 3 == 2 and j < 3 * mrope_section[2], t otherwise).

With [T] positions (all three axes equal) it is plain RoPE. With [3, T] positions the per-token cos/sin
rows are gathered and composed in torch, then rotated as plain RoPE over positions 0..T-1 of that
per-token table (with kernels on, by the same CUDA rotary kernel).

`mrope_positions` is HF's `get_rope_index` for one prompt: text tokens count up by one in all three axes;
an image's placeholder tokens take (start, start + row, start + column) over its merged patch grid, and
the text after it starts at start + max(rows, columns).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from pagedrs.layers.rotary import RotaryEmbedding, _rotate, rope_parameters

__all__ = ["MRotaryEmbedding", "get_mrope", "mrope_axis_map", "mrope_positions"]


def mrope_axis_map(section: Sequence[int], interleaved: bool, pairs: int | None = None) -> Tensor:
    """Per rotary frequency pair (`pairs` of them, default sum(section)), the axis (0 t, 1 h, 2 w) whose
    position gives its angle. Blocked sections must cover the pairs exactly; interleaved ones are clipped
    to them, as HF's strided slices are."""
    pairs = sum(section) if pairs is None else pairs
    if not interleaved:
        if sum(section) != pairs:
            raise ValueError(f"mrope_section {list(section)} must sum to rotary_dim / 2 = {pairs}")
        return torch.cat([torch.full((n,), axis, dtype=torch.int64) for axis, n in enumerate(section)])
    axis = torch.zeros(pairs, dtype=torch.int64)
    axis[1 : 3 * section[1] : 3] = 1
    axis[2 : 3 * section[2] : 3] = 2
    return axis


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE over [3, T] positions with an M-RoPE layout (or [T] positions: plain RoPE)."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        params: dict[str, Any],
        *,
        mrope_section: Sequence[int],
        interleaved: bool,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(head_size, rotary_dim, max_position, params, device=device)
        if self.long_cos_sin_cache is not None or self.rope_type == "dynamic":
            raise ValueError(f"M-RoPE with rope_type {self.rope_type!r} is not supported")
        self.mrope_section = list(mrope_section)
        self.interleaved = interleaved
        self.axis_map: Tensor
        self.register_buffer(
            "axis_map",
            mrope_axis_map(mrope_section, interleaved, rotary_dim // 2).to(device),
            persistent=False,
        )

    def token_cos_sin(self, positions: Tensor) -> Tensor:
        """[3, T] positions -> [T, rotary_dim] float32 (cos | sin), each pair's angle from its axis."""
        half = self.rotary_dim // 2
        rows = self.cos_sin_cache[positions]  # [3, T, rotary_dim]
        index = torch.cat([self.axis_map, self.axis_map])[None, None, :].expand(1, rows.shape[1], 2 * half)
        return rows.gather(0, index)[0]

    def forward(
        self, positions: Tensor, q: Tensor, k: Tensor, seq_lens: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, q, k, seq_lens)
        table = self.token_cos_sin(positions)
        t = positions.shape[1]
        if self.fits(q, k):
            from pagedrs.kernels import layer_ops

            rows = torch.arange(t, device=q.device, dtype=torch.int64)
            layer_ops.rotary_embedding(rows, q, k, self.head_size, table.contiguous(), is_neox=True)
            return q, k
        half = self.rotary_dim // 2
        cos, sin = table[:, :half], table[:, half:]
        q_out = _rotate(q.view(t, -1, self.head_size), cos, sin, self.rotary_dim).reshape(q.shape)
        k_out = _rotate(k.view(t, -1, self.head_size), cos, sin, self.rotary_dim).reshape(k.shape)
        return q_out, k_out

    def extra_repr(self) -> str:
        layout = "interleaved" if self.interleaved else "blocked"
        return f"{super().extra_repr()}, mrope_section={self.mrope_section}, layout={layout}"


def get_mrope(
    config: Any,
    head_size: int,
    *,
    interleaved: bool,
    default_section: Sequence[int],
    device: torch.device | str = "cpu",
) -> MRotaryEmbedding:
    """The M-RoPE of a Qwen VL text config (`rope_parameters["mrope_section"]`, else the family's
    `default_section` as HF's rotary falls back on); `interleaved` is the family's layout (HF's Qwen3-VL
    rotary interleaves whatever `mrope_interleaved` says)."""
    params = rope_parameters(config)
    section = params.get("mrope_section") or list(default_section)
    if params["rope_type"] == "mrope":  # HF's older name for the default frequencies
        params["rope_type"] = "default"
    rotary_dim = int(head_size * float(params.get("partial_rotary_factor", 1.0)))
    max_position = int(getattr(config, "max_position_embeddings", 2048))
    return MRotaryEmbedding(
        head_size,
        rotary_dim,
        max_position,
        params,
        mrope_section=section,
        interleaved=interleaved,
        device=device,
    )


def mrope_positions(
    num_tokens: int, images: Sequence[tuple[int, Sequence[int]]], spatial_merge_size: int
) -> tuple[Tensor, int]:
    """HF's `get_rope_index` for one prompt of `num_tokens` tokens whose images are `(offset of the first
    placeholder token, (t, h, w) patch grid)` in prompt order: ([3, num_tokens] int64 positions, delta),
    delta being what a later token's position adds to its index (max position + 1 - num_tokens)."""
    parts: list[Tensor] = []
    pos = 0  # the next text position
    cursor = 0  # the next token index
    for offset, (t, h, w) in sorted(images, key=lambda item: item[0]):
        if offset < cursor:
            raise ValueError(f"image placeholders overlap at token {offset}")
        parts.append(torch.arange(offset - cursor).expand(3, -1) + pos)
        pos += offset - cursor
        gh, gw = int(h) // spatial_merge_size, int(w) // spatial_merge_size
        tt, hh, ww = torch.meshgrid(torch.arange(int(t)), torch.arange(gh), torch.arange(gw), indexing="ij")
        parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        cursor = offset + int(t) * gh * gw
        pos += max(gh, gw)
    if cursor > num_tokens:
        raise ValueError(f"image placeholders run past the prompt's {num_tokens} tokens")
    parts.append(torch.arange(num_tokens - cursor).expand(3, -1) + pos)
    positions = torch.cat(parts, dim=1).long()
    top = int(positions.max()) + 1 if num_tokens else 0
    return positions, top - num_tokens
