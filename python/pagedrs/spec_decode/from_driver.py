"""The drafts of a tensor-parallel rank other than 0: a drafter that runs in the runner runs whole on rank
0 (vLLM's draft_tensor_parallel_size=1), whose runner broadcasts its drafts before the step's forward;
every other rank takes them here and feeds them to its shard of the target where rank 0 did."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from pagedrs.spec_decode.interface import DrafterContext, Proposal, StepContext
from pagedrs.spec_decode.substep import speculating_rows
from pagedrs.spec_decode.verifier import concat_ranges

if TYPE_CHECKING:
    from pagedrs._core import StepPlan

__all__ = ["DriverDrafts"]


class DriverDrafts:
    """Rank 0's drafts, received by broadcast in each step with drafts."""

    scheduler_method: ClassVar[str] = "runner"
    default_disable_by_batch_size: ClassVar[int] = 1  # unused: the engine core runs on rank 0
    kv_bytes_per_block = 0  # a draft model's pool lives on rank 0 only

    def __init__(self, context: DrafterContext) -> None:
        self.tp = context.tp

    def init_kv_cache(self, num_blocks: int, num_swap_blocks: int) -> None:
        pass

    def apply_plan_ops(self, plan: StepPlan) -> None:
        pass

    def apply_plan_shrink(self, plan: StepPlan) -> None:
        pass

    def runs(self, plan: StepPlan) -> bool:
        return bool(plan.has_drafts)

    def propose(self, step: StepContext) -> Proposal:
        """Rank 0's drafts of this step (sampled order) into `step.inputs.input_ids`, where rank 0's
        drafter wrote them (draft j of a sequence right after its last token, at j + 1)."""
        plan = step.plan
        nd = np.asarray(plan.num_draft_tokens, dtype=np.int64)
        drafts = self.tp.broadcast_cpu(torch.empty(int(nd.sum()), dtype=torch.int64))
        spec = np.nonzero(nd)[0]
        _, first = speculating_rows(plan, spec)
        where = concat_ranges(first + 1, nd[spec])
        ids = step.inputs.input_ids
        ids.index_copy_(0, torch.as_tensor(where, device=ids.device), drafts.to(ids.device))
        return Proposal(drafts.numpy())
