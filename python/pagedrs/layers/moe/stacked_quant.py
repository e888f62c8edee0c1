"""GGUF-quantized expert weights kept in their block layout, stacked: every expert's rows of one type."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from pagedrs import _core

__all__ = ["StackedQuantWeight"]


# GGML types with the 8-row interleaved layout (`_core.quant_pack_x8`): Q4_0, Q4_1, Q8_0
_X8_TYPES = frozenset({2, 3, 8})


class StackedQuantWeight:
    """E weights [rows, cols] of one GGML type: `data` uint8 [E, rows, row_bytes], each row its blocks in
    file order, or with `packed` each expert's rows 8 at a time in the interleaved layout of the dense x8
    kernels (`_core.quant_pack_x8`; Q4_0, Q4_1, Q8_0 with rows a multiple of 8, done here at load unless
    `pack` is False): the layouts `_core.moe_experts` takes (its `packed`)."""

    def __init__(self, ggml_type: int, data: npt.NDArray[np.uint8], cols: int, pack: bool = True) -> None:
        if data.ndim != 3:
            raise ValueError(f"stacked expert data must be [E, rows, row_bytes], got {data.shape}")
        self.ggml_type = ggml_type
        self.num_experts, self.rows = int(data.shape[0]), int(data.shape[1])
        self.packed = pack and ggml_type in _X8_TYPES and self.rows % 8 == 0 and data.size > 0
        if self.packed:
            flat = np.ascontiguousarray(data).reshape(self.num_experts * self.rows, -1)
            data = _core.quant_pack_x8(flat, ggml_type).reshape(data.shape)
        self.data = np.ascontiguousarray(data)
        self.cols = cols
        self.nbytes = int(self.data.nbytes)

    def dequantized(self) -> Tensor:
        """float32 [E, rows, cols]."""
        w = np.empty((self.num_experts * self.rows, self.cols), dtype=np.float32)
        flat = self.data.reshape(self.num_experts * self.rows, -1)
        ids = np.arange(flat.shape[0], dtype=np.int64)
        _core.quant_get_rows(flat, self.ggml_type, ids, w, self.packed)
        return torch.from_numpy(w).view(self.num_experts, self.rows, self.cols)
