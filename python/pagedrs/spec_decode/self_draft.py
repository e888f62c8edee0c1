"""Self-drafting by early exit: the target model's first L layers, its final norm and its LM head propose
the drafts of speculative decoding, inside the step that verifies them.

The scheduler reserves `1 + d` query slots for a speculating sequence (its last token, then `d` draft
placeholders). Before the step's forward, the drafter runs `d` decode-shaped sub-forwards over the
speculating sequences only: sub-step `j` feeds the token at position `nc + j` (the last token, then the
previous draft), through layers `[0, L)`, and takes the argmax as draft `j + 1`. Those sub-forwards write
the KV of layers `[0, L)` at the same slots the verifying forward then writes again for the same tokens,
so no second KV pool exists and nothing has to be rolled back: the draft's context is the target's own
cache. The drafts are written into the step's device inputs, and the verifier reads them from
`last_drafts`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedrs.layers.attention import AttentionMetadata, ForwardContext
from pagedrs.worker.step_buffers import StepBuffers, StepInputs

if TYPE_CHECKING:
    from pagedrs._core import StepPlan
    from pagedrs.worker.model_runner import ModelRunner

__all__ = [
    "SelfDrafter",
    "default_draft_layers",
    "speculating_rows",
    "substep_buffers",
    "substep_forward",
    "varlen_forward",
]


def default_draft_layers(num_layers: int) -> int:
    """A quarter of the layers (at least one, fewer than all)."""
    return max(1, min(num_layers - 1, num_layers // 4)) if num_layers > 1 else 1


@dataclass
class _DraftStep:
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


def speculating_rows(plan: StepPlan, spec: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For the sampled sequences `spec` (indices into `plan.sampled_seq_ids`): their batch rows and the
    flattened index of each one's last token (its first query token; the draft placeholders follow)."""
    batch_of = {int(r): b for b, r in enumerate(plan.req_ids.tolist())}
    rows = np.array([batch_of[int(s)] for s in plan.sampled_seq_ids[spec].tolist()], dtype=np.int64)
    return rows, plan.query_start_loc[rows].astype(np.int64)


def substep_buffers(runner: ModelRunner) -> StepBuffers:
    """Step buffers for the drafters' decode-shaped sub-steps (at most one row per running sequence)."""
    sched = runner.config.scheduler
    return StepBuffers(
        max_num_tokens=sched.max_num_seqs,
        max_num_reqs=sched.max_num_seqs,
        table_width=runner.max_blocks_per_seq,
        graph_rows=1,
        device=runner.device,
    )


def substep_forward(
    runner: ModelRunner,
    buffers: StepBuffers,
    plan: StepPlan,
    rows: np.ndarray,
    tok: np.ndarray,
    input_ids: np.ndarray,
    *,
    kv_caches: list[torch.Tensor],
    model: torch.nn.Module | None = None,
    exit_layer: int | None = None,
) -> torch.Tensor:
    """One decode-shaped forward of `model` (default the runner's) over batch rows `rows` of `plan`:
    row i feeds `input_ids[i]` at the position and KV slot of the plan's token `tok[i]`, attending to
    its sequence up to there in `kv_caches`. The final hidden states, one row each."""
    positions = plan.positions[tok].astype(np.int64)
    return varlen_forward(
        runner,
        buffers,
        plan,
        rows,
        input_ids,
        positions,
        plan.slot_mapping[tok].astype(np.int64),
        np.ones(len(rows), dtype=np.int32),
        kv_caches=kv_caches,
        model=model,
        exit_layer=exit_layer,
    )


def varlen_forward(
    runner: ModelRunner,
    buffers: StepBuffers,
    plan: StepPlan,
    rows: np.ndarray,
    input_ids: np.ndarray,
    positions: np.ndarray,
    slot_mapping: np.ndarray,
    query_lens: np.ndarray,
    *,
    kv_caches: list[torch.Tensor],
    model: torch.nn.Module | None = None,
    exit_layer: int | None = None,
) -> torch.Tensor:
    """One forward of `model` (default the runner's) over batch rows `rows` of `plan` with queries of
    their own: row i feeds the next `query_lens[i]` of `input_ids` (int64, flattened) at `positions`
    (consecutive, ending the row's context) and KV `slot_mapping`, through the row's block table into
    `kv_caches`. The final hidden states, one per token."""
    n = len(rows)
    mirror = runner._bt_view if runner._bt_device is not None else None
    dense = None if mirror is not None else plan.block_tables
    qsl = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(query_lens, out=qsl[1:])
    seq_lens = (positions[qsl[1:] - 1] + 1).astype(np.int32)
    num_tokens = int(qsl[-1])
    decode = bool((query_lens == 1).all())
    step = _DraftStep(
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
    )
    inputs = buffers.pack(step, mirror_rows=mirror)  # type: ignore[arg-type]  # a StepPlan's fields
    meta = runner._attn_metadata(step, inputs, int(query_lens.max()), int(seq_lens.max()))  # type: ignore[arg-type]
    ctx = ForwardContext(
        attn_metadata=meta, kv_caches=kv_caches, backend=runner.backend, exit_layer=exit_layer
    )
    net = model if model is not None else runner.model
    return net(inputs.input_ids, inputs.positions, ctx)


class SelfDrafter:
    """Proposes drafts with the runner's own model cut after `num_layers` layers."""

    every_step = False  # runs only in steps with drafts

    def __init__(self, runner: ModelRunner, num_layers: int) -> None:
        total = int(runner.model.num_layers)
        if not 1 <= num_layers <= total:
            raise ValueError(f"draft_layers must be in [1, {total}] for this model, got {num_layers}")
        self.runner = runner
        self.num_layers = num_layers
        self.buffers = substep_buffers(runner)

    @torch.inference_mode()
    def propose(self, plan: StepPlan, main: StepInputs, meta: AttentionMetadata | None = None) -> np.ndarray:
        """The drafts of every speculating sequence of `plan`, flattened in sampled order (the layout of
        `plan.draft_token_ids`); also written into `main.input_ids` at their positions. (`meta`, the
        step's attention metadata, is not used: each sub-step builds its own.)"""
        nd = np.asarray(plan.num_draft_tokens)
        spec = np.nonzero(nd)[0]
        if not len(spec):
            return np.zeros(0, dtype=np.int64)
        runner = self.runner
        pool = runner.kv_pool
        assert pool is not None
        rows, first = speculating_rows(plan, spec)
        counts = nd[spec].astype(np.int64)
        drafts = np.zeros((len(spec), int(counts.max())), dtype=np.int64)
        current = plan.input_ids[first].astype(np.int64)
        for j in range(drafts.shape[1]):
            act = np.nonzero(counts > j)[0]
            tok = first[act] + j
            hidden = substep_forward(
                runner,
                self.buffers,
                plan,
                rows[act],
                tok,
                current[act],
                kv_caches=pool.kv_caches,
                exit_layer=self.num_layers,
            )
            logits = runner.model.compute_logits(hidden)
            assert logits is not None, "self-drafting runs on one rank"
            nxt = logits.argmax(dim=-1)
            main.input_ids.index_copy_(0, torch.as_tensor(tok + 1, device=main.input_ids.device), nxt)
            got = nxt.cpu().numpy()
            drafts[act, j] = got
            current[act] = got
        return np.concatenate([drafts[i, : counts[i]] for i in range(len(spec))])
