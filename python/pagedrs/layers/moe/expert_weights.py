"""The stacked weights of a mixture-of-experts layer: `ExpertWeights` holds one projection of every expert
([E, out, in]) and the three forms it can take once loaded, and `expert_tensor_name` maps a checkpoint's
expert tensors onto it.

Loading keeps what the checkpoint hands over: a float piece is copied into the dense `weight`; a
quantized piece (GGUF blocks, FP8, GPTQ / AWQ) is held as it came (`pending`), its form left to the
experts method chosen after load (`pagedrs.layers.moe.method`, as vLLM's `process_weights_after_loading`),
which takes one of the forms below (`take_gguf`, `take_kernel`) or dequantizes the pieces into `weight`
(`take_dense`):

- `weight`: dense [E, out, in] in the layer's dtype;
- `qweight`: GGUF blocks stacked for the Rust CPU kernels (`StackedQuantWeight`);
- `kernel_weight`: Q8_0 blocks or FP8 stacked for the CUDA kernels (`kernel_form`, an `ExpertMatrix`).

Under tensor parallelism each rank holds a slice of every expert's intermediate dimension (gate and up
rows, down columns: vLLM's TP for MoE).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from pagedrs.distributed.group import TPGroup
from pagedrs.layers.linear import Loaded
from pagedrs.layers.moe import kernel_form
from pagedrs.layers.moe.stacked_quant import StackedQuantWeight
from pagedrs.quantization.fp8_block import Fp8Block
from pagedrs.quantization.gguf_blocks import GGUFWeight
from pagedrs.quantization.packed_parts import Fp8, PackedInt

if TYPE_CHECKING:
    from pagedrs.kernels.moe_ops import ExpertMatrix

__all__ = ["QUANTIZED_PIECES", "ExpertWeights", "expert_tensor_name"]

# per-expert checkpoint tensors: (expert id, piece) of `gate_up` (gate 0, up 1) or `down`
_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_PIECES = {"w1": ("gate_up", 0), "gate_proj": ("gate_up", 0), "w3": ("gate_up", 1), "up_proj": ("gate_up", 1)}
_STACKED = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")

# The quantized pieces a loader may hand over: held as they came until the method's after-load
QUANTIZED_PIECES = (GGUFWeight, Fp8, Fp8Block, PackedInt)


def expert_tensor_name(name: str) -> tuple[str, object] | None:
    """(parameter name, shard id) of an expert tensor of a checkpoint, None for any other tensor.
    Per-expert tensors are shard (expert, piece); a stacked one is the whole parameter (shard None)."""
    m = _PER_EXPERT.search(name)
    if m:
        param, piece = _PIECES.get(m.group(2), ("down", 0))
        return f"{name[: m.start()]}.experts.{param}.weight", (int(m.group(1)), piece)
    m = _STACKED.search(name)
    if m:
        param = "gate_up" if m.group(1) == "gate_up_proj" else "down"
        return f"{name[: m.start()]}.experts.{param}.weight", None
    return None


class ExpertWeights(torch.nn.Module):
    """One linear layer per expert, stacked: `weight` [E, out, in]. `split` "column": the output rows of
    each piece (`output_sizes`: gate and up) are split over the tensor-parallel ranks; "row": the input
    columns are. Shard ids are (expert, piece); shard None is the whole stacked tensor [E, out, in]."""

    def __init__(
        self,
        num_experts: int,
        output_sizes: Sequence[int],
        input_size: int,
        *,
        split: str,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        if split not in ("column", "row"):
            raise ValueError(f"split must be 'column' or 'row', got {split!r}")
        self.num_experts, self.split, self.tp = num_experts, split, tp
        self.output_sizes, self.input_size = list(output_sizes), input_size
        parts = tp.size if split == "column" else 1
        for s in self.output_sizes:
            if s % parts:
                raise ValueError(
                    f"expert output size {s} is not divisible by the tensor-parallel size {parts}"
                )
        if split == "row" and input_size % tp.size:
            raise ValueError(
                f"expert input size {input_size} is not divisible by the tensor-parallel size {tp.size}"
            )
        self.rows = sum(self.output_sizes) // parts
        self.cols = input_size // (tp.size if split == "row" else 1)
        self.weight = torch.nn.Parameter(
            torch.empty(num_experts, self.rows, self.cols, dtype=dtype, device=device), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]  # our attribute
        self.expert_shards: tuple[tuple[int, int], ...] = tuple(
            (e, p) for e in range(num_experts) for p in range(len(self.output_sizes))
        )
        self.shard_ids: tuple[object, ...] = self.expert_shards  # what the loader checks is covered
        self.pending: dict[tuple[int, int], Any] = {}  # quantized pieces as loaded, until after-load
        self.qweight: StackedQuantWeight | None = None
        self.kernel_weight: ExpertMatrix | None = None

    def _piece_rows(self, piece: int) -> tuple[int, int, int]:
        """(offset in this rank's rows, rows this rank holds, first full row it holds) of one piece."""
        parts = self.tp.size if self.split == "column" else 1
        n = self.output_sizes[piece] // parts
        offset = sum(self.output_sizes[:piece]) // parts
        return offset, n, (self.tp.position * n if self.split == "column" else 0)

    def weight_loader(self, param: Tensor, loaded: Loaded, shard_id: object = None) -> None:
        if shard_id is None:
            want = (self.num_experts, sum(self.output_sizes), self.input_size)
            if tuple(loaded.shape) != want:
                raise ValueError(f"shape mismatch: expected {want}, got {tuple(loaded.shape)}")
            full = loaded.materialize() if hasattr(loaded, "materialize") else loaded
            for e in range(self.num_experts):
                start = 0
                for p, size in enumerate(self.output_sizes):
                    self.weight_loader(param, full[e].narrow(0, start, size), (e, p))
                    start += size
            return
        if not (isinstance(shard_id, tuple) and shard_id in self.shard_ids):
            raise ValueError(f"unknown expert shard {shard_id!r}")
        e, p = shard_id
        piece_shape = (self.output_sizes[p], self.input_size)
        if tuple(loaded.shape) != piece_shape:
            raise ValueError(
                f"shape mismatch (expert {e}): expected {piece_shape}, got {tuple(loaded.shape)}"
            )
        offset, n, first = self._piece_rows(p)
        piece = loaded.narrow(0, first, n)
        if self.split == "row":
            piece = piece.narrow(1, self.tp.position * self.cols, self.cols)
        if isinstance(piece, QUANTIZED_PIECES):
            self.pending[(e, p)] = piece
            return
        self.pending.pop((e, p), None)  # a later load of this piece replaces a quantized one
        read = getattr(piece, "materialize", None)
        param.data[e, offset : offset + n].copy_(read() if read is not None else piece)

    def _all_pending(self) -> list[Any] | None:
        """Every piece in shard order when all of them arrived quantized, else None (some are dense)."""
        if len(self.pending) != len(self.expert_shards):
            return None
        return [self.pending[sid] for sid in self.expert_shards]

    def gguf_stackable(self) -> bool:
        """Whether `take_gguf` would keep the pieces: all GGUF blocks of one type a CPU kernel takes, for
        a float32 weight on a CPU."""
        pieces = self._all_pending()
        return (
            pieces is not None
            and self.weight.device.type == "cpu"
            and self.weight.dtype == torch.float32
            and all(isinstance(p, GGUFWeight) and p.has_kernel for p in pieces)
            and len({p.ggml_type for p in pieces}) == 1
        )

    def kernel_stackable(self) -> bool:
        """Whether every piece arrived in a form the CUDA kernels take (GGUF Q8_0, FP8 e4m3) and the
        weight is on a device they run on."""
        pieces = self._all_pending()
        return (
            pieces is not None
            and kernel_form.kernel_device(self.weight)
            and all(kernel_form.kernel_piece(p) for p in pieces)
        )

    def take_gguf(self) -> bool:
        """The pieces stacked per expert (pieces in order) as GGUF blocks for the CPU kernels, if
        `gguf_stackable`; whether they were."""
        if not self.gguf_stackable():
            return False
        pieces = [self.pending[sid] for sid in self.expert_shards]
        per = len(self.output_sizes)
        data = [
            np.concatenate([p.data for p in pieces[e * per : (e + 1) * per]]) for e in range(self.num_experts)
        ]
        self.qweight = StackedQuantWeight(pieces[0].ggml_type, np.stack(data), self.cols)
        self._drop_dense()
        return True

    def take_kernel(self) -> bool:
        """The pieces stacked in the CUDA kernels' layout (`kernel_form.stack_for_kernel`), if
        `kernel_stackable` and they share a form the kernels stack; whether they were."""
        if not self.kernel_stackable():
            return False
        pieces = [self.pending[sid] for sid in self.expert_shards]
        m = kernel_form.stack_for_kernel(pieces, len(self.output_sizes), self.cols, self.weight.device)
        if m is None:
            return False
        self.kernel_weight = m
        self._drop_dense()
        return True

    def take_dense(self) -> None:
        """Every quantized piece still held dequantized into the dense weight."""
        for (e, k), p in sorted(self.pending.items()):
            offset, n, _ = self._piece_rows(k)
            self.weight.data[e, offset : offset + n].copy_(p.materialize())
        self.pending = {}

    def _drop_dense(self) -> None:
        self.pending = {}
        w = self.weight
        w.data = torch.empty(0, self.rows, self.cols, dtype=w.dtype, device=w.device)

    def dense(self) -> Tensor:
        """The weights [E, out, in] (float32 dequantized when kept as GGUF blocks; the layer's dtype when
        kept for the CUDA kernels)."""
        if self.kernel_weight is not None:
            return kernel_form.dequantized(self.kernel_weight).to(self.weight.dtype)
        return self.qweight.dequantized() if self.qweight is not None else self.weight
