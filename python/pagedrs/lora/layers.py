"""LoRA deltas on the base model's linear layers, for a batch that mixes adapters.

A `LoRALinear` is attached to one linear module as a forward hook: the base layer runs unchanged, then
every row gets `(x A^T) B^T * scaling` of its own adapter added to its slice of the output (PEFT's order:
base result first, then the delta). A packed layer (q|k|v, gate|up) holds one slice per HF module, so an
adapter that targets only q_proj changes only the q columns.

The adapters of all slots are stacked per output slice, in the manner of punica's shrink/expand kernels
(SGMV/BGMV) but as two dense matmuls, which is what a CPU does well: `A` of slot s takes rows
[s R, (s + 1) R) of one [slots x R, in] matrix (R: the largest rank resident for that slice, smaller ranks
padded with zeros) and `B * scaling` the same columns of one [out, slots x R] matrix. A step computes
`x A_all^T` for every row ("shrink"), zeroes each row's columns outside its own slot (the step's mask,
built once per R from the rows' slots and shared by every layer; base-model rows get all zeros), then
multiplies by `B_all^T` ("expand"). So a layer costs the same few ops however many adapters the batch
mixes, where a loop over adapters paid a gather, two matmuls and a scatter per adapter and layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["LoRABatch", "LoRALinear", "LoRASlice"]


@dataclass
class LoRABatch:
    """This step's adapter slot of each token row (-1: the base model), or None when no row has one;
    `num_slots` is the number of slots (`max_loras`)."""

    num_slots: int = 1
    slot_of_row: Tensor | None = None
    _masks: dict[tuple[int, torch.dtype], Tensor] = field(default_factory=dict)

    def set_rows(self, slot_of_row: Tensor | None) -> None:
        self.slot_of_row = slot_of_row
        self._masks = {}

    def mask(self, rank: int, dtype: torch.dtype) -> Tensor:
        """[rows, num_slots x rank]: 1 in each row's own slot's `rank` columns, 0 elsewhere."""
        key = (rank, dtype)
        m = self._masks.get(key)
        if m is None:
            rows = self.slot_of_row
            assert rows is not None
            col_slot = torch.arange(self.num_slots * rank, device=rows.device) // rank
            m = (rows.unsqueeze(1) == col_slot.unsqueeze(0)).to(dtype)
            self._masks[key] = m
        return m


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
        # per output slice: (slice, A_all [slots x R, in], B_all [size, slots x R] with the scaling, R)
        self._stacked: list[tuple[LoRASlice, Tensor, Tensor, int]] | None = None
        self._handle = module.register_forward_hook(self._hook)

    def set_slot(self, slot: int, pieces: list[tuple[LoRASlice, Tensor, Tensor, float]]) -> None:
        if pieces:
            self.weights[slot] = pieces
        else:
            self.weights.pop(slot, None)
        self._stacked = None

    def clear_slot(self, slot: int) -> None:
        self.weights.pop(slot, None)
        self._stacked = None

    def remove(self) -> None:
        self._handle.remove()

    def _stack(self) -> list[tuple[LoRASlice, Tensor, Tensor, int]]:
        """The slots' adapters stacked per output slice (rebuilt after a slot changed)."""
        by_slice: dict[LoRASlice, list[tuple[int, Tensor, Tensor, float]]] = {}
        for slot, pieces in self.weights.items():
            for sl, a, b, scaling in pieces:
                by_slice.setdefault(sl, []).append((slot, a, b, scaling))
        n = self.batch.num_slots
        out = []
        for sl, items in by_slice.items():
            rank = max(a.shape[0] for _, a, _, _ in items)
            a0, b0 = items[0][1], items[0][2]
            a_all = a0.new_zeros(n * rank, a0.shape[1])
            b_all = b0.new_zeros(b0.shape[0], n * rank)
            for slot, a, b, scaling in items:
                r = a.shape[0]
                a_all[slot * rank : slot * rank + r] = a
                b_all[:, slot * rank : slot * rank + r] = b * scaling
            out.append((sl, a_all, b_all, rank))
        return out

    def _hook(self, module: torch.nn.Module, args: tuple, out: Tensor) -> Tensor:
        if not self.weights or self.batch.slot_of_row is None:
            return out
        if self._stacked is None:
            self._stacked = self._stack()
        x = args[0]
        for sl, a_all, b_all, rank in self._stacked:
            shrunk = F.linear(x, a_all)  # [rows, slots x R]
            shrunk.mul_(self.batch.mask(rank, shrunk.dtype))
            out.narrow(-1, sl.offset, sl.size).add_(F.linear(shrunk, b_all))
        return out
