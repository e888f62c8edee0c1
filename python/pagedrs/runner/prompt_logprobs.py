"""Prompt logprobs: which hidden rows of a step score which prompt tokens, and their logprobs.

Position p's logits predict prompt token p + 1; a sequence whose prompt logprobs are wanted contributes
the rows of the prompt positions scheduled this step (after the sampled rows' logits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from pagedrs.layers.sampler import compute_token_logprobs

if TYPE_CHECKING:
    from pagedrs._core import StepPlan

__all__ = [
    "PromptLogprobsChunk",
    "PromptLogprobsPlan",
    "PromptSpan",
    "compute_prompt_logprobs",
    "plan_prompt_logprobs",
]


@dataclass
class PromptLogprobsChunk:
    """Prompt logprobs computed this step for one sequence: positions start..start+n-1 of the prompt, each
    the logprob of that prompt token given the tokens before it."""

    start: int
    token_ids: np.ndarray  # [n, 1 + k] the prompt token, then the top-k
    logprobs: np.ndarray  # [n, 1 + k]
    ranks: np.ndarray  # [n]


@dataclass
class PromptSpan:
    """One sequence's prompt positions scored this step: targets = prompt[start : start + n]."""

    seq_id: int
    start: int
    k: int
    targets: np.ndarray  # int64 [n]


@dataclass
class PromptLogprobsPlan:
    """The hidden rows whose logits give this step's prompt logprobs (after the sampled rows' logits),
    span by span."""

    indices: np.ndarray  # int64, concatenated over spans
    spans: list[PromptSpan]


def plan_prompt_logprobs(
    plan: StepPlan, wanted: dict[int, tuple[int, Sequence[int]]] | None
) -> PromptLogprobsPlan | None:
    """Which hidden rows of `plan` give this step's prompt logprobs; `wanted` maps a seq id
    to (top-k, prompt token ids)."""
    if not wanted:
        return None
    idx: list[np.ndarray] = []
    spans: list[PromptSpan] = []
    qsl = plan.query_start_loc
    computed = plan.num_computed_tokens
    seq_lens = plan.seq_lens
    for b, seq_id in enumerate(plan.req_ids.tolist()):
        if seq_id not in wanted:
            continue
        k, prompt = wanted[seq_id]
        start, end = int(computed[b]), min(int(seq_lens[b]), len(prompt) - 1)
        if end <= start:
            continue
        first = int(qsl[b])
        idx.append(np.arange(first, first + (end - start), dtype=np.int64))
        targets = np.asarray(prompt[start + 1 : end + 1], dtype=np.int64)
        spans.append(PromptSpan(seq_id, start + 1, k, targets))
    if not spans:
        return None
    return PromptLogprobsPlan(np.concatenate(idx), spans)


def compute_prompt_logprobs(logits: Tensor, plp: PromptLogprobsPlan) -> dict[int, PromptLogprobsChunk]:
    """`logits`: the rows of `plp.indices`, span after span."""
    result: dict[int, PromptLogprobsChunk] = {}
    offset = 0
    for span in plp.spans:
        n = len(span.targets)
        logprobs = logits[offset : offset + n].log_softmax(dim=-1)
        offset += n
        targets = torch.from_numpy(span.targets).to(logprobs.device)
        lp = compute_token_logprobs(logprobs, targets, min(span.k, logprobs.shape[-1]))
        result[span.seq_id] = PromptLogprobsChunk(
            start=span.start,
            token_ids=lp.token_ids.cpu().numpy(),
            logprobs=lp.logprobs.cpu().numpy(),
            ranks=lp.ranks.cpu().numpy(),
        )
    return result
