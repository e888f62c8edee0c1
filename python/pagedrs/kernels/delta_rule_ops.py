"""Launch wrapper for cuda/delta_rule.cu: the decode step of a Gated DeltaNet layer (Qwen3.5 / Qwen3.6 linear
attention), one token per sequence, in place on the sequences' state slots.

`gated_delta_decode` runs the causal conv1d update (each slot's window of the last K - 1 inputs) and one
step of the gated delta rule (each slot's per-head state [Dk, Dv]), as `pagedrs.layers.delta_rule`'s
`causal_conv1d_update` and `recurrent_gated_delta_rule` do in torch (the CPU path, and the oracle these are
tested against on the CPU emulator in tests/kernels). States are float32; activations and weights float16,
bfloat16 or float32.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from pagedrs.kernels._launch import Launch, launch, ptr, same_device
from pagedrs.kernels._loader import CTYPES, delta_rule_names

__all__ = ["MAX_KEY_HEAD_DIM", "gated_delta_decode"]

_SOURCE = "delta_rule"
_THREADS = 128
MAX_KEY_HEAD_DIM = 256  # q and k of a head in shared memory (Qwen3.5/3.6: 128)


def _check_rows(t: Tensor, what: str, rows: int, width: int) -> None:
    if t.dim() != 2 or t.shape != (rows, width) or (width > 1 and t.stride(1) != 1):
        raise ValueError(f"{what} must be [{rows}, {width}] with a contiguous last dim, got {tuple(t.shape)}")


def gated_delta_decode(
    qkv: Tensor,
    a: Tensor,
    b: Tensor,
    conv_weight: Tensor,
    dt_bias: Tensor,
    a_log: Tensor,
    conv_state: Tensor,
    ssm_state: Tensor,
    slots: Tensor,
    num_k_heads: int,
) -> Tensor:
    """One token of each of B sequences -> the delta rule's output [B, Hv * Dv] in qkv's dtype (before the
    gated norm). qkv [B, C] (C = 2 Hk Dk + Hv Dv: q, k, v before the conv); a, b [B, Hv] (the decay and
    write-strength projections); conv_weight [C, K]; dt_bias, a_log [Hv]; conv_state float32 contiguous
    [slots, C, K - 1] and ssm_state float32 contiguous [slots, Hv, Dk, Dv], both updated in place at
    `slots` (int32 [B]; a row of slot -1 is skipped and its output left undefined)."""
    dtype = qkv.dtype
    ctype = CTYPES.get(str(dtype).removeprefix("torch."))
    if ctype is None:
        raise ValueError(f"qkv must be float16, bfloat16 or float32, got {dtype}")
    if ssm_state.dim() != 4 or conv_state.dim() != 3:
        raise ValueError(
            f"conv_state must be [slots, C, K - 1] and ssm_state [slots, Hv, Dk, Dv], got "
            f"{tuple(conv_state.shape)} and {tuple(ssm_state.shape)}"
        )
    for name, t in (("conv_state", conv_state), ("ssm_state", ssm_state)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32, got {t.dtype} {tuple(t.stride())}")
    _, num_v_heads, dk, dv = ssm_state.shape
    channels, kernel = conv_weight.shape
    rows = qkv.shape[0]
    if num_k_heads <= 0 or num_v_heads % num_k_heads:
        raise ValueError(f"value heads {num_v_heads} must be a multiple of key heads {num_k_heads}")
    if dk > MAX_KEY_HEAD_DIM:
        raise ValueError(f"key head dim {dk} exceeds the kernel's {MAX_KEY_HEAD_DIM}")
    if channels != 2 * num_k_heads * dk + num_v_heads * dv or conv_state.shape[1:] != (channels, kernel - 1):
        raise ValueError(
            f"conv_weight {tuple(conv_weight.shape)} and conv_state {tuple(conv_state.shape)} do not fit "
            f"{num_k_heads} key heads of {dk} and {num_v_heads} value heads of {dv}"
        )
    _check_rows(qkv, "qkv", rows, channels)
    _check_rows(a, "a", rows, num_v_heads)
    _check_rows(b, "b", rows, num_v_heads)
    if a.stride(0) != b.stride(0):
        raise ValueError(f"a and b must share a row stride, got {a.stride(0)} and {b.stride(0)}")
    for name, t in (("a", a), ("b", b), ("conv_weight", conv_weight), ("dt_bias", dt_bias), ("a_log", a_log)):
        if t.dtype != dtype:
            raise ValueError(f"{name} dtype {t.dtype} != qkv's {dtype}")
    if not all(t.is_contiguous() for t in (conv_weight, dt_bias, a_log)) or not (
        dt_bias.shape == a_log.shape == (num_v_heads,)
    ):
        raise ValueError("conv_weight, dt_bias and a_log must be contiguous; dt_bias and a_log [value heads]")
    if slots.dtype != torch.int32 or slots.shape != (rows,) or not slots.is_contiguous():
        raise ValueError(f"slots must be contiguous int32 [{rows}], got {slots.dtype} {tuple(slots.shape)}")
    device = qkv.device
    same_device(
        device, a=a, b=b, conv_weight=conv_weight, conv_state=conv_state, ssm_state=ssm_state, slots=slots
    )
    out = torch.empty((rows, num_v_heads * dv), dtype=dtype, device=device)
    if rows == 0:
        return out
    mixed = torch.empty((rows, channels), dtype=torch.float32, device=device)
    names = delta_rule_names(ctype)
    conv_args: tuple[np.generic, ...] = (ptr(mixed), ptr(conv_state), ptr(qkv), ptr(conv_weight), ptr(slots))
    conv_args += (np.int64(qkv.stride(0)), np.int32(channels), np.int32(kernel))
    grid = (rows, -(-channels // _THREADS), 1)
    launch(Launch(_SOURCE, names, names[0], grid, (_THREADS, 1, 1), 0, conv_args), device)
    rec_args: tuple[np.generic, ...] = (ptr(out), ptr(ssm_state), ptr(mixed), ptr(a), ptr(b), ptr(dt_bias))
    rec_args += (ptr(a_log), ptr(slots), np.int64(a.stride(0)), np.int32(num_k_heads))
    rec_args += (np.int32(num_v_heads), np.int32(dk), np.int32(dv))
    smem = (2 * dk + 32) * 4
    launch(Launch(_SOURCE, names, names[1], (rows, num_v_heads, 1), (_THREADS, 1, 1), smem, rec_args), device)
    return out
