"""Dense float32 weights on a CPU, packed once for oneDNN's matmul (as vLLM's CPU backend and torch.compile's
CPU freezing pass do).

`F.linear` on a CPU hands each call to MKL's sgemm, which copies ("packs") the whole weight matrix into its
blocked panel layout on every call: at a decode step's few rows that copy costs about as much as the
multiply itself, and the output head's 49152 x 576 table is re-packed for every step. Packing once, at
load, into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`) and multiplying with
`torch.ops.mkldnn._linear_pointwise` removes it. Measured on the 2-core AVX2 CI machine with 2 threads
(`bench/cpu_gemm.py`, the default model's shapes): a decode step's matmuls 1.20x faster at 1 row (the output
head 1.96x; the small matmuls up to 2x slower there, oneDNN's fixed cost per call), 2.03x at 16 rows and
1.47x at 64.

The packed weight takes a layer's `qweight` slot (the dense `weight` becomes an empty placeholder, as for
the other formats that own the matmul); the output head gets its own packed copy next to the table, which
the embedding lookups keep reading. Results differ from `F.linear`'s by float32 summation order only.
`PAGEDRS_ONEDNN=0` turns it off.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import Tensor

from pagedrs.layers.device_form import DeviceForm, PrepareOptions, apply_forms
from pagedrs.layers.linear import ParallelLMHead, _LinearBase

__all__ = ["PackDense", "PackedDense", "available", "pack_dense_weights"]

logger = logging.getLogger(__name__)

# Rows the blocked layout is chosen for (any row count multiplies; this is oneDNN's hint only).
_PACK_ROWS = 64


def available() -> bool:
    """oneDNN's packed linear can run here (torch built with it, not turned off by PAGEDRS_ONEDNN=0)."""
    if os.environ.get("PAGEDRS_ONEDNN", "1") == "0":
        return False
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedDense:
    """A dense float32 weight [out, in] in oneDNN's blocked layout, with the matmul of a linear layer."""

    def __init__(self, weight: Tensor) -> None:
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError(
                f"PackedDense takes a 2-D float32 CPU weight, got {tuple(weight.shape)} "
                f"{weight.dtype} on {weight.device}"
            )
        self.out_features, self.in_features = (int(s) for s in weight.shape)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_ROWS)

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * 4

    def matmul(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x [..., in] float32 -> [..., out] (+ bias)."""
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:
            return x.new_zeros(*lead, self.out_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, bias, "none", [], "")
        return out.reshape(*lead, self.out_features)

    def dequantized(self) -> Tensor:
        """The weight back in its plain [out, in] layout."""
        return self.packed.to_dense()


def _dense(w: Tensor) -> bool:
    """A float32 CPU weight still held dense."""
    return w.numel() > 0 and w.device.type == "cpu" and w.dtype == torch.float32


def _can_pack() -> bool:
    if not available():
        return False
    try:
        PackedDense(torch.zeros(8, 8))
    except RuntimeError as exc:  # a torch build whose oneDNN lacks the op for this CPU
        logger.info("float32 CPU weights stay with F.linear: oneDNN's packed linear failed (%s)", exc)
        return False
    return True


class PackDense(DeviceForm):
    """Every dense float32 CPU linear weight (and the output head's table) packed for oneDNN. Nothing where
    oneDNN's packed linear is not available, nor for weights already held in another format (GGUF blocks,
    Q8_0, GPU-packed)."""

    name = "onednn"

    def __init__(self) -> None:
        self.enabled = _can_pack()
        self.count = 0

    @staticmethod
    def wanted(opts: PrepareOptions) -> bool:
        return opts.pack_dense

    def visit(self, name: str, m: torch.nn.Module) -> None:
        if not self.enabled:
            return
        if isinstance(m, _LinearBase) and m.qweight is None and _dense(m.weight):
            m.qweight = PackedDense(m.weight.data)
            m.weight.data = torch.empty(0, m.weight.shape[1], dtype=m.weight.dtype)
            self.count += 1
        elif (
            isinstance(m, ParallelLMHead) and m.packed is None and m.quant.weight is None and _dense(m.weight)
        ):
            m.packed = PackedDense(m.weight.data)  # the table stays: a tied embedding looks rows up in it
            self.count += 1

    def finish(self, model: torch.nn.Module) -> int:
        if self.count:
            logger.info("float32 CPU weights packed for oneDNN's matmul: %d layers", self.count)
        return self.count


def pack_dense_weights(model: torch.nn.Module) -> int:
    """Pack `model`'s dense float32 CPU weights for oneDNN (`PackDense`); returns how many."""
    return apply_forms(model, [PackDense()])[PackDense.name]
