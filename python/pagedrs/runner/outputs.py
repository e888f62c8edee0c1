"""What the model runner hands back: a step's forward (`Forward`, every rank) and its sampled result
(`RunnerOutput`, rank 0), read by the executor, the engine core and the speculative verifier."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import Tensor

from pagedrs.layers.sampler import LogprobsTensors
from pagedrs.runner.prompt_logprobs import PromptLogprobsChunk, PromptLogprobsPlan

__all__ = ["Forward", "RunnerOutput"]


@dataclass
class Forward:
    """What a step's forward left for sampling (rank 0)."""

    logits: Tensor | None  # rows of plan.logits_indices, then the prompt-logprob rows
    prompt_logprobs: PromptLogprobsPlan | None
    hidden: Tensor | None  # the final hidden states [T, H]


@dataclass
class RunnerOutput:
    sampled_token_ids: np.ndarray  # int64 [S], row i for plan.sampled_seq_ids[i]
    logprobs: LogprobsTensors | None  # CPU tensors, [S, 1 + k]
    prompt_logprobs: dict[int, PromptLogprobsChunk]
    sampled_logprobs: np.ndarray | None = None  # float32 [S]: each sampled token's raw logprob
    hidden: Tensor | None = None  # the step's final hidden states [T, H] (pooled for embedding requests)
    # A plan with drafts: int32 [S] tokens emitted per sampled sequence (accepted drafts, then one more);
    # sampled_token_ids and sampled_logprobs are then flat in that layout. None: one token each.
    token_counts: np.ndarray | None = None
