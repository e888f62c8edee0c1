"""Forwards of a drafter over some rows of a step, each with queries of its own: decode-shaped sub-steps
(one token a row: the drafts fed back one at a time) and a draft model's catch-up. Each packs a
plan-shaped `_SubStep` into buffers of its own and asks the runner's builder for its attention metadata,
so it reads the same block tables and KV pool as the step it is part of."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedrs.layers.attention import ForwardContext

if TYPE_CHECKING:
    from pagedrs._core import StepPlan
    from pagedrs.spec_decode.interface import DrafterContext, StepContext, StepPacker

__all__ = ["speculating_rows", "substep_forward", "varlen_forward"]


@dataclass
class _SubStep:
    """A plan over some rows of a step with queries of their own (decode-shaped sub-steps, a draft
    model's catch-up): what `StepBuffers.pack` and the attention metadata read from a `StepPlan`."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    seq_lens: np.ndarray  # int32 [A]
    query_start_loc: np.ndarray  # int32 [A + 1]
    block_table_rows: np.ndarray  # int32 [A]
    changed_rows: np.ndarray  # int32 [0]
    block_tables: np.ndarray | None  # int32 [A, M] (no device mirror)
    logits_indices: np.ndarray  # int64 [0]
    num_scheduled_tokens: np.ndarray  # int32 [A]
    num_tokens: int
    num_decode_tokens: int
    # The target's KV-cache groups (window pools) at these tokens and rows: [G, T] and [G, A, M]; their
    # copy-on-write pairs were applied by the step's own metadata, none here.
    group_slot_mapping: np.ndarray | None = None
    group_block_tables: np.ndarray | None = None

    @property
    def num_groups(self) -> int:
        return 0 if self.group_slot_mapping is None else len(self.group_slot_mapping)

    @property
    def group_num_copies(self) -> np.ndarray:
        return np.zeros(self.num_groups, dtype=np.int64)

    @property
    def group_copies(self) -> np.ndarray:
        return np.zeros((0, 2), dtype=np.int64)


def speculating_rows(plan: StepPlan, spec: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For the sampled sequences `spec` (indices into `plan.sampled_seq_ids`): their batch rows and the
    flattened index of each one's last token (its first query token; the draft placeholders follow)."""
    batch_of = {int(r): b for b, r in enumerate(plan.req_ids.tolist())}
    rows = np.array([batch_of[int(s)] for s in plan.sampled_seq_ids[spec].tolist()], dtype=np.int64)
    return rows, plan.query_start_loc[rows].astype(np.int64)


def substep_forward(
    context: DrafterContext,
    step: StepContext,
    buffers: StepPacker,
    rows: np.ndarray,
    tok: np.ndarray,
    input_ids: np.ndarray,
    *,
    kv_caches: list[torch.Tensor],
    model: torch.nn.Module | None = None,
    exit_layer: int | None = None,
) -> torch.Tensor:
    """One decode-shaped forward of `model` (default the target) over batch rows `rows` of the step:
    row i feeds `input_ids[i]` at the position and KV slot of the plan's token `tok[i]`, attending to
    its sequence up to there in `kv_caches`. The final hidden states, one row each. The target's window
    layers read and write their KV-cache groups' slots of those tokens; a draft model's own pool has none."""
    plan = step.plan
    positions = plan.positions[tok].astype(np.int64)
    group_slots = plan.group_slot_mapping[:, tok] if model is None and plan.num_groups else None
    return varlen_forward(
        context,
        step,
        buffers,
        rows,
        input_ids,
        positions,
        plan.slot_mapping[tok].astype(np.int64),
        np.ones(len(rows), dtype=np.int32),
        kv_caches=kv_caches,
        model=model,
        exit_layer=exit_layer,
        group_slots=group_slots,
    )


def varlen_forward(
    context: DrafterContext,
    step: StepContext,
    buffers: StepPacker,
    rows: np.ndarray,
    input_ids: np.ndarray,
    positions: np.ndarray,
    slot_mapping: np.ndarray,
    query_lens: np.ndarray,
    *,
    kv_caches: list[torch.Tensor],
    model: torch.nn.Module | None = None,
    exit_layer: int | None = None,
    group_slots: np.ndarray | None = None,
) -> torch.Tensor:
    """One forward of `model` (default the target) over batch rows `rows` of the step with queries of
    their own: row i feeds the next `query_lens[i]` of `input_ids` (int64, flattened) at `positions`
    (consecutive, ending the row's context) and KV `slot_mapping`, through the row's block table into
    `kv_caches`. `group_slots` [G, T]: the target's KV-cache groups' slots of those tokens, read through
    the rows' group block tables (None: every layer through the full-attention tables, as a draft
    model's own pool holds them). The final hidden states, one per token."""
    plan = step.plan
    n = len(rows)
    mirror = step.mirror_rows
    dense = None if mirror is not None else plan.block_tables
    qsl = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(query_lens, out=qsl[1:])
    seq_lens = (positions[qsl[1:] - 1] + 1).astype(np.int32)
    num_tokens = int(qsl[-1])
    decode = bool((query_lens == 1).all())
    sub = _SubStep(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        seq_lens=seq_lens,
        query_start_loc=qsl,
        block_table_rows=plan.block_table_rows[rows],
        changed_rows=np.zeros(0, dtype=np.int32),
        block_tables=None if dense is None else np.ascontiguousarray(dense[rows]),
        logits_indices=np.zeros(0, dtype=np.int64),  # the caller takes the logits it wants
        num_scheduled_tokens=query_lens.astype(np.int32),
        num_tokens=num_tokens,
        num_decode_tokens=num_tokens if decode else 0,
        group_slot_mapping=group_slots,
        group_block_tables=None if group_slots is None else plan.group_block_tables[:, rows],
    )
    inputs = buffers.pack(sub, mirror_rows=mirror)  # a StepPlan's fields
    meta = step.build_attn_metadata(
        sub, inputs, int(query_lens.max()), int(seq_lens.max()), groups=group_slots is not None
    )
    ctx = ForwardContext(
        attn_metadata=meta, kv_caches=kv_caches, backend=context.backend, exit_layer=exit_layer
    )
    net = model if model is not None else context.target
    return net(inputs.input_ids, inputs.positions, ctx)
