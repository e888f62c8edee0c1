"""Launch wrappers for cuda/lora_ops.cu: LoRA deltas of a batch that mixes adapters, punica's BGMV pair.

`lora_shrink` computes each row's `x A[slot]^T` (float32), `lora_expand` adds `s Bt[slot]` to the row's
output columns (each rank row only into its own column range), `lora_add` does both. A and Bt hold every
slot's pair over all slices of one module (`pagedrs.lora.layers`); a row of slot -1 is the base model's,
left alone. x, A, Bt and out share one dtype (float16, bfloat16 or float32); the sums are fp32 and each
output element is rounded once. The torch code in pagedrs.lora.layers is the CPU path and the oracle these
are tested against (on the CPU emulator in tests/kernels).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from pagedrs.kernels._launch import Launch, launch, ptr, same_device, vector_access
from pagedrs.kernels._loader import CTYPES, lora_op_names

__all__ = ["lora_add", "lora_expand", "lora_shrink"]

_SOURCE = "lora_ops"
_SHRINK_WARPS = 4  # rank rows per shrink CTA, one warp each
_EXPAND_THREADS = 128  # most threads per expand CTA (each owns VEC adjacent columns)


def _ctype(t: Tensor, what: str) -> str:
    ctype = CTYPES.get(str(t.dtype).removeprefix("torch."))
    if ctype is None:
        raise ValueError(f"{what} must be float16, bfloat16 or float32, got {t.dtype}")
    return ctype


def _rows(t: Tensor, what: str) -> None:
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{what} must be 2-d [rows, n] with a contiguous last dim, got {tuple(t.shape)}")


def _stacked(t: Tensor, what: str, dtype: torch.dtype, last: int | None = None) -> None:
    """t: contiguous [slots, rank, last] in `dtype`."""
    if t.dim() != 3 or not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous [slots, rank, n], got {tuple(t.shape)} {t.stride()}")
    if t.dtype != dtype:
        raise ValueError(f"{what} dtype {t.dtype} != {dtype}")
    if last is not None and t.shape[2] != last:
        raise ValueError(f"{what} must have {last} as its last dim, got {tuple(t.shape)}")


def _check_slots(slot_of_row: Tensor, rows: int) -> None:
    if slot_of_row.dtype != torch.int32 or slot_of_row.shape != (rows,) or not slot_of_row.is_contiguous():
        raise ValueError(
            f"slot_of_row must be contiguous int32 [{rows}], got {slot_of_row.dtype} {tuple(slot_of_row.shape)}"
        )


def _launch(
    ctype: str, kernel: str, grid: tuple[int, int], threads: int, smem: int, args: tuple, device: torch.device
) -> None:
    spec = Launch(
        _SOURCE, lora_op_names(ctype), f"pagedrs::{kernel}", (*grid, 1), (threads, 1, 1), smem, args
    )
    launch(spec, device)


def lora_shrink(x: Tensor, a: Tensor, slot_of_row: Tensor) -> Tensor:
    """s [rows, rank] float32 (a new tensor), s[i] = A[slot_of_row[i]] @ x[i]. x [rows, in]; A [slots,
    rank, in] in x's dtype; slot_of_row int32 [rows]. The rows of slot -1 are left unwritten (their values
    are undefined); slots must lie in -1..slots-1 (not checked on the device: that would synchronize; a
    slot past them is skipped like -1)."""
    ctype = _ctype(x, "x")
    _rows(x, "x")
    rows, width_in = x.shape
    _stacked(a, "a", x.dtype, width_in)
    _check_slots(slot_of_row, rows)
    same_device(x.device, a=a, slot_of_row=slot_of_row)
    num_slots, rank, _ = a.shape
    s = torch.empty((rows, rank), dtype=torch.float32, device=x.device)
    if rows == 0 or rank == 0 or num_slots == 0:
        return s
    vec = vector_access(ctype, x.element_size(), elements=(width_in, x.stride(0)), tensors=(x, a))
    _launch(
        ctype,
        f"lora_shrink<{ctype}, {vec}>",
        (rows, -(-rank // _SHRINK_WARPS)),
        32 * _SHRINK_WARPS,
        0,
        (
            ptr(s),
            ptr(x),
            ptr(a),
            ptr(slot_of_row),
            np.int64(x.stride(0)),
            np.int32(width_in),
            np.int32(rank),
            np.int32(num_slots),
        ),
        x.device,
    )
    return s


def lora_expand(s: Tensor, bt: Tensor, slot_of_row: Tensor, cols: Tensor, out: Tensor, first: int) -> None:
    """In place: out[i, first + c] += sum of s[i, k] * Bt[slot_of_row[i], k, c] over the rank rows k with
    cols[k, 0] <= c < cols[k, 1], each element rounded to out's dtype once; rows of slot -1 unchanged.
    s float32 [rows, rank] contiguous; Bt [slots, rank, width] contiguous (B^T, scaling folded in) in
    out's dtype; cols int32 [rank, 2] contiguous (a range outside 0..width only reaches its columns inside
    it); out [rows, >= first + width] with a contiguous last dim."""
    ctype = _ctype(out, "out")
    _rows(out, "out")
    _stacked(bt, "bt", out.dtype)
    num_slots, rank, width = bt.shape
    rows = out.shape[0]
    if s.dtype != torch.float32 or s.shape != (rows, rank) or not s.is_contiguous():
        raise ValueError(f"s must be contiguous float32 [{rows}, {rank}], got {s.dtype} {tuple(s.shape)}")
    if cols.dtype != torch.int32 or cols.shape != (rank, 2) or not cols.is_contiguous():
        raise ValueError(f"cols must be contiguous int32 [{rank}, 2], got {cols.dtype} {tuple(cols.shape)}")
    if first < 0 or first + width > out.shape[1]:
        raise ValueError(f"columns {first}..{first + width} are outside out's {out.shape[1]}")
    _check_slots(slot_of_row, rows)
    same_device(out.device, s=s, bt=bt, slot_of_row=slot_of_row, cols=cols)
    if rows == 0 or rank == 0 or width == 0 or num_slots == 0:
        return
    vec = vector_access(ctype, out.element_size(), elements=(width, first, out.stride(0)), tensors=(out, bt))
    nvec = width // vec
    threads = max(32, min(_EXPAND_THREADS, -(-nvec // 32) * 32))
    _launch(
        ctype,
        f"lora_expand<{ctype}, {vec}>",
        (rows, -(-nvec // threads)),
        threads,
        rank * 3 * 4,  # the row's s (floats) and cols (int pairs)
        (
            ptr(out),
            ptr(s),
            ptr(bt),
            ptr(slot_of_row),
            ptr(cols),
            np.int64(out.stride(0)),
            np.int32(first),
            np.int32(width),
            np.int32(rank),
            np.int32(num_slots),
        ),
        out.device,
    )


def lora_add(
    x: Tensor, a: Tensor, bt: Tensor, slot_of_row: Tensor, cols: Tensor, out: Tensor, first: int
) -> None:
    """In place: every row's LoRA delta of its slot, out[i, first:first + width] += (A[s] x[i]) Bt[s]
    (each rank row k only into its columns cols[k]); rows of slot -1 unchanged. The two launches of
    `lora_shrink` and `lora_expand` (see them for the shapes); A and Bt have the same slots and rank."""
    if a.dim() != 3 or bt.dim() != 3 or a.shape[:2] != bt.shape[:2]:
        raise ValueError(f"a {tuple(a.shape)} and bt {tuple(bt.shape)} must be [slots, rank, n] alike")
    if out.dtype != x.dtype:
        raise ValueError(f"out dtype {out.dtype} != x dtype {x.dtype}")
    if out.shape[0] != x.shape[0]:
        raise ValueError(f"out has {out.shape[0]} rows, x {x.shape[0]}")
    lora_expand(lora_shrink(x, a, slot_of_row), bt, slot_of_row, cols, out, first)
