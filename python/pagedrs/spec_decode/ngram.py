"""N-gram drafts (vLLM's "ngram" method, prompt lookup): the Rust scheduler proposes them itself, the
tokens that followed the latest earlier occurrence of a sequence's last n tokens, and they come in the
plan (`plan.draft_token_ids`, `rust/pagedrs-core`); the runner's side has nothing to run."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import numpy as np

from pagedrs.spec_decode.interface import DrafterContext, Proposal, StepContext

if TYPE_CHECKING:
    from pagedrs._core import StepPlan

__all__ = ["NgramDrafter"]


class NgramDrafter:
    """The plan's own drafts: `propose` is never needed (`runs` is False), and would return them."""

    scheduler_method: ClassVar[str] = "ngram"
    # On the 2-core CPU with the default model (bench/spec_decode.py, 4 drafts): 1.56x / 1.34x /
    # 1.25-1.39x / 1.33x / 1.22x at batch 1 / 2 / 4 / 8 / 16 on answers that repeat their prompt, and
    # 1.21x / 1.17x / 0.95x at batch 4 / 8 / 16 on answers continued past their end (`--ignore-eos`,
    # mostly invented text): on at up to 8.
    default_disable_by_batch_size: ClassVar[int] = 8
    kv_bytes_per_block = 0

    def __init__(self, context: DrafterContext) -> None:
        pass

    def init_kv_cache(self, num_blocks: int, num_swap_blocks: int) -> None:
        pass

    def apply_plan_ops(self, plan: StepPlan) -> None:
        pass

    def apply_plan_shrink(self, plan: StepPlan) -> None:
        pass

    def runs(self, plan: StepPlan) -> bool:
        return False

    def propose(self, step: StepContext) -> Proposal:
        return Proposal(np.asarray(step.plan.draft_token_ids, dtype=np.int64))
