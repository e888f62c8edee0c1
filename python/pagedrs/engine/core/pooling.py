"""Embedding requests: what each pooling type needs from a step's final hidden states, accumulated over
the prompt's chunks, and the finished vector of each request whose prompt ends in the step."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedrs._core import StepPlan
from pagedrs.engine.core.requests import CoreRequest

__all__ = ["pool_step"]


def pool_step(
    plan: StepPlan, hidden: torch.Tensor | None, request_of: Callable[[int], CoreRequest | None]
) -> dict[int, list[float]]:
    """Seq id -> pooled vector for the embedding requests whose prompt ends in `plan`; the others in the
    plan accumulate (mean) or keep (first / cls) what their pooling needs. `request_of(seq_id)` gives a
    sequence's request (None once it is gone)."""
    done: dict[int, list[float]] = {}
    if hidden is None:
        return done
    qsl = plan.query_start_loc.tolist()
    computed = plan.num_computed_tokens.tolist()
    sched = plan.num_scheduled_tokens.tolist()
    prompt = plan.num_prompt_tokens.tolist()
    for b, sid in enumerate(plan.req_ids.tolist()):
        req = request_of(sid)
        if req is None or req.pooling is None:
            continue
        c, n, p, start = computed[b], sched[b], prompt[b], qsl[b]
        kind = req.pooling.pooling_type
        if kind == "mean":
            lo, hi = max(req.pool_n, c), c + n  # positions recomputed after a preemption count once
            if hi > lo:
                part = hidden[start + lo - c : start + hi - c].float().sum(dim=0)
                req.pool_acc = part if req.pool_acc is None else req.pool_acc + part
                req.pool_n = hi
        elif kind in ("cls", "first") and c == 0:
            req.pool_acc = hidden[start].float()
        if c + n < p:
            continue
        if kind == "last":
            vec = hidden[start + n - 1].float()
        else:
            assert req.pool_acc is not None, "mean / first pooling saw the prompt's first chunk"
            vec = req.pool_acc / p if kind == "mean" else req.pool_acc
        vec = vec.cpu()
        if req.pooling.dimensions is not None:
            vec = vec[: req.pooling.dimensions]
        if req.pooling.normalize:
            vec = torch.nn.functional.normalize(vec, dim=0)
        done[sid] = vec.tolist()
    return done
