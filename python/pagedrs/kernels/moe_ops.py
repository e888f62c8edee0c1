"""Launch wrappers for cuda/moe_ops.cu: the fused experts step of a mixture-of-experts layer on the GPU
(vLLM's `fused_moe`): the (token, slot) pairs sorted by expert on the device (`moe_align`, no host
synchronization, so a CUDA graph can capture the step), then one grouped GEMM for every expert's gate/up
rows with the activation, one for the down rows with the routing weight, and a per-token sum of the top-k
results (no atomics).

Weights are stacked per expert, `gate_up` [E, 2I, H] (gate rows then up rows) and `down` [E, H, I], in one
of the forms of `ExpertMatrix`: dense (the activations' dtype), GGUF Q8_0 blocks, or fp8 e4m3 with
float32 scales per output row or per 2-D block (the block-FP8 checkpoints' 128 x 128, as vLLM's fused_moe
`block_shape`); quantized forms are dequantized in the kernel's tile as they are read.
Activations, biases and routing weights are float16, bfloat16 or float32 (one dtype); products accumulate
in float32; gate/up and each expert's output are rounded to the dtype as torch's per-expert linear layers
round them. Expert ids must be in [0, E): routing produces them and they are not checked on the device
(that would synchronize).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from pagedrs.kernels._launch import Launch, launch, ptr
from pagedrs.kernels._loader import (
    CTYPES,
    MOE_ACTIVATIONS,
    MOE_BLOCK_MS,
    MOE_WEIGHT_FORMS,
    moe_op_names,
)

__all__ = [
    "MOE_ACTIVATIONS",
    "Q8_0_BLOCK_BYTES",
    "ExpertMatrix",
    "align_by_expert",
    "fused_experts",
    "pick_block_m",
    "tensor_cores",
]

_SOURCE = "moe_ops"
_BK, _BN, _THREADS = 32, 64, 256  # the kernels' k step, half tile and CTA size
Q8_0_BLOCK_BYTES = 34  # GGUF Q8_0: an fp16 scale and 32 int8 values per 32 columns
_MAX_ALIGN_THREADS = 1024


@dataclass(frozen=True, slots=True)
class ExpertMatrix:
    """E stacked weights [E, rows, cols] in one of the kernel's forms:

    - "dense": `data` [E, rows, cols] in the activations' dtype;
    - "q8_0": `data` uint8 [E, rows, cols / 32 * 34], each row its GGUF Q8_0 blocks in file order;
    - "fp8": `data` float8_e4m3fn [E, rows, cols] and `scale` float32 (w = fp8 * scale): [E, rows], one per
      output row, or with `block` (br, bc) [E, rows / br, ceil(cols / bc)], one per block of br rows and
      bc columns (rows % br == 0: each expert's rows are whole blocks)."""

    data: Tensor
    form: str = "dense"
    scale: Tensor | None = None
    cols: int = 0  # columns (needed for q8_0, whose data is in bytes); 0: data.shape[2]
    block: tuple[int, int] | None = None  # fp8: the scale's (rows, cols) block; None: one per row

    @property
    def shape(self) -> tuple[int, int, int]:
        e, rows, last = self.data.shape
        return e, rows, self.cols or last

    @property
    def nbytes(self) -> int:
        """Bytes of the weight and its scales."""
        scale = 0 if self.scale is None else self.scale.numel() * self.scale.element_size()
        return self.data.numel() * self.data.element_size() + scale

    def check(self, what: str, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device) -> None:
        """ValueError naming `what` unless this is a contiguous [E, rows, cols] = `shape` weight on `device`
        of a form the kernels take."""
        if self.form not in MOE_WEIGHT_FORMS:
            raise ValueError(f"{what}: form must be one of {sorted(MOE_WEIGHT_FORMS)}, got {self.form!r}")
        d = self.data
        if d.dim() != 3 or not d.is_contiguous() or d.device != device:
            raise ValueError(
                f"{what} must be a contiguous 3-d tensor on {device}, got {d.dim()}-d on {d.device}"
            )
        if self.shape != shape:
            raise ValueError(f"{what} must be {list(shape)}, got {list(self.shape)}")
        e, rows, cols = shape
        if self.form == "dense" and d.dtype != dtype:
            raise ValueError(f"{what} (dense) must be {dtype} like the activations, got {d.dtype}")
        if self.form == "q8_0":
            if cols % 32 or d.dtype != torch.uint8 or d.shape[2] != cols // 32 * Q8_0_BLOCK_BYTES:
                raise ValueError(
                    f"{what} (q8_0) must be uint8 [E, rows, cols / 32 * 34] with cols % 32 == 0, "
                    f"got {d.dtype} {list(d.shape)} for {cols} columns"
                )
        if self.form == "fp8":
            self._check_fp8(what, device)

    def scale_shape(self) -> tuple[int, ...]:
        """The fp8 scale's shape: [E, rows], or [E, rows / br, ceil(cols / bc)] with `block`."""
        e, rows, cols = self.shape
        if self.block is None:
            return e, rows
        br, bc = self.block
        return e, rows // br, -(-cols // bc)

    def scale_block(self) -> tuple[int, int]:
        """(rows, cols) of one scale's block, as the kernels take them (per row: 1 x cols)."""
        return self.block if self.block is not None else (1, max(self.shape[2], 1))

    def _check_fp8(self, what: str, device: torch.device) -> None:
        d, s = self.data, self.scale
        if d.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{what} (fp8) must be float8_e4m3fn, got {d.dtype}")
        if self.block is not None:
            br, bc = self.block
            if br < 1 or bc < 1 or self.shape[1] % br:
                raise ValueError(
                    f"{what} (fp8): scale block {list(self.block)} must be positive and divide the "
                    f"{self.shape[1]} rows of each expert"
                )
        want = self.scale_shape()
        if s is None or s.dtype != torch.float32 or tuple(s.shape) != want or not s.is_contiguous():
            got = None if s is None else f"{s.dtype} {list(s.shape)}"
            raise ValueError(f"{what} (fp8) needs a contiguous float32 scale {list(want)}, got {got}")
        if s.device != device:
            raise ValueError(f"{what} scale is on {s.device}, expected {device}")


def _ctype(dtype: torch.dtype) -> str:
    ctype = CTYPES.get(str(dtype).removeprefix("torch."))
    if ctype is None:
        raise ValueError(f"activations must be float16, bfloat16 or float32, got {dtype}")
    return ctype


def _launch(
    ctype: str, kernel: str, grid: tuple[int, int], threads: int, smem: int, args: tuple, dev: torch.device
) -> None:
    spec = Launch(_SOURCE, moe_op_names(ctype), f"pagedrs::{kernel}", (*grid, 1), (threads, 1, 1), smem, args)
    launch(spec, dev)


def _smem(block_m: int, element_size: int, mma: bool) -> int:
    """MoeSmem<T, BM, MMA>::kBytes: the row ids, then the A and weight tiles (T rows of BK + 8 for the
    tensor cores, float rows of BK + 1 otherwise)."""
    row, elem = (_BK + 8, element_size) if mma else (_BK + 1, 4)
    return 4 * block_m + (block_m + 2 * _BN) * row * elem


def tensor_cores(x: Tensor) -> bool:
    """Whether the GEMMs take tensor cores for these activations: fp16/bf16 on sm_80 and newer (CPU
    tensors: the kernel emulator, which runs either)."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        return False
    return x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) >= (8, 0)


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """A bound on the row tiles of any routing of `num_pairs` pairs: sum_e ceil(count_e / block_m)."""
    return -(-num_pairs // block_m) + min(num_experts, num_pairs)


def align_by_expert(
    topk_ids: Tensor, num_experts: int, block_m: int, *, ctype: str = "float"
) -> tuple[Tensor, Tensor]:
    """(sorted_ids int32 [tiles * block_m], tile_expert int32 [tiles]) on the ids' device: the flat pair
    ids p (token p // k, slot p % k) grouped by expert in pair order, each expert's rows padded to a multiple
    of `block_m` with num_pairs, and each row tile's expert (-1 past the last; `tiles` is max_tiles' bound).
    vLLM's moe_align_block_size; `ctype` picks the dtype module the kernel is launched from."""
    if topk_ids.dtype != torch.int64 or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be contiguous int64, got {topk_ids.dtype}")
    if block_m not in MOE_BLOCK_MS:
        raise ValueError(f"block_m must be one of {MOE_BLOCK_MS}, got {block_m}")
    pairs = topk_ids.numel()
    tiles = max_tiles(pairs, num_experts, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(tiles * block_m, dtype=torch.int32, device=device)
    tile_expert = torch.empty(tiles, dtype=torch.int32, device=device)
    if tiles == 0:
        return sorted_ids, tile_expert
    threads = max(32, min(_MAX_ALIGN_THREADS, 32 * num_experts))
    args = (
        ptr(sorted_ids),
        ptr(tile_expert),
        ptr(topk_ids),
        np.int32(pairs),
        np.int32(num_experts),
        np.int32(block_m),
        np.int32(tiles),
    )
    _launch(ctype, "moe_align", (1, 1), threads, 4 * (2 * num_experts + 1), args, device)
    return sorted_ids, tile_expert


def _bias(name: str, b: Tensor | None, shape: tuple[int, int], x: Tensor) -> np.uint64:
    if b is None:
        return np.uint64(0)
    if b.dtype != x.dtype or tuple(b.shape) != shape or not b.is_contiguous() or b.device != x.device:
        raise ValueError(
            f"{name} must be a contiguous {x.dtype} {list(shape)} on {x.device}, "
            f"got {b.dtype} {list(b.shape)} on {b.device}"
        )
    return ptr(b)


def _scale(w: ExpertMatrix) -> np.uint64:
    return ptr(w.scale) if w.scale is not None and w.form == "fp8" else np.uint64(0)


def _scale_block(w: ExpertMatrix) -> tuple[np.int32, np.int32]:
    rows, cols = w.scale_block()
    return np.int32(rows), np.int32(cols)


def _vec(cols: int, a: Tensor, w: ExpertMatrix) -> bool:
    """Whether the tensor-core tiles may load 16-byte chunks: rows of 8-element multiples, A (and a dense
    weight) 16-byte aligned."""
    aligned = a.data_ptr() % 16 == 0 and (w.form != "dense" or w.data.data_ptr() % 16 == 0)
    return cols % 8 == 0 and aligned


def pick_block_m(num_pairs: int, num_experts: int) -> int:
    """Row tile: 16 while experts average under 32 rows (decode, small batches), else 64."""
    return 16 if num_pairs < 32 * num_experts else 64


def fused_experts(
    x: Tensor,
    gate_up: ExpertMatrix,
    down: ExpertMatrix,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    block_m: int | None = None,
    use_tensor_cores: bool | None = None,
) -> Tensor:
    """sum over each token's k experts of weight * down(act(gate(x), up(x))) + biases: [T, H] like x.

    x [T, H]; gate_up [E, 2I, H], down [E, H, I] (`ExpertMatrix`); topk_weights [T, k] (any float dtype,
    taken in x's); topk_ids [T, k] int64 in [0, E). activation: "silu" (SwiGLU), "gelu" / "gelu_tanh"
    (GeGLU) or "swiglu_oai" (gpt-oss's clamped SwiGLU with `swiglu_alpha`, `swiglu_limit`). Biases:
    gate_up_bias [E, 2I] (gate then up), down_bias [E, H], in x's dtype. block_m (16 or 64) and
    use_tensor_cores: the kernels' row tile and GEMM (default: `pick_block_m`, `tensor_cores`)."""
    ctype = _ctype(x.dtype)
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(MOE_ACTIVATIONS)}, got {activation!r}")
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [tokens, hidden] tensor, got shape {list(x.shape)}")
    num_tokens, hidden = x.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_ids / topk_weights must be [{num_tokens}, k], got {list(topk_ids.shape)} / "
            f"{list(topk_weights.shape)}"
        )
    num_experts, rows, _ = gate_up.shape
    if rows % 2:
        raise ValueError(f"gate_up must have 2 * I rows (gate then up), got {rows}")
    inter_size, device = rows // 2, x.device
    gate_up.check("gate_up", (num_experts, rows, hidden), x.dtype, device)
    down.check("down", (num_experts, hidden, inter_size), x.dtype, device)
    bgu = _bias("gate_up_bias", gate_up_bias, (num_experts, rows), x)
    bd = _bias("down_bias", down_bias, (num_experts, hidden), x)
    top_k = topk_ids.shape[1]
    pairs = num_tokens * top_k
    out = torch.empty_like(x)
    if pairs == 0 or hidden == 0:
        return out.zero_()
    ids = topk_ids.to(device=device, dtype=torch.int64).contiguous()
    weights = topk_weights.to(device=device, dtype=x.dtype).contiguous()
    bm = block_m if block_m is not None else pick_block_m(pairs, num_experts)
    sorted_ids, tile_expert = align_by_expert(ids, num_experts, bm, ctype=ctype)
    tiles = tile_expert.numel()
    inter = torch.empty(pairs, inter_size, dtype=x.dtype, device=device)
    ys = torch.empty(pairs, hidden, dtype=x.dtype, device=device)
    mma = tensor_cores(x) if use_tensor_cores is None else use_tensor_cores
    if mma and x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"tensor cores take float16 or bfloat16 activations, got {x.dtype}")
    smem, tc = _smem(bm, x.element_size(), mma), "true" if mma else "false"
    if inter_size:
        act = MOE_ACTIVATIONS[activation]
        wf = MOE_WEIGHT_FORMS[gate_up.form]
        gu_args: tuple[np.generic, ...] = (
            ptr(inter), ptr(x), ptr(gate_up.data), _scale(gate_up), bgu, ptr(sorted_ids), ptr(tile_expert),
            np.int32(pairs), np.int32(top_k), np.int32(hidden), np.int32(inter_size),
            np.float32(swiglu_alpha), np.float32(swiglu_limit), np.int32(_vec(hidden, x, gate_up)),
            *_scale_block(gate_up),
        )  # fmt: skip
        grid = (tiles, -(-inter_size // _BN))
        _launch(
            ctype, f"moe_gate_up<{ctype}, {wf}, {act}, {bm}, {tc}>", grid, _THREADS, smem, gu_args, device
        )
    else:
        inter.zero_()
    wf = MOE_WEIGHT_FORMS[down.form]
    args: tuple[np.generic, ...] = (
        ptr(ys), ptr(inter), ptr(down.data), _scale(down), bd, ptr(weights), ptr(sorted_ids),
        ptr(tile_expert), np.int32(pairs), np.int32(hidden), np.int32(inter_size),
        np.int32(_vec(inter_size, inter, down)), *_scale_block(down),
    )  # fmt: skip
    grid = (tiles, -(-hidden // (2 * _BN)))
    _launch(ctype, f"moe_down<{ctype}, {wf}, {bm}, {tc}>", grid, _THREADS, smem, args, device)
    threads = max(32, min(_THREADS, -(-hidden // 32) * 32))
    args = (ptr(out), ptr(ys), np.int32(top_k), np.int32(hidden))
    _launch(ctype, f"moe_sum<{ctype}>", (num_tokens, -(-hidden // threads)), threads, 0, args, device)
    return out
