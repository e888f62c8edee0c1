"""LoRA deltas on the base model's linear layers, for a batch that mixes adapters.

A `LoRALinear` is attached to one linear module as a forward hook: the base layer runs unchanged, then
for each adapter present in the step its rows get `(x A^T) B^T * scaling` added to their slice of the
output (PEFT's order: base result first, then the delta). A packed layer (q|k|v, gate|up) holds one
slice per HF module, so an adapter that targets only q_proj changes only the q columns.

Which rows belong to which adapter is the step's `LoRABatch`, built once per step from the plan and read
by every layer: rows are grouped by adapter (one gather, two matmuls and one scatter-add per adapter and
layer); a step where every row runs the same adapter takes no gather at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["LoRABatch", "LoRALinear", "LoRASlice"]


@dataclass
class LoRABatch:
    """This step's rows per adapter slot: slot -> token row indices, or None for every row."""

    groups: list[tuple[int, Tensor | None]] = field(default_factory=list)


@dataclass(frozen=True)
class LoRASlice:
    """Columns [offset, offset + size) of a layer's output that one HF module owns (the q columns of a
    fused qkv_proj; the whole output of an unfused layer)."""

    offset: int
    size: int


class LoRALinear:
    """The LoRA weights of the resident adapters for one linear module, and the hook that adds them."""

    def __init__(self, module: torch.nn.Module, batch: LoRABatch) -> None:
        self.batch = batch
        # slot -> [(slice, A [r, in], B [size, r], scaling)]
        self.weights: dict[int, list[tuple[LoRASlice, Tensor, Tensor, float]]] = {}
        self._handle = module.register_forward_hook(self._hook)

    def set_slot(self, slot: int, pieces: list[tuple[LoRASlice, Tensor, Tensor, float]]) -> None:
        if pieces:
            self.weights[slot] = pieces
        else:
            self.weights.pop(slot, None)

    def clear_slot(self, slot: int) -> None:
        self.weights.pop(slot, None)

    def remove(self) -> None:
        self._handle.remove()

    def _hook(self, module: torch.nn.Module, args: tuple, out: Tensor) -> Tensor:
        if not self.weights or not self.batch.groups:
            return out
        x = args[0]
        for slot, rows in self.batch.groups:
            pieces = self.weights.get(slot)
            if not pieces:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            for sl, a, b, scaling in pieces:
                delta = F.linear(F.linear(xs, a), b) * scaling
                view = out.narrow(-1, sl.offset, sl.size)
                if rows is None:
                    view.add_(delta)
                else:
                    view.index_add_(0, rows, delta)
        return out
