"""GGUF-quantized weights on CPU: kept in llama.cpp's block layout and multiplied by the Rust kernels.

`QuantizedWeight` is a layer's weight *format* once its pieces are loaded: it owns the matmul
  `x @ W^T` (one Rust call per run of pieces that share a block type) and the row lookup of an
  embedding. Layers call it; the model code never sees which format a layer holds.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from pagedrs import _core
from pagedrs.quantization.gguf_blocks import GGUFWeight, type_name

__all__ = ["DEQUANT_MIN_ROWS", "DEQUANT_MIN_ROWS_X8", "X8_ISAS", "QuantizedWeight"]


@dataclass(frozen=True, slots=True)
class _Run:
    """Consecutive output rows `col0..col0 + n` of one block type; `packed`: `data` is in the kernels'
    8-row interleaved layout (`_core.quant_pack_x8`) rather than the file's."""

    ggml_type: int
    data: npt.NDArray[np.uint8]
    col0: int
    n: int
    packed: bool = False


# Types the kernels repack 8 rows at a time at load (their fastest layout on AVX2: the default model's
# batch-1 matmuls 17.9 -> 13.3 ms a step with 1 thread, 10.3 -> 8.1 ms with 2, on the CI machine; its
# Q8_0 output head, 49152 x 576, 2 threads: 0.70 -> 0.56 ms at 1 row, 2.2 -> 1.3 ms at 5, 6.4 -> 4.6 ms
# at 16). The 4- and 5-bit types of a Q4_K_M file too (Q4_K, Q5_K, Q5_0; and Q5_1): a 8960 x 1536 matmul,
# 2 threads, file vs x8 layout, best of 7 on the loaded CI machine: Q4_K 0.63 vs 0.61 ms at 1 row, 26.9 vs
# 11.3 ms at 16; Q5_0 1.44 vs 0.95, 30.0 vs 11.1; Q5_K 1.11 vs 1.07, 28.7 vs 15.2 (`bench/quant_kernel.py
# --x8`). Q6_K too: its x8 kernel prefetches the block after next and reads each weight byte once at one
# activation row; 8960 x 1536, file vs x8 layout, best of 25 on the loaded CI machine, 1 thread: 1.67 vs
# 1.57 ms at 1 row, 2.02 vs 1.93 at 2, 2.86 vs 2.04 at 4, 23.3 vs 15.6 at 16; 2 threads at 1 row, five
# runs (best of 15 or 41, a machine loaded by other work): 1.75 vs 2.04, 1.34 vs 1.69, 1.76 vs 1.50, 1.55
# vs 1.48, 0.83 vs 0.79. Out of cache the x8 kernel was twice the file's before the
# prefetch; in cache (1024 x 1536) it is 1.44x faster at 1 row.
# gguf.GGMLQuantizationType.Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K
_X8_TYPES = frozenset({2, 3, 6, 7, 8, 12, 13, 14})
# The kernel sets (`_core.quant_isa()`) that take that layout: AVX2, and AVX2 with AVX-512 VNNI.
X8_ISAS = frozenset({"avx2", "avx512-vnni"})


def _packed_run(ggml_type: int, data: npt.NDArray[np.uint8], col0: int, n: int) -> _Run:
    """The run, repacked where the kernels have a faster layout for it on this CPU."""
    if ggml_type in _X8_TYPES and n % 8 == 0 and _core.quant_isa() in X8_ISAS:
        return _Run(ggml_type, _core.quant_pack_x8(data, ggml_type), col0, n, packed=True)
    return _Run(ggml_type, data, col0, n)


# Rows of x from which `QuantizedWeight.matmul` dequantizes W and runs a float32 GEMM instead of the
# integer kernels: the crossing point measured on the 2-core AVX2 CI machine (bench/cpu_peer.py's model,
# its Q8_0 output head: 188 vs 198 ms at 128 rows, 287 vs 271 ms at 192, 765 vs 567 ms at 512). Decode
# steps (a row per running request) stay below it; prefill chunks go above.
DEQUANT_MIN_ROWS = 160
# The same for weights whose every run is 4-bit in the x8 layout, whose kernel is faster: the default
# model's first 6 layers, 2 threads: 285 vs 332 ms at 400 rows, 385 vs 356 at 512, 529 vs 641 at 768, 724
# vs 685 at 1024 (integer kernel vs dequantize + GEMM). Q8_0 in the x8 layout keeps DEQUANT_MIN_ROWS: its
# dequantization is cheap (576 x 1536, 2 threads: 3.1 vs 2.4 ms at 160 rows; 3072 x 576: 3.6 vs 5.3 ms).
DEQUANT_MIN_ROWS_X8 = 512
_X8_4BIT = frozenset({2, 3})


class QuantizedWeight:
    """W [out_features, in_features] as GGUF blocks: pieces stacked along the output rows (q|k|v,
    gate|up), pieces of the same type merged into one contiguous matrix."""

    def __init__(self, pieces: list[GGUFWeight]) -> None:
        if not pieces or any(not p.has_kernel for p in pieces):
            raise ValueError("QuantizedWeight needs at least one piece, all of types the kernels take")
        in_features = pieces[0].shape[1]
        if any(p.shape[1] != in_features for p in pieces):
            raise ValueError(f"pieces differ in their input size: {[p.shape for p in pieces]}")
        self.in_features = in_features
        self.out_features = sum(p.shape[0] for p in pieces)
        runs: list[_Run] = []
        col0 = 0
        for group in _runs_by_type(pieces):
            data = np.ascontiguousarray(np.concatenate([p.data for p in group]))
            n = sum(p.shape[0] for p in group)
            runs.append(_packed_run(group[0].ggml_type, data, col0, n))
            col0 += n
        self.runs = runs
        self.nbytes = sum(r.data.nbytes for r in runs)
        x8_4bit = all(r.packed and r.ggml_type in _X8_4BIT for r in runs)
        self.dequant_min_rows = DEQUANT_MIN_ROWS_X8 if x8_4bit else DEQUANT_MIN_ROWS

    @property
    def type_names(self) -> list[str]:
        return [type_name(r.ggml_type) for r in self.runs]

    def matmul(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x [..., in_features] float32 on CPU -> x @ W^T (+ bias), float32 [..., out_features].

        Kept lean (a batch-1 decode step makes over a hundred of these calls): numpy views in and out,
        no torch allocation; the binding checks dtype and shapes."""
        lead = x.shape[:-1]
        out = torch.from_numpy(
            self.matmul_rows((x if x.dim() == 2 else x.reshape(-1, self.in_features)).numpy())
        )
        if bias is not None:
            out += bias
        return out if len(lead) == 1 else out.view(*lead, self.out_features)

    def keep_integer_kernels(self) -> None:
        """Every call through the integer kernels, however many rows (batch invariance: a row's bits do
        not depend on the rows beside it there, and the float GEMM would round each row differently)."""
        self.dequant_min_rows = sys.maxsize

    def matmul_rows(self, xn: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """Rows xn [T, in_features] float32 -> xn @ W^T, a new float32 array [T, out_features]."""
        if not xn.flags.c_contiguous:
            xn = np.ascontiguousarray(xn)
        on = np.empty((xn.shape[0], self.out_features), dtype=np.float32)
        if xn.shape[0] >= self.dequant_min_rows:
            # a long prefill chunk: the weight dequantized once (a transient copy, freed after the call) and
            # torch's float32 GEMM, which beats the integer dot products from about this many rows on
            torch.mm(torch.from_numpy(xn), self.dequantized().T, out=torch.from_numpy(on))
        else:
            threads = torch.get_num_threads()
            for r in self.runs:
                _core.quant_matmul(xn, r.data, r.ggml_type, on, r.col0, threads, r.packed)
        return on

    def dequantized(self) -> Tensor:
        """W as float32 [out_features, in_features] (a new tensor: the blocks stay the stored form)."""
        w = np.empty((self.out_features, self.in_features), dtype=np.float32)
        for r in self.runs:
            ids = np.arange(r.n, dtype=np.int64)
            _core.quant_get_rows(r.data, r.ggml_type, ids, w[r.col0 : r.col0 + r.n], r.packed)
        return torch.from_numpy(w)

    def rows(self, ids: Tensor) -> Tensor:
        """Dequantized rows `ids` (an embedding lookup): float32 [len(ids), in_features]."""
        if len(self.runs) != 1:
            raise ValueError("an embedding table is one piece of one type")
        r = self.runs[0]
        flat = ids.reshape(-1).to(torch.int64)
        out = torch.empty(flat.shape[0], self.in_features, dtype=torch.float32)
        _core.quant_get_rows(r.data, r.ggml_type, flat.numpy(), out.numpy(), r.packed)
        return out.view(*ids.shape, self.in_features)


def _runs_by_type(pieces: list[GGUFWeight]) -> list[list[GGUFWeight]]:
    """Pieces split into runs of consecutive pieces of the same type."""
    runs: list[list[GGUFWeight]] = []
    for p in pieces:
        if runs and runs[-1][0].ggml_type == p.ggml_type:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs
