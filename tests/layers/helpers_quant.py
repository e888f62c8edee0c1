"""Random GGUF-quantized weights for the quantized-kernel tests: random bytes with finite, moderate f16
block scales written over each block's scale fields (MXFP4: its e8m0 exponent byte), so every value
dequantizes to a finite float."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from pagedrs.quantization.gguf_blocks import GGUFWeight

Q = gguf.GGMLQuantizationType
KERNEL_TYPES = [
    Q.Q4_0,
    Q.Q4_1,
    Q.Q5_0,
    Q.Q5_1,
    Q.Q8_0,
    Q.Q2_K,
    Q.Q3_K,
    Q.Q4_K,
    Q.Q5_K,
    Q.Q6_K,
    Q.IQ4_NL,
    Q.IQ4_XS,
    Q.MXFP4,
]

# Byte offsets of the f16 scale / min fields in one block (llama.cpp's block structs).
_HALF_FIELDS: dict[Q, tuple[int, ...]] = {
    Q.Q4_0: (0,),
    Q.Q5_0: (0,),
    Q.Q8_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_1: (0, 2),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
    Q.TQ2_0: (64,),
    Q.MXFP4: (),
}


def random_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes] of `qtype` blocks."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for at in _HALF_FIELDS[qtype]:
        scales = (rng.uniform(0.002, 0.05, len(data)) * rng.choice([-1, 1], len(data))).astype(np.float16)
        data[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    if qtype == Q.MXFP4:
        data[:, 0] = rng.integers(118, 130, len(data))  # 2^(e - 127): 2^-9 .. 2^2
    return data.reshape(rows, cols // block * size)


def random_weight(qtype: Q, rows: int, cols: int, seed: int = 0) -> GGUFWeight:
    return GGUFWeight(int(qtype), (rows, cols), random_blocks(qtype, rows, cols, seed))


def dequantized(w: GGUFWeight) -> torch.Tensor:
    """gguf-py's own dequantizer, as float32 [rows, cols]."""
    return torch.from_numpy(gguf.quants.dequantize(w.data, Q(w.ggml_type)).astype(np.float32))


def error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Bound on |x @ w.T - kernel| from the 8-bit activations: each activation is off by at most half a
    step, amax/254 of its 32-block, so an output is off by at most max|x| / 254 * sum|w| (plus float
    rounding, 1e-4 relative)."""
    step = x.abs().amax(dim=-1, keepdim=True) / 254
    return step * w.abs().sum(dim=-1)[None, :] * 1.0001 + 1e-4 * (x.abs() @ w.abs().T) + 1e-6
