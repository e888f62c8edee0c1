"""The weight form of a linear layer or embedding table: what its weight loaders take (`Loaded`, with the
helpers every loader shares), the format object that owns the matmul once a weight is kept in a form
other than a dense tensor (`MatmulWeight`), and the one place that form is chosen from the pieces a
checkpoint hands over (`HeldRows`), once every row of the weight is in, never per call.

Forms: dense (`weight`, multiplied by torch); GGUF blocks of types the CPU kernels take on a float32 CPU
layer (`QuantizedWeight`); GPTQ / AWQ / FP8 pieces kept packed for a GPU (`DevicePackedWeight`); and, given
by the prepare walk rather than at load, Q8_0 at load (`quantize_at_load`) and oneDNN's packed float32
(`onednn`). A weight whose pieces arrive partly dense, or in GGUF and packed forms together, is dense.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from pagedrs.distributed.group import TPGroup
from pagedrs.layers.packed import DevicePackedWeight, PackedPiece
from pagedrs.layers.quantized import QuantizedWeight
from pagedrs.quantization.gguf_blocks import GGUFWeight
from pagedrs.quantization.packed_parts import Fp8, PackedInt

__all__ = [
    "HeldRows",
    "Loaded",
    "MatmulWeight",
    "copy_checked",
    "keeps_quantized",
    "materialize",
    "no_shard",
    "param_with_loader",
    "tp_group",
]

# What a weight loader takes: a tensor, a lazy checkpoint slice, a GGUF-quantized tensor, or a GPTQ/AWQ/FP8
# layer kept packed for the GPU.
Loaded = Tensor | GGUFWeight | PackedInt | Fp8


class MatmulWeight(Protocol):
    """A weight held in a format that owns `x @ W^T` (`QuantizedWeight`, `DevicePackedWeight`, oneDNN's
    `PackedDense`)."""

    def matmul(self, x: Tensor, bias: Tensor | None = None) -> Tensor: ...


def materialize(loaded: Loaded) -> Tensor:
    """A lazy checkpoint slice is read here, once it is cut to this rank's share (a GGUF-quantized one is
    dequantized)."""
    if isinstance(loaded, (GGUFWeight, PackedInt, Fp8)):
        return loaded.materialize()
    read = getattr(loaded, "materialize", None)
    return read() if read is not None else loaded


def copy_checked(param: Tensor, loaded: Loaded, what: str = "") -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        where = f" ({what})" if what else ""
        raise ValueError(f"shape mismatch{where}: expected {tuple(param.shape)}, got {tuple(loaded.shape)}")
    param.data.copy_(materialize(loaded))


def no_shard(shard_id: object, owner: str) -> None:
    if shard_id is not None:
        raise ValueError(f"unexpected shard {shard_id!r} for {owner}")


def param_with_loader(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device | str, loader: Callable
) -> Tensor:
    p = torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]  # our attribute on a torch Parameter
    return p


def tp_group(tp: TPGroup | None, tp_rank: int, tp_size: int) -> TPGroup:
    """`tp`, or a group of `tp_rank` of `tp_size` without a process group (enough to load a shard)."""
    if tp is not None:
        return tp
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    return TPGroup(tp_rank, tp_size)


def keeps_quantized(param: Tensor, loaded: Loaded) -> bool:
    """Whether a piece is held in its quantized form: GGUF blocks of a type the CPU kernels take, for a
    float32 CPU weight; a GPTQ, AWQ or FP8 piece always (the loader hands those over only for a GPU)."""
    if isinstance(loaded, (PackedInt, Fp8)):
        return True
    return (
        isinstance(loaded, GGUFWeight)
        and loaded.has_kernel
        and param.device.type == "cpu"
        and param.dtype == torch.float32
    )


class HeldRows:
    """A weight's rows as they arrive (a merged layer's pieces: q|k|v, gate|up): dense rows copied into the
    parameter at once, quantized pieces held by first row until the last row is in; then `add` gives the
    weight's form."""

    def __init__(self) -> None:
        self.pieces: dict[int, GGUFWeight | PackedPiece] = {}
        self.dense_rows = 0

    def add(self, param: Tensor, offset: int, loaded: Loaded, what: str = "") -> MatmulWeight | None:
        """Rows [offset, offset + len(loaded)) of `param` (2-D). The form once every row is in: a
        `MatmulWeight` (the dense parameter emptied: its copy is never made) or None (dense); None too
        while rows are missing."""
        n = int(loaded.shape[0])
        if not keeps_quantized(param, loaded):
            copy_checked(param.data.narrow(0, offset, n), loaded, what)
            self.dense_rows += n
        else:
            assert isinstance(loaded, (GGUFWeight, PackedInt, Fp8))  # narrowed by keeps_quantized
            want = (n, int(param.shape[1]))
            if tuple(loaded.shape) != want or offset + n > param.shape[0]:
                where = f" ({what})" if what else ""
                raise ValueError(f"shape mismatch{where}: expected {want}, got {tuple(loaded.shape)}")
            self.pieces[offset] = loaded
        if sum(p.shape[0] for p in self.pieces.values()) + self.dense_rows < param.shape[0]:
            return None
        return self._form(param)

    def _form(self, param: Tensor) -> MatmulWeight | None:
        pieces = [self.pieces[o] for o in sorted(self.pieces)]
        gguf = [p for p in pieces if isinstance(p, GGUFWeight)]
        packed = [p for p in pieces if not isinstance(p, GGUFWeight)]
        form: MatmulWeight | None = None
        if pieces and not self.dense_rows and (not gguf or not packed):
            form = QuantizedWeight(gguf) if gguf else DevicePackedWeight(packed, param.device)
            param.data = torch.empty(0, param.shape[1], dtype=param.dtype)
        else:  # mixed dense and quantized pieces: all dense
            for o in sorted(self.pieces):
                p = self.pieces[o]
                param.data.narrow(0, o, p.shape[0]).copy_(p.materialize())
        self.pieces, self.dense_rows = {}, 0
        return form
