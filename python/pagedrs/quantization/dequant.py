"""The GPTQ, AWQ and FP8 formats' arithmetic: each layer's parts dequantized to float32 [out, in] (the values
the format defines, computed exactly from the integers and the stored scales), and a GPTQ layer rewritten
as GGUF Q4_0 / Q8_0 blocks where that is exact.

Packing, as the formats write it:
- GPTQ: `qweight` int32 [in / (32/bits), out], packed along the input dim, value j of a word in bits
  [j*bits, (j+1)*bits); `qzeros` int32 [groups, out / (32/bits)], packed along the output dim the same
  way; `scales` [groups, out]; `g_idx` int32 [in], each input row's group. AutoGPTQ's v1 format stores
  each zero point minus one (read back as stored + 1); GPTQModel's v2 stores it as is.
- AWQ (GEMM): `qweight` int32 [in, out / 8] and `qzeros` int32 [groups, out / 8], packed along the output
  dim with nibble i of a word holding column `AWQ_PACK_ORDER[i]` of its 8; `scales` [groups, out];
  group of input row r is r // group_size; zero points stored as is.
- GGUF Q4_0 and Q8_0 compute `d * (q - 8)` and `d * q8` with one fp16 `d` per 32 weights: the same values
  as GPTQ's `scale * (q - zero)` when `zero` is 8 (or 128) and the group's scale is repeated over its
  blocks, so a GPTQ 4-bit or 8-bit layer with the symmetric midpoint as every zero point, fp16 scales and
  groups of whole 32-weight blocks in input order (no act-order permutation) is kept as those blocks.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from pagedrs.quantization.config import QuantConfig
from pagedrs.quantization.gguf_blocks import GGUFWeight

__all__ = [
    "AWQ_PACK_ORDER",
    "awq_group",
    "dequantize_awq",
    "dequantize_fp8",
    "dequantize_gptq",
    "gptq_as_gguf",
    "gptq_g_idx",
]

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_PACK_ORDER[i]
_AWQ_UNPACK = (0, 4, 1, 5, 2, 6, 3, 7)  # column c of an AWQ word is nibble _AWQ_UNPACK[c]
_Q4_0, _Q8_0 = 2, 8  # gguf.GGMLQuantizationType values


def _unpack(packed: Tensor, bits: int, dim: int) -> Tensor:
    """int32 words -> int32 values, `32 // bits` per word, value j in bits [j*bits, (j+1)*bits), laid
    out along `dim` (0: word [r, c] holds rows r*k..r*k+k-1; 1: columns)."""
    k = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    p = packed.to(torch.int32)
    if dim == 0:
        vals = (p.unsqueeze(1) >> shifts.view(1, k, 1)) & ((1 << bits) - 1)
        return vals.reshape(p.shape[0] * k, p.shape[1])
    vals = (p.unsqueeze(2) >> shifts.view(1, 1, k)) & ((1 << bits) - 1)
    return vals.reshape(p.shape[0], p.shape[1] * k)


def _check(name: str, t: Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")


def gptq_g_idx(name: str, parts: dict[str, Tensor], cfg: QuantConfig) -> Tensor:
    """A GPTQ layer's group id of each input row (int64 [in]; from its group size when it has no g_idx),
    its scales, zeros and group ids checked against its shapes."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    k = 32 // cfg.bits
    in_features, out_features = qweight.shape[0] * k, qweight.shape[1]
    groups = 1 if cfg.group_size == -1 else -(-in_features // cfg.group_size)
    _check(f"{name}.scales", scales, (groups, out_features))
    _check(f"{name}.qzeros", qzeros, (groups, -(-out_features // k)))
    g_idx = parts.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(in_features) // (in_features if cfg.group_size == -1 else cfg.group_size)
    _check(f"{name}.g_idx", g_idx, (in_features,))
    g_idx = g_idx.to(torch.int64)
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise ValueError(f"{name}.g_idx: group ids must lie in 0..{groups - 1}")
    return g_idx


def _gptq_ints(
    name: str, parts: dict[str, Tensor], cfg: QuantConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q [in, out], zeros [groups, out], scales [groups, out], g_idx [in]) of one GPTQ layer."""
    g_idx = gptq_g_idx(name, parts, cfg)
    q = _unpack(parts["qweight"], cfg.bits, 0)
    out_features = parts["qweight"].shape[1]
    zeros = _unpack(parts["qzeros"], cfg.bits, 1)[:, :out_features] + (1 if cfg.zero_plus_one else 0)
    return q, zeros, parts["scales"], g_idx


def dequantize_gptq(name: str, parts: dict[str, Tensor], cfg: QuantConfig) -> Tensor:
    """float32 [out, in]: W[c, r] = scales[g, c] * (q[r, c] - zero[g, c]) with g = g_idx[r]."""
    q, zeros, scales, g_idx = _gptq_ints(name, parts, cfg)
    w = (q - zeros[g_idx]).to(torch.float32) * scales.to(torch.float32)[g_idx]
    return w.t().contiguous()


def awq_group(name: str, parts: dict[str, Tensor], cfg: QuantConfig) -> int:
    """The AWQ layer's group size (its input size for -1), its scales and zeros checked against it."""
    qweight = parts["qweight"]
    in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
    group = in_features if cfg.group_size == -1 else cfg.group_size
    groups = -(-in_features // group)
    _check(f"{name}.scales", parts["scales"], (groups, out_features))
    _check(f"{name}.qzeros", parts["qzeros"], (groups, out_features // 8))
    return int(group)


def dequantize_awq(name: str, parts: dict[str, Tensor], cfg: QuantConfig) -> Tensor:
    """float32 [out, in]: W[c, r] = scales[g, c] * (q[r, c] - zero[g, c]) with g = r // group_size."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    in_features = qweight.shape[0]
    group = awq_group(name, parts, cfg)
    order = torch.tensor(_AWQ_UNPACK)

    def unpack(p: Tensor) -> Tensor:
        vals = _unpack(p, 4, 1).view(p.shape[0], p.shape[1], 8)
        return vals[:, :, order].reshape(p.shape[0], p.shape[1] * 8)

    g = torch.arange(in_features) // group
    w = (unpack(qweight) - unpack(qzeros)[g]).to(torch.float32) * scales.to(torch.float32)[g]
    return w.t().contiguous()


def dequantize_fp8(name: str, weight: Tensor, scale: Tensor, block: tuple[int, int] | None) -> Tensor:
    """float32 [out, in] = weight * scale: one scale, one per output row ([out] or [out, 1]), or one per
    `block` tile ([ceil(out/bo), ceil(in/bi)], `weight_scale_inv` as the block-FP8 checkpoints name it)."""
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    out_features, in_features = w.shape
    if s.numel() == 1:
        return w * s.reshape(())
    if s.numel() == out_features and block is None:
        return w * s.reshape(out_features, 1)
    if block is not None:
        bo, bi = block
        _check(f"{name} scale", s, (-(-out_features // bo), -(-in_features // bi)))
        full = s.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:out_features, :in_features]
        return w * full
    raise ValueError(
        f"{name}: a weight scale of shape {tuple(s.shape)} fits neither per-tensor nor per-channel"
    )


def gptq_as_gguf(name: str, parts: dict[str, Tensor], cfg: QuantConfig) -> GGUFWeight | None:
    """The layer as Q4_0 (4-bit) or Q8_0 (8-bit) blocks when that is exact (module docstring), else None."""
    if cfg.bits not in (4, 8) or parts["scales"].dtype != torch.float16:
        return None
    q, zeros, scales, g_idx = _gptq_ints(name, parts, cfg)
    in_features, out_features = q.shape
    mid = 1 << (cfg.bits - 1)
    if in_features % 32 or not bool((zeros == mid).all()):
        return None
    group = in_features if cfg.group_size == -1 else cfg.group_size
    if group % 32 or not torch.equal(g_idx, torch.arange(in_features) // group):
        return None
    nb = in_features // 32
    d = scales[g_idx[::32]].t().contiguous().numpy().view(np.uint8).reshape(out_features, nb, 2)
    qt = q.t().contiguous().numpy().reshape(out_features, nb, 32)
    if cfg.bits == 4:
        body = (qt[..., :16] | (qt[..., 16:] << 4)).astype(np.uint8)
        ggml_type = _Q4_0
    else:
        body = (qt - mid).astype(np.int8).view(np.uint8)
        ggml_type = _Q8_0
    data = np.concatenate([d, body], axis=2).reshape(out_features, -1)
    return GGUFWeight(ggml_type, (out_features, in_features), np.ascontiguousarray(data))
