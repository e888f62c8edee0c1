"""GGUF-quantized expert weights kept in their block layout, stacked: every expert's rows of one type."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from pagedrs import _core

__all__ = ["StackedQuantWeight"]


class StackedQuantWeight:
    """E weights [rows, cols] of one GGML type: `data` uint8 [E, rows, row_bytes], each row its blocks in
    file order (the layout `_core.moe_experts_quant` takes)."""

    def __init__(self, ggml_type: int, data: npt.NDArray[np.uint8], cols: int) -> None:
        if data.ndim != 3:
            raise ValueError(f"stacked expert data must be [E, rows, row_bytes], got {data.shape}")
        self.ggml_type = ggml_type
        self.data = np.ascontiguousarray(data)
        self.num_experts, self.rows = int(data.shape[0]), int(data.shape[1])
        self.cols = cols
        self.nbytes = int(self.data.nbytes)

    def dequantized(self) -> Tensor:
        """float32 [E, rows, cols]."""
        w = np.empty((self.num_experts * self.rows, self.cols), dtype=np.float32)
        flat = self.data.reshape(self.num_experts * self.rows, -1)
        ids = np.arange(flat.shape[0], dtype=np.int64)
        _core.quant_get_rows(flat, self.ggml_type, ids, w, False)
        return torch.from_numpy(w).view(self.num_experts, self.rows, self.cols)
