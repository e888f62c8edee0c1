"""Self-drafting by early exit: the target model's first L layers, its final norm and its LM head propose
the drafts of speculative decoding, inside the step that verifies them.

The scheduler reserves `1 + d` query slots for a speculating sequence (its last token, then `d` draft
placeholders). Before the step's forward, the drafter runs `d` decode-shaped sub-forwards over the
speculating sequences only: sub-step `j` feeds the token at position `nc + j` (the last token, then the
previous draft), through layers `[0, L)`, and takes the argmax as draft `j + 1`. Those sub-forwards write
the KV of layers `[0, L)` at the same slots the verifying forward then writes again for the same tokens,
so no second KV pool exists and nothing has to be rolled back: the draft's context is the target's own
cache. The drafts are written into the step's device inputs, and go to the verifier as the proposal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from pagedrs.spec_decode.interface import DrafterContext, Proposal, StepContext
from pagedrs.spec_decode.substep import speculating_rows, substep_forward

if TYPE_CHECKING:
    from pagedrs._core import StepPlan

__all__ = ["SelfDrafter", "default_draft_layers"]


def default_draft_layers(num_layers: int) -> int:
    """A quarter of the layers (at least one, fewer than all)."""
    return max(1, min(num_layers - 1, num_layers // 4)) if num_layers > 1 else 1


class SelfDrafter:
    """Proposes drafts with the target model cut after `num_layers` layers (default: the config's
    `draft_layers`, else `default_draft_layers`)."""

    scheduler_method: ClassVar[str] = "runner"
    # Early exit did not pay at any batch size on the 2-core CPU with the default model
    # (bench/spec_decode.py, 4 drafts): batch 1 only.
    default_disable_by_batch_size: ClassVar[int] = 1
    kv_bytes_per_block = 0  # writes the target's own KV, in place

    def __init__(self, context: DrafterContext, num_layers: int | None = None) -> None:
        total = int(context.target.num_layers)
        if num_layers is None:
            spec = context.config.speculative
            num_layers = (spec.draft_layers if spec is not None else None) or default_draft_layers(total)
        if not 1 <= num_layers <= total:
            raise ValueError(f"draft_layers must be in [1, {total}] for this model, got {num_layers}")
        self.context = context
        self.num_layers = num_layers
        self.buffers = context.new_substep_buffers()

    def init_kv_cache(self, num_blocks: int, num_swap_blocks: int) -> None:
        pass

    def apply_plan_ops(self, plan: StepPlan) -> None:
        pass

    def apply_plan_shrink(self, plan: StepPlan) -> None:
        pass

    def runs(self, plan: StepPlan) -> bool:
        return bool(plan.has_drafts)  # runs only in steps with drafts

    @torch.inference_mode()
    def propose(self, step: StepContext) -> Proposal:
        """The drafts of every speculating sequence of the step, flattened in sampled order (the layout of
        `plan.draft_token_ids`); also written into `step.inputs.input_ids` at their positions. (The
        step's attention metadata is not used: each sub-step builds its own.)"""
        plan, main = step.plan, step.inputs
        nd = np.asarray(plan.num_draft_tokens)
        spec = np.nonzero(nd)[0]
        if not len(spec):
            return Proposal(np.zeros(0, dtype=np.int64))
        target = self.context.target
        rows, first = speculating_rows(plan, spec)
        counts = nd[spec].astype(np.int64)
        drafts = np.zeros((len(spec), int(counts.max())), dtype=np.int64)
        current = plan.input_ids[first].astype(np.int64)
        for j in range(drafts.shape[1]):
            act = np.nonzero(counts > j)[0]
            tok = first[act] + j
            hidden = substep_forward(
                self.context,
                step,
                self.buffers,
                rows[act],
                tok,
                current[act],
                kv_caches=step.kv_caches,
                exit_layer=self.num_layers,
            )
            logits = target.compute_logits(hidden)
            assert logits is not None, "self-drafting runs on one rank"
            nxt = logits.argmax(dim=-1)
            main.input_ids.index_copy_(0, torch.as_tensor(tok + 1, device=main.input_ids.device), nxt)
            got = nxt.cpu().numpy()
            drafts[act, j] = got
            current[act] = got
        return Proposal(np.concatenate([drafts[i, : counts[i]] for i in range(len(spec))]))
