"""Launch wrappers for cuda/layer_ops.cu: RMSNorm (alone, or with the residual add in place), rotary
embedding in place on q and k, and the gated activations (SiLU / GELU of the gate times up).

Each takes 2-d activations [tokens, features] whose last dim is contiguous (any token stride, so views of a
fused projection work) in float16, bfloat16 or float32. Accesses are 16-byte vectors when every row size,
stride and address allows it, scalar otherwise. The torch code in pagedrs.layers is the CPU path and the
oracle these are tested against (on a GPU, and on the CPU emulator in tests/kernels).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from pagedrs.kernels._launch import Launch, launch, ptr, same_device, vector_access
from pagedrs.kernels._loader import ACTIVATIONS, CTYPES, layer_op_names

__all__ = ["act_and_mul", "fused_add_rms_norm", "rms_norm", "rotary_embedding"]

_SOURCE = "layer_ops"
_NORM_SMEM = 32 * 4  # block_sum's 32 floats


def _ctype(t: Tensor, what: str) -> str:
    ctype = CTYPES.get(str(t.dtype).removeprefix("torch."))
    if ctype is None:
        raise ValueError(f"{what} must be float16, bfloat16 or float32, got {t.dtype}")
    return ctype


def _rows(t: Tensor, what: str, width: int | None = None) -> None:
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{what} must be 2-d [tokens, n] with a contiguous last dim, got {tuple(t.shape)}")
    if width is not None and t.shape[1] != width:
        raise ValueError(f"{what} must have {width} columns, got {t.shape[1]}")


def _threads(work: int, cap: int) -> int:
    return max(32, min(cap, -(-work // 32) * 32))


def _launch(
    ctype: str, kernel: str, grid: tuple[int, int], threads: int, smem: int, args: tuple, device: torch.device
) -> None:
    """Launch `pagedrs::{kernel}` (template arguments included) from the dtype's layer_ops module."""
    spec = Launch(
        _SOURCE, layer_op_names(ctype), f"pagedrs::{kernel}", (*grid, 1), (threads, 1, 1), smem, args
    )
    launch(spec, device)


def _norm_checks(x: Tensor, weight: Tensor, what: str) -> str:
    ctype = _ctype(x, what)
    _rows(x, what)
    if weight.dim() != 1 or weight.shape[0] != x.shape[1] or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{x.shape[1]}], got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} != {what} dtype {x.dtype}")
    same_device(x.device, weight=weight)
    return ctype


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * round(x * rsqrt(mean(x^2) + eps)) per row of x [T, hidden] -> a new [T, hidden] tensor."""
    ctype = _norm_checks(x, weight, "x")
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    vec = vector_access(ctype, x.element_size(), elements=(hidden, x.stride(0)), tensors=(x, weight, out))
    _launch(
        ctype,
        f"rms_norm<{ctype}, {vec}>",
        (num_tokens, 1),
        _threads(hidden // vec, 1024),
        _NORM_SMEM,
        (ptr(out), ptr(x), ptr(weight), np.int64(x.stride(0)), np.int32(hidden), np.float32(eps)),
        x.device,
    )
    return out


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    """In place, per row: residual = x + residual (rounded to the dtype), x = rms_norm(residual)."""
    ctype = _norm_checks(x, weight, "x")
    _rows(residual, "residual", x.shape[1])
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual {residual.dtype} {tuple(residual.shape)} must match x {x.dtype} {tuple(x.shape)}"
        )
    same_device(x.device, residual=residual)
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return
    vec = vector_access(
        ctype,
        x.element_size(),
        elements=(hidden, x.stride(0), residual.stride(0)),
        tensors=(x, residual, weight),
    )
    _launch(
        ctype,
        f"fused_add_rms_norm<{ctype}, {vec}>",
        (num_tokens, 1),
        _threads(hidden // vec, 1024),
        _NORM_SMEM,
        (
            ptr(x),
            ptr(residual),
            ptr(weight),
            np.int64(x.stride(0)),
            np.int64(residual.stride(0)),
            np.int32(hidden),
            np.float32(eps),
        ),
        x.device,
    )


def _check_cache(cache: Tensor, what: str, rotary_dim: int, device: torch.device) -> None:
    if cache.dtype != torch.float32 or cache.dim() != 2 or cache.shape[1] != rotary_dim:
        raise ValueError(
            f"{what} must be float32 [max_position, {rotary_dim}], got {cache.dtype} {tuple(cache.shape)}"
        )
    if not cache.is_contiguous() or cache.device != device:
        raise ValueError(f"{what} must be contiguous and on {device}")


def rotary_embedding(
    positions: Tensor,
    q: Tensor,
    k: Tensor,
    head_size: int,
    cos_sin_cache: Tensor,
    *,
    is_neox: bool = True,
    long_cos_sin_cache: Tensor | None = None,
    seq_lens: Tensor | None = None,
    long_threshold: int = 0,
) -> None:
    """Rotate q [T, H*head_size] and k [T, KVH*head_size] in place at positions [T] (int64).

    cos_sin_cache [max_position, rotary_dim] float32 (cos | sin per position; rotary_dim <= head_size:
    the dims past it stay). is_neox: rotate halves, else (GPT-J) interleaved pairs. With
    long_cos_sin_cache (longrope), token t uses it when seq_lens[t] (int64) > long_threshold. Positions
    must lie inside the caches (not checked on the device: that would synchronize). Long because of the
    argument checks of its two cache layouts, before one launch."""
    ctype = _ctype(q, "q")
    _rows(q, "q")
    _rows(k, "k")
    num_tokens = q.shape[0]
    if k.dtype != q.dtype or k.shape[0] != num_tokens:
        raise ValueError(f"k {k.dtype} {tuple(k.shape)} does not match q {q.dtype} {tuple(q.shape)}")
    if head_size <= 0 or q.shape[1] % head_size or k.shape[1] % head_size:
        raise ValueError(f"q/k widths {q.shape[1]}/{k.shape[1]} are not multiples of head_size={head_size}")
    rotary_dim = cos_sin_cache.shape[-1] if cos_sin_cache.dim() == 2 else -1
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_size:
        raise ValueError(f"rotary dim {rotary_dim} must be even and at most head_size={head_size}")
    _check_cache(cos_sin_cache, "cos_sin_cache", rotary_dim, q.device)
    if positions.dtype != torch.int64 or positions.shape != (num_tokens,) or not positions.is_contiguous():
        raise ValueError(
            f"positions must be contiguous int64 [{num_tokens}], got {positions.dtype} {tuple(positions.shape)}"
        )
    same_device(q.device, k=k, positions=positions)
    long_ptr = seq_ptr = np.uint64(0)
    if long_cos_sin_cache is not None:
        _check_cache(long_cos_sin_cache, "long_cos_sin_cache", rotary_dim, q.device)
        if seq_lens is None or seq_lens.dtype != torch.int64 or seq_lens.shape != (num_tokens,):
            raise ValueError(f"long_cos_sin_cache needs seq_lens int64 [{num_tokens}]")
        if seq_lens.device != q.device or not seq_lens.is_contiguous():
            raise ValueError(f"seq_lens must be contiguous and on {q.device}")
        long_ptr, seq_ptr = ptr(long_cos_sin_cache), ptr(seq_lens)
    if num_tokens == 0:
        return
    num_heads, num_kv_heads = q.shape[1] // head_size, k.shape[1] // head_size
    _launch(
        ctype,
        f"rotary_embedding<{ctype}, {'true' if is_neox else 'false'}>",
        (num_tokens, 1),
        _threads((num_heads + num_kv_heads) * rotary_dim // 2, 512),
        0,
        (
            ptr(q),
            ptr(k),
            ptr(positions),
            ptr(cos_sin_cache),
            long_ptr,
            seq_ptr,
            np.int64(long_threshold),
            np.int64(q.stride(0)),
            np.int64(k.stride(0)),
            np.int32(num_heads),
            np.int32(num_kv_heads),
            np.int32(head_size),
            np.int32(rotary_dim),
        ),
        q.device,
    )


def act_and_mul(x: Tensor, activation: str) -> Tensor:
    """x [T, 2d] = [gate | up] -> act(gate) * up [T, d] (new tensor); activation: silu, gelu, gelu_tanh."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    ctype = _ctype(x, "x")
    _rows(x, "x")
    num_tokens, width = x.shape
    if width % 2:
        raise ValueError(f"x must have an even number of columns [gate | up], got {width}")
    d = width // 2
    out = torch.empty((num_tokens, d), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or d == 0:
        return out
    vec = vector_access(ctype, x.element_size(), elements=(d, x.stride(0)), tensors=(x, out))
    threads = _threads(d // vec, 1024)
    _launch(
        ctype,
        f"act_and_mul<{ctype}, {vec}, {ACTIVATIONS[activation]}>",
        (num_tokens, -(-(d // vec) // threads)),
        threads,
        0,
        (ptr(out), ptr(x), np.int64(x.stride(0)), np.int32(d)),
        x.device,
    )
    return out
