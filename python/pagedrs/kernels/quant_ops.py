"""Launch wrappers for cuda/quant_ops.cu: GPTQ and AWQ integer weights dequantized on the GPU into the
transposed dense weight Wt [in, out], so a layer keeps the packed weights in GPU memory and computes
x @ Wt (torch.mm) from a scratch buffer.

The values are the loader's (`pagedrs.quantization.dequant.dequantize_gptq` / `dequantize_awq`, which
return W = Wt.t()): scale * (q - zero), the difference taken in integers and the product in float32, then
rounded once to the output dtype. A float32 result equals the loader's exactly; a 16-bit one is the loader's
rounded to that dtype.

Every tensor must be contiguous and on one device (a tensor-parallel shard: `.contiguous()` it at load).
Packed tensors are int32; scales float16, bfloat16 or float32; the output is float16, bfloat16 or float32
(by default the scales' dtype), independently of the scales. Group ids (`g_idx`) are not range-checked on
the device (that would synchronize): the loader checks them.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from pagedrs.kernels._launch import Launch, launch, ptr
from pagedrs.kernels._loader import CTYPES, quant_op_names

__all__ = ["GPTQ_BITS", "dequantize_awq", "dequantize_gptq"]

_SOURCE = "quant_ops"
GPTQ_BITS = (2, 4, 8)  # the bit widths of dequantize_gptq (and of quant_op_names' instantiations)
_AWQ_PACK = 8  # 4-bit values per AWQ word
_MAX_GRID_Y = 65535
_THREADS = 256


def _ctype(dtype: torch.dtype, what: str) -> str:
    ctype = CTYPES.get(str(dtype).removeprefix("torch."))
    if ctype is None:
        raise ValueError(f"{what} must be float16, bfloat16 or float32, got {dtype}")
    return ctype


def _check(
    name: str, t: Tensor, dtype: torch.dtype | None, shape: tuple[int, ...], device: torch.device
) -> None:
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must be {list(shape)}, got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def _packed(name: str, t: Tensor) -> None:
    if t.dtype != torch.int32 or t.dim() != 2:
        raise ValueError(f"{name} must be a 2-d int32 tensor, got {t.dim()}-d {t.dtype}")


def _scales(scales: Tensor) -> str:
    ctype = _ctype(scales.dtype, "scales")
    if scales.dim() != 2 or scales.shape[0] < 1:
        raise ValueError(f"scales must be [groups >= 1, out_features], got {list(scales.shape)}")
    return ctype


def _output(
    out: Tensor | None, dtype: torch.dtype | None, scales: Tensor, shape: tuple[int, int], *, align: int
) -> Tensor:
    """`out` checked (or a new tensor): [in, out] of `dtype`, else of the scales' dtype."""
    if dtype is not None:
        _ctype(dtype, "dtype")
    if out is None:
        return torch.empty(shape, dtype=dtype or scales.dtype, device=scales.device)
    if dtype is not None and out.dtype != dtype:
        raise ValueError(f"out is {out.dtype} but dtype={dtype}")
    _ctype(out.dtype, "out")
    _check("out", out, None, shape, scales.device)
    if out.data_ptr() % align:
        raise ValueError(f"out must be {align}-byte aligned, got address {out.data_ptr():#x}")
    return out


def _launch(
    ctype: str, kernel: str, grid: tuple[int, int], threads: int, args: tuple, device: torch.device
) -> None:
    """Launch `pagedrs::{kernel}` (template arguments included) from the output dtype's quant_ops module."""
    spec = Launch(_SOURCE, quant_op_names(ctype), f"pagedrs::{kernel}", (*grid, 1), (threads, 1, 1), 0, args)
    launch(spec, device)


def _threads(work: int) -> int:
    return max(32, min(_THREADS, -(-work // 32) * 32))


def dequantize_gptq(
    qweight: Tensor,
    qzeros: Tensor,
    scales: Tensor,
    g_idx: Tensor,
    *,
    bits: int,
    zero_plus_one: bool,
    dtype: torch.dtype | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Wt [in, out] (in `out` if given, else a new tensor of `dtype`, default scales.dtype) of a GPTQ layer.

    qweight int32 [in / (32/bits), out] packed along the input dim; qzeros int32 [groups,
    ceil(out / (32/bits))] packed along the output dim, zero = stored + 1 when `zero_plus_one` (AutoGPTQ's
    v1 format) else stored (GPTQModel's v2); scales [groups, out]; g_idx int32 [in], each input row's group
    (act-order included). Wt[r, c] = scales[g, c] * (q[r, c] - zero[g, c]) with g = g_idx[r]."""
    if bits not in GPTQ_BITS:
        raise ValueError(f"bits must be one of {GPTQ_BITS}, got {bits}")
    _packed("qweight", qweight)
    scale_ctype = _scales(scales)
    per_word = 32 // bits
    device = scales.device
    in_words, out_features = qweight.shape
    in_features, groups = in_words * per_word, scales.shape[0]
    _check("qweight", qweight, torch.int32, (in_words, out_features), device)
    _check("scales", scales, None, (groups, out_features), device)
    _check("qzeros", qzeros, torch.int32, (groups, -(-out_features // per_word)), device)
    _check("g_idx", g_idx, torch.int32, (in_features,), device)
    wt = _output(out, dtype, scales, (in_features, out_features), align=1)
    ctype = _ctype(wt.dtype, "out")
    if in_words == 0 or out_features == 0:
        return wt
    threads = _threads(out_features)
    _launch(
        ctype,
        f"dequantize_gptq<{ctype}, {scale_ctype}, {bits}>",
        (-(-out_features // threads), min(in_words, _MAX_GRID_Y)),
        threads,
        (
            ptr(wt),
            ptr(qweight),
            ptr(qzeros),
            ptr(scales),
            ptr(g_idx),
            np.int32(in_words),
            np.int32(out_features),
            np.int32(1 if zero_plus_one else 0),
        ),
        device,
    )
    return wt


def dequantize_awq(
    qweight: Tensor,
    qzeros: Tensor,
    scales: Tensor,
    *,
    group_size: int,
    dtype: torch.dtype | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Wt [in, out] (in `out` if given: 16-byte aligned; else a new tensor of `dtype`, default
    scales.dtype) of a 4-bit AWQ layer in AutoAWQ's GEMM layout.

    qweight int32 [in, out / 8] and qzeros int32 [groups, out / 8], packed along the output dim (nibble i
    of a word holds column AWQ_PACK_ORDER[i] of its 8); scales [groups, out]; input row r is in group
    r // group_size (group_size -1: one group). Wt[r, c] = scales[g, c] * (q[r, c] - zero[g, c])."""
    if group_size == 0 or group_size < -1:
        raise ValueError(f"group_size must be -1 or > 0, got {group_size}")
    _packed("qweight", qweight)
    scale_ctype = _scales(scales)
    device = scales.device
    in_features, out_words = qweight.shape
    out_features = out_words * _AWQ_PACK
    group = group_size if group_size > 0 else max(in_features, 1)
    groups = max(1, -(-in_features // group))
    _check("qweight", qweight, torch.int32, (in_features, out_words), device)
    _check("scales", scales, None, (groups, out_features), device)
    _check("qzeros", qzeros, torch.int32, (groups, out_words), device)
    wt = _output(out, dtype, scales, (in_features, out_features), align=16)
    ctype = _ctype(wt.dtype, "out")
    if in_features == 0 or out_words == 0:
        return wt
    threads = _threads(out_words)
    _launch(
        ctype,
        f"dequantize_awq<{ctype}, {scale_ctype}>",
        (-(-out_words // threads), min(in_features, _MAX_GRID_Y)),
        threads,
        (
            ptr(wt),
            ptr(qweight),
            ptr(qzeros),
            ptr(scales),
            np.int32(in_features),
            np.int32(out_words),
            np.int32(group),
        ),
        device,
    )
    return wt
