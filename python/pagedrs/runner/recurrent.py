"""The recurrent state of a model's linear-attention layers, as a KV-cache group beside the paged KV.

The scheduler's recurrent group (Rust core, `recurrent_group`) gives every running sequence a state slot: the
plan writes it as the row's only block-table entry of the group. Here the slots' memory: per linear-attention
layer, a conv window and a delta-rule state per slot (float32). A row whose first position is 0 starts from a
zeroed state (a new sequence, or one recomputing after preemption); a later chunk or a decode continues from
its slot. An `n > 1` fork's copy pairs are applied after the forward of the plan that forks (that step
computes the parent's last prompt chunk, which the child's copy must include). The group serves no prefix
hit, so every sequence computes its state from its first token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pagedrs._core import StepPlan

__all__ = ["RecurrentRows", "RecurrentState", "has_recurrent_state"]


def has_recurrent_state(model: Any) -> bool:
    """Whether `model` has linear-attention layers with per-sequence recurrent state."""
    return bool(getattr(model, "has_recurrent_state", False))


@dataclass
class RecurrentRows:
    """One step's view of the state: each batch row's slot, and whether it starts from a zeroed state."""

    conv: Tensor  # [linear layers, slots, conv_dim, kernel - 1]
    ssm: Tensor  # [linear layers, slots, value heads, key head dim, value head dim]
    slots: list[int]
    fresh: list[bool]


class RecurrentState:
    """`num_slots` state slots of a model's linear-attention layers (`model.recurrent_shape`)."""

    def __init__(self, model: Any, num_slots: int, device: torch.device) -> None:
        shape = model.recurrent_shape
        self.num_slots = num_slots
        self.bytes_per_slot = int(shape.bytes_per_slot)
        kw: dict[str, Any] = {"dtype": torch.float32, "device": device}
        self.conv = torch.zeros(shape.num_layers, num_slots, *shape.conv, **kw)
        self.ssm = torch.zeros(shape.num_layers, num_slots, *shape.ssm, **kw)

    def rows(self, plan: StepPlan, index: int) -> RecurrentRows:
        """The rows of `plan`, whose group `index` is the recurrent group."""
        tables = np.asarray(plan.group_block_tables[index])
        slots = [int(s) for s in tables[:, 0]] if tables.size else []
        fresh = [int(n) == 0 for n in plan.num_computed_tokens]
        return RecurrentRows(self.conv, self.ssm, slots, fresh)

    def apply_copies(self, plan: StepPlan, index: int) -> None:
        """Group `index`'s copy pairs of `plan` (a fork's child gets its parent's state)."""
        counts = plan.group_num_copies
        start = int(counts[:index].sum())
        pairs = np.asarray(plan.group_copies[start : start + int(counts[index])]).reshape(-1, 2)
        for src, dst in pairs.tolist():
            self.conv[:, dst] = self.conv[:, src]
            self.ssm[:, dst] = self.ssm[:, src]
