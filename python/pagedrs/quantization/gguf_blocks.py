"""GGUF block types (llama.cpp's): a checkpoint tensor in its block layout, the types the CPU kernels
multiply without dequantizing, and Q8_0 blocks computed from float weights.

- `GGUFWeight` is one checkpoint tensor as the GGUF file stores it (rows of blocks). It answers the lazy
  checkpoint-slice protocol the layers' weight loaders use (`shape`, `dim()`, `narrow()`,
  `materialize()`), so a layer that keeps only dense weights loads it dequantized, unchanged.
- Q8_0 (llama.cpp's reference quantizer, as gguf-py computes it): every 32 consecutive weights of a row
  get an f16 scale d = max|w| / 127 and int8 values round(w / d).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from pagedrs import _core

__all__ = ["Q8_0_BLOCK", "GGUFWeight", "kernel_types", "quantize_to_q8_0", "type_name"]

_KERNEL_TYPES: frozenset[int] = frozenset(_core.quant_type_ids())


def kernel_types() -> frozenset[int]:
    """GGML type ids (`gguf.GGMLQuantizationType` values) the CPU kernels multiply without dequantizing."""
    return _KERNEL_TYPES


def type_name(ggml_type: int) -> str:
    """The GGML type's name ("Q4_K")."""
    import gguf

    return gguf.GGMLQuantizationType(ggml_type).name


def _block_shape(ggml_type: int) -> tuple[int, int]:
    """(weights per block, bytes per block) of a GGML type."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]


@dataclass(frozen=True, slots=True)
class GGUFWeight:
    """A 2-D weight [rows, cols] in a GGUF block type: `data` is uint8 [rows, row_bytes], each row its
    blocks in file order (a read-only view of the file's memory map until a row permutation copies it)."""

    ggml_type: int
    shape: tuple[int, int]
    data: npt.NDArray[np.uint8]

    def __post_init__(self) -> None:
        rows, cols = self.shape
        block, size = _block_shape(self.ggml_type)
        if cols % block or self.data.shape != (rows, cols // block * size):
            raise ValueError(
                f"{self.type_name} weight of shape {self.shape} needs data [{rows}, {cols // block * size}], "
                f"got {tuple(self.data.shape)}"
            )

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    @property
    def block_size(self) -> int:
        """Weights per block along a row (32, or 256 for the K-quants)."""
        return _block_shape(self.ggml_type)[0]

    @property
    def has_kernel(self) -> bool:
        """Whether the CPU kernels multiply this type directly."""
        return self.ggml_type in _KERNEL_TYPES

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> GGUFWeight:
        """Rows (dim 0), or columns on whole blocks (dim 1; ValueError when a cut falls inside a block)."""
        rows, cols = self.shape
        if dim == 0:
            return GGUFWeight(self.ggml_type, (length, cols), self.data[start : start + length])
        if dim != 1:
            raise ValueError(f"a GGUF weight has 2 dimensions, got dim={dim}")
        block, size = _block_shape(self.ggml_type)
        if start % block or length % block:
            raise ValueError(
                f"cannot cut columns {start}..{start + length} of a {self.type_name} weight: "
                f"the cut must fall on its {block}-weight blocks"
            )
        data = self.data[:, start // block * size : (start + length) // block * size]
        return GGUFWeight(self.ggml_type, (rows, length), data)

    def permute_rows(self, order: npt.NDArray[np.int64]) -> GGUFWeight:
        """Rows reordered (`new[i] = old[order[i]]`); rows are quantized independently, so this is exact."""
        return GGUFWeight(self.ggml_type, self.shape, np.ascontiguousarray(self.data[order]))

    def materialize(self) -> Tensor:
        """Dequantized float32 [rows, cols] (gguf-py's dequantizer: the float32 oracle's values)."""
        import gguf

        w = gguf.quants.dequantize(self.data, gguf.GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(self.shape))


Q8_0_BLOCK = 32
_Q8_0 = 8  # gguf.GGMLQuantizationType.Q8_0


def quantize_to_q8_0(w: torch.Tensor) -> GGUFWeight:
    """A float weight [rows, cols] (cols a multiple of 32) as Q8_0 blocks."""
    rows, cols = w.shape
    if cols % Q8_0_BLOCK:
        raise ValueError(
            f"Q8_0 needs a multiple of {Q8_0_BLOCK} columns, got a weight of shape {(rows, cols)}"
        )
    import gguf

    data = gguf.quants.quantize(
        np.ascontiguousarray(w.detach().to(torch.float32).numpy()), gguf.GGMLQuantizationType(_Q8_0)
    )
    return GGUFWeight(_Q8_0, (int(rows), int(cols)), np.ascontiguousarray(data, dtype=np.uint8))
