"""The recurrent state of a model's linear-attention layers, as a KV-cache group beside the paged KV.

The scheduler's recurrent group (Rust core, `recurrent_group`) gives every running sequence a live state slot:
the plan writes it as the row's first block-table entry of the group. Here the slots' memory: per
linear-attention layer, a conv window and a delta-rule state per slot (float32). A row whose first position is 0
starts from a zeroed state (a new sequence, or one recomputing after preemption); a row whose second table entry
names a snapshot (plus 1) starts from that snapshot (a prefix hit); a later chunk or a decode continues from its
slot. An `n > 1` fork's copy pairs are applied after the forward of the plan that forks (that step computes the
parent's last prompt chunk, which the child's copy must include).

Exact prefix caching: the snapshot policy is one snapshot of the whole state at every full block boundary a
sequence computes (the group's slot mapping names the snapshot slot at the block's last token; each layer copies
its state there once that token is computed), cached under the block's hash next to the KV block, in a pool of
`max_num_seqs` snapshot slots whose least recently used cached snapshot is reused first. A snapshot costs
`RecurrentShape.bytes_per_slot`, i.e. `bytes_per_slot / block_size` per cached token (the tiny test model:
5,376 bytes per slot; `Qwen3_5MoeTextConfig`'s defaults, 30 linear layers x (8192 x 3 conv + 32 x 128 x 128
state) x 4 bytes: about 63 MiB per snapshot, 3.9 MiB per token with 16-token blocks), at most `max_num_seqs`
snapshots in all; these slots are allocated beside the KV pool, not taken out of its budget.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedrs._core import StepPlan
from pagedrs.layers.attention import RecurrentRows

__all__ = ["RecurrentState", "has_recurrent_state"]


def has_recurrent_state(model: Any) -> bool:
    """Whether `model` has linear-attention layers with per-sequence recurrent state."""
    return bool(getattr(model, "has_recurrent_state", False))


class RecurrentState:
    """`num_live` live slots then `num_snapshots` snapshot slots of a model's linear-attention layers
    (`model.recurrent_shape`)."""

    def __init__(self, model: Any, num_live: int, num_snapshots: int, device: torch.device) -> None:
        shape = model.recurrent_shape
        self.num_layers = int(shape.num_layers)
        self.num_slots = num_live
        self.num_snapshots = num_snapshots
        self.bytes_per_slot = int(shape.bytes_per_slot)
        kw: dict[str, Any] = {"dtype": torch.float32, "device": device}
        total = num_live + num_snapshots
        self.conv = torch.zeros(shape.num_layers, total, *shape.conv, **kw)
        self.ssm = torch.zeros(shape.num_layers, total, *shape.ssm, **kw)

    def rows(self, plan: StepPlan, index: int) -> RecurrentRows:
        """The rows of `plan`, whose group `index` is the recurrent group; each row's live slot is zeroed (a
        row from position 0) or restored from its snapshot (a prefix hit) here, before the forward."""
        tables = np.asarray(plan.group_block_tables[index])
        mapping = np.asarray(plan.group_slot_mapping[index])
        qsl = plan.query_start_loc
        slots: list[int] = []
        snapshots: list[list[tuple[int, int]]] = []
        for r, computed in enumerate(plan.num_computed_tokens):
            live = int(tables[r, 0])
            restore = int(tables[r, 1]) - 1 if tables.shape[1] > 1 else -1
            slots.append(live)
            if int(computed) == 0:
                self.conv[:, live].zero_()
                self.ssm[:, live].zero_()
            elif restore >= 0:
                self.conv[:, live] = self.conv[:, restore]
                self.ssm[:, live] = self.ssm[:, restore]
            lo, hi = int(qsl[r]), int(qsl[r + 1])
            row = mapping[lo:hi]
            snapshots.append([(int(i), int(row[i])) for i in np.flatnonzero(row >= 0)])
        return RecurrentRows(self.conv, self.ssm, slots, snapshots)

    def apply_copies(self, plan: StepPlan, index: int) -> None:
        """Group `index`'s copy pairs of `plan` (a fork's child gets its parent's state)."""
        counts = plan.group_num_copies
        start = int(counts[:index].sum())
        pairs = np.asarray(plan.group_copies[start : start + int(counts[index])]).reshape(-1, 2)
        for src, dst in pairs.tolist():
            self.conv[:, dst] = self.conv[:, src]
            self.ssm[:, dst] = self.ssm[:, src]
