"""Rotary position embeddings (RoPE) as HF transformers computes them: neox style (rotate halves, the
Llama family) or GPT-J style (interleaved pairs).

Scalings: default, linear, dynamic (NTK, recomputed past max_position_embeddings like HF), llama3
(Llama 3.1), yarn (HF's _compute_yarn_parameters: gpt-oss, Qwen long context) and longrope (Phi-3 128k: short factors while a request fits in the original context, long
factors once it grows past it; cos/sin multiplied by the attention factor) and proportional (Gemma 4's
global layers: the first `partial_rotary_factor` of the frequencies of the whole head rotate, the others
are zero, as HF's _compute_proportional_rope_parameters).

cos/sin are cached in float32 per position and indexed by `positions`, so a step costs one gather. With
kernels on (KernelLayer), one launch of cuda/layer_ops.cu rotates q and k in place, reading the same cache.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from pagedrs.layers.kernel_switch import KernelLayer

__all__ = ["RotaryEmbedding", "get_rope", "rope_parameters"]


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's RoPE settings as one dict with at least "rope_type" and "rope_theta".

    Accepts transformers >= 5 (`rope_parameters`, theta inside) and older configs (`rope_scaling` +
    `rope_theta`, "type" instead of "rope_type")."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    if "rope_type" not in params:
        params["rope_type"] = params.pop("type", "default")
    if params.get("rope_theta") is None:
        theta = getattr(config, "rope_theta", None)
        params["rope_theta"] = float(theta) if theta is not None else 10000.0
    if "partial_rotary_factor" not in params and getattr(config, "partial_rotary_factor", None) is not None:
        params["partial_rotary_factor"] = config.partial_rotary_factor
    if params["rope_type"] in ("su", "yarn") and "short_factor" in params:  # old Phi-3 names
        params["rope_type"] = "longrope"
    orig = getattr(config, "original_max_position_embeddings", None)
    if params.get("original_max_position_embeddings") is None and orig is not None:
        params["original_max_position_embeddings"] = orig
    return params


def _inv_freq(base: float, rotary_dim: int) -> Tensor:
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (base**exponent)


def _llama3_inv_freq(inv_freq: Tensor, p: dict[str, Any]) -> Tensor:
    factor = p["factor"]
    low, high = p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    base: float, rotary_dim: int, max_position: int, p: dict[str, Any]
) -> tuple[Tensor, float]:
    """(inv_freq, attention factor) of YaRN as HF's _compute_yarn_parameters: frequencies blended between
    interpolated (divided by `factor`) and extrapolated ones over a linear ramp of dimensions set by
    beta_fast/beta_slow, and cos/sin scaled by 0.1 * ln(factor) + 1 (or `attention_factor`)."""
    orig = int(p["original_max_position_embeddings"])
    factor = p.get("factor")
    factor = float(factor) if factor is not None else max_position / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as HF: no zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def _proportional_inv_freq(base: float, head_size: int, p: dict[str, Any]) -> Tensor:
    """HF's proportional RoPE: `partial_rotary_factor` of the head's frequency pairs over the whole head's
    exponents, zeros for the rest (those dims are not rotated), all divided by `factor`; `head_size`: the
    dims the rotation spans (the head size, or llama.cpp's `n_rot` of them)."""
    angles = int(float(p.get("partial_rotary_factor", 1.0)) * head_size // 2)
    exponent = torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_size
    inv_freq = torch.cat([1.0 / (base**exponent), torch.zeros(head_size // 2 - angles)])
    return inv_freq / float(p.get("factor", 1.0))


def _cos_sin(inv_freq: Tensor, num_positions: int, scaling: float = 1.0) -> Tensor:
    """[num_positions, rotary_dim] float32: cos in the first half of the last dim, sin in the second."""
    t = torch.arange(num_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq.float())
    return torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int, is_neox: bool = True) -> Tensor:
    """x [T, heads, D]; cos/sin [T, rotary_dim/2] float32. Rotates the first rotary_dim dims: neox pairs
    dim j with j + rotary_dim/2, GPT-J dim 2j with 2j+1."""
    half = rotary_dim // 2
    rot = x[..., :rotary_dim]
    if is_neox:
        cos = torch.cat([cos, cos], dim=-1)[:, None, :].to(x.dtype)
        sin = torch.cat([sin, sin], dim=-1)[:, None, :].to(x.dtype)
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat([-x2, x1], dim=-1)
        out = rot * cos + rotated * sin
    else:
        cos = cos.repeat_interleave(2, dim=-1)[:, None, :].to(x.dtype)
        sin = sin.repeat_interleave(2, dim=-1)[:, None, :].to(x.dtype)
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([-x2, x1], dim=-1).flatten(-2)
        out = rot * cos + rotated * sin
    if rotary_dim == x.shape[-1]:
        return out
    return torch.cat([out, x[..., rotary_dim:]], dim=-1)


class RotaryEmbedding(KernelLayer):
    """Applies RoPE to q [T, H*D] and k [T, KVH*D] at `positions` [T] (with kernels on: in place).

    `seq_lens` ([T], per token the context length of its request) is only read by longrope, which picks the
    long factors for a request once its length exceeds `original_max_position_embeddings`; without it the
    whole batch is treated as one sequence (HF's rule)."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        params: dict[str, Any],
        *,
        is_neox_style: bool = True,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_size:
            raise ValueError(f"rotary_dim must be even and in (0, head_size={head_size}], got {rotary_dim}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        self.max_position = max_position
        self.rope_type: str = params.get("rope_type", "default")
        self.params = params
        base = float(params.get("rope_theta", 10000.0))
        inv_freq = _inv_freq(base, rotary_dim)
        scaling = 1.0
        self.original_max_position: int | None = None
        long_cache: Tensor | None = None
        if self.rope_type == "linear":
            inv_freq = inv_freq / float(params["factor"])
        elif self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif self.rope_type == "yarn":
            inv_freq, scaling = _yarn_inv_freq(base, rotary_dim, max_position, params)
        elif self.rope_type == "longrope":
            orig = int(params.get("original_max_position_embeddings") or max_position)
            self.original_max_position = orig
            factor = params.get("factor") or max_position / orig
            attention_factor = params.get("attention_factor")
            scaling = (
                float(attention_factor)
                if attention_factor is not None
                else 1.0
                if factor <= 1.0
                else math.sqrt(1 + math.log(factor) / math.log(orig))
            )
            exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
            short = torch.tensor(params["short_factor"], dtype=torch.float32)
            long = torch.tensor(params["long_factor"], dtype=torch.float32)
            inv_freq = 1.0 / (short * base**exponent)
            long_cache = _cos_sin(1.0 / (long * base**exponent), max(max_position, orig + 1), scaling)
        elif self.rope_type == "proportional":
            inv_freq = _proportional_inv_freq(base, rotary_dim, params)
        elif self.rope_type == "dynamic":
            self.base = base
            self.factor = float(params["factor"])
        elif self.rope_type != "default":
            raise ValueError(f"unsupported rope_type {self.rope_type!r}")
        self.attention_scaling = float(scaling)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        cache = _cos_sin(inv_freq, max_position, scaling)
        self.cos_sin_cache: Tensor
        self.register_buffer("cos_sin_cache", cache.to(device), persistent=False)
        self.long_cos_sin_cache: Tensor | None
        if long_cache is not None:
            self.register_buffer("long_cos_sin_cache", long_cache.to(device), persistent=False)
        else:
            self.long_cos_sin_cache = None

    def _caches(self, positions: Tensor, seq_lens: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The cos/sin cache for this step, and longrope's long cache when it is picked per token (by
        seq_lens > original_max_position_embeddings), else None."""
        if self.long_cos_sin_cache is not None:
            orig = self.original_max_position
            assert orig is not None
            if seq_lens is None:
                use_long = bool(positions.numel()) and int(positions.max()) + 1 > orig
                return (self.long_cos_sin_cache if use_long else self.cos_sin_cache), None
            return self.cos_sin_cache, self.long_cos_sin_cache
        if self.rope_type == "dynamic":
            seq_len = int(positions.max()) + 1 if positions.numel() else 0
            if seq_len > self.max_position:
                d = self.rotary_dim
                base = self.base * ((self.factor * seq_len / self.max_position) - (self.factor - 1)) ** (
                    d / (d - 2)
                )
                return _cos_sin(_inv_freq(base, d), seq_len).to(positions.device), None
        return self.cos_sin_cache, None

    # Set on the quantized CPU path (loader): neox rotation of float32 CPU rows in place, in one Rust call.
    cpu_fused: bool = False

    def _cpu_fits(self, positions: Tensor, q: Tensor, k: Tensor) -> bool:
        """The Rust op's case: neox, one precomputed cache (no longrope / dynamic), float32 CPU q/k with a
        contiguous last dim, int64 positions within the cache."""
        return (
            self.is_neox_style
            and self.long_cos_sin_cache is None
            and self.rope_type != "dynamic"
            and positions.dtype == torch.int64
            and positions.is_contiguous()
            and all(t.dim() == 2 and t.dtype == torch.float32 and t.stride(1) == 1 for t in (q, k))
            and q.device.type == "cpu"
        )

    def _lookup(self, positions: Tensor, seq_lens: Tensor | None) -> Tensor:
        cache, long_cache = self._caches(positions, seq_lens)
        if long_cache is None:
            return cache[positions]
        assert seq_lens is not None and self.original_max_position is not None
        use_long = (seq_lens > self.original_max_position)[:, None]
        return torch.where(use_long, long_cache[positions], cache[positions])

    def forward(
        self, positions: Tensor, q: Tensor, k: Tensor, seq_lens: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        if self.fits(q, k):
            from pagedrs.kernels import layer_ops

            cache, long_cache = self._caches(positions, seq_lens)
            layer_ops.rotary_embedding(
                positions if positions.dtype == torch.int64 else positions.long(),
                q,
                k,
                self.head_size,
                cache,
                is_neox=self.is_neox_style,
                long_cos_sin_cache=long_cache,
                seq_lens=None if long_cache is None or seq_lens is None else seq_lens.long(),
                long_threshold=self.original_max_position or 0,
            )
            return q, k
        if self.cpu_fused and self._cpu_fits(positions, q, k):
            from pagedrs import _core

            _core.cpu_rope_neox(
                positions.numpy(),
                q.numpy(),
                k.numpy(),
                self.cos_sin_cache.numpy(),
                self.head_size,
                self.rotary_dim,
            )
            return q, k
        cos_sin = self._lookup(positions, seq_lens)
        half = self.rotary_dim // 2
        cos, sin = cos_sin[:, :half], cos_sin[:, half:]
        t = positions.shape[0]
        q3 = q.view(t, -1, self.head_size)
        k3 = k.view(t, -1, self.head_size)
        q_out = _rotate(q3, cos, sin, self.rotary_dim, self.is_neox_style).reshape(q.shape)
        k_out = _rotate(k3, cos, sin, self.rotary_dim, self.is_neox_style).reshape(k.shape)
        return q_out, k_out

    def extra_repr(self) -> str:
        style = "neox" if self.is_neox_style else "gptj"
        return (
            f"rope_type={self.rope_type}, rotary_dim={self.rotary_dim}, max_position={self.max_position}, "
            f"style={style}"
        )


def get_rope(
    config: Any,
    head_size: int,
    max_position: int | None = None,
    *,
    is_neox_style: bool = True,
    device: torch.device | str = "cpu",
) -> RotaryEmbedding:
    """A RotaryEmbedding for an HF config (any of the supported rope types; GPT-J layout on request)."""
    params = rope_parameters(config)
    rotary_dim = int(head_size * float(params.get("partial_rotary_factor", 1.0)))
    if params["rope_type"] == "proportional":  # the factor picks the rotated frequencies, not the dims
        # `rotary_dim`: the leading dims the frequencies span (a GGUF's `rope.dimension_count`), else all
        rotary_dim = int(params.get("rotary_dim", head_size))
    if max_position is None:
        max_position = int(getattr(config, "max_position_embeddings", 2048))
    return RotaryEmbedding(
        head_size, rotary_dim, max_position, params, is_neox_style=is_neox_style, device=device
    )
