"""The verifying half of a speculative step, on the runner's side: which logits rows the plain sampler
reads, and how the speculating sequences' rows become their emitted tokens (`rejection_sampler.py`
decides acceptance)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import Tensor

from pagedrs.layers.sampler import LogprobsTensors, SamplingRow, argmax_logsumexp, compute_token_logprobs
from pagedrs.spec_decode.rejection_sampler import verify_drafts

if TYPE_CHECKING:
    from pagedrs._core import StepPlan

__all__ = ["SampledOutput", "concat_ranges", "first_rows", "greedy_with_drafts", "sample_with_drafts"]


class SampledOutput(Protocol):
    """The fields of the runner's `RunnerOutput` that verification reads and rewrites."""

    sampled_token_ids: np.ndarray
    sampled_logprobs: np.ndarray | None
    logprobs: LogprobsTensors | None
    token_counts: np.ndarray | None


def first_rows(num_draft_tokens: np.ndarray) -> np.ndarray:
    """int64 [S]: each sampled sequence's first logits row (its 1 + d rows are consecutive)."""
    sizes = 1 + np.asarray(num_draft_tokens, dtype=np.int64)
    return np.cumsum(sizes) - sizes


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """int64: `starts[i] .. starts[i] + lengths[i]` for every i, one after the other."""
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(np.asarray(starts, dtype=np.int64), lengths) + offsets


def greedy_with_drafts(out: SampledOutput, plan: StepPlan, logits: Tensor, drafts: np.ndarray) -> None:
    """`sample_with_drafts` for a plan whose every sequence samples greedily with no logit processor, no
    grammar and no top logprobs (a copy-heavy chat at batch 1, say): every row's argmax and logsumexp in
    one call (`argmax_logsumexp`), a speculating sequence's drafts accepted up to the first that differs
    from its row's argmax, then that row's argmax. The same tokens and logprobs as the general path
    (its greedy judge takes the same argmax, its logprobs the same `chosen - logsumexp`), without its
    per-step tensor bookkeeping, which cost about as much as a row of verification on a CPU.

    `logits` holds the plan's rows (each sequence's 1 + d consecutive); `drafts` the drafts in sampled
    order. Sets `out.sampled_token_ids`, `out.sampled_logprobs` and `out.token_counts`."""
    nd = np.asarray(plan.num_draft_tokens, dtype=np.int64)
    ids_t, lse_t = argmax_logsumexp(logits)
    ids = ids_t.cpu().numpy()
    drafts = np.asarray(drafts, dtype=np.int64)
    starts = first_rows(nd)
    # accepted drafts of a sequence: those before its first draft that differs from its row's argmax
    accepted = nd.copy()
    misses = np.flatnonzero(ids[concat_ranges(starts, nd)] != drafts)
    seq_of = np.repeat(np.arange(len(nd)), nd)
    np.minimum.at(accepted, seq_of[misses], misses - (np.cumsum(nd) - nd)[seq_of[misses]])
    counts = (accepted + 1).astype(np.int32)
    # the emitted tokens of a sequence are its rows' argmaxes: an accepted draft equals its row's
    rows = concat_ranges(starts, counts)
    rows_t = torch.as_tensor(rows, device=logits.device)
    chosen = logits.index_select(0, rows_t).gather(-1, ids_t[rows_t].view(-1, 1)).squeeze(-1).float()
    out.sampled_token_ids = ids[rows]
    out.sampled_logprobs = (chosen - lse_t[rows_t]).cpu().numpy().astype(np.float32, copy=False)
    out.token_counts = counts


def sample_with_drafts(
    out: SampledOutput,
    plan: StepPlan,
    rows: Sequence[SamplingRow],
    logits: Tensor,
    drafts: np.ndarray,
    default_generator: torch.Generator | None,
    draft_probs: Tensor | None = None,
) -> None:
    """Replace the speculating sequences' sampled token in `out` with their verified tokens (accepted
    drafts, then one more) and set `out.token_counts`; the other sequences keep their one token.
    `draft_probs` [drafts, V' <= V]: the distribution each draft was sampled from (a draft model's
    sampled drafts; rows of deterministic drafts unused), None: every draft deterministic.

    `logits` holds the plan's logits rows (each sequence's 1 + d rows consecutive); `drafts` the drafts in
    sampled order. The sampler already drew row 0 of every sequence (a speculating sequence's draw is
    discarded, which keeps the per-sequence seeded streams deterministic)."""
    nd = np.asarray(plan.num_draft_tokens, dtype=np.int64)
    spec = np.nonzero(nd)[0]
    starts = first_rows(nd)
    idx = concat_ranges(starts[spec], 1 + nd[spec])
    params = [rows[int(i)].params for i in spec]
    vocab = logits.shape[-1]
    drafts = np.asarray(drafts, dtype=np.int64)
    spec_logits = logits.index_select(0, torch.as_tensor(idx, device=logits.device))
    matchers = [getattr(rows[int(i)], "matcher", None) for i in spec]
    if any(m is not None for m in matchers):
        _mask_by_grammar(spec_logits, nd[spec], drafts, matchers)
    res = verify_drafts(
        spec_logits,
        nd[spec],
        drafts,
        np.array([p.temperature for p in params], dtype=np.float32),
        np.array([p.top_k if p.top_k > 0 else vocab for p in params], dtype=np.int64),
        np.array([p.top_p for p in params], dtype=np.float32),
        np.array([p.min_p for p in params], dtype=np.float32),
        [rows[int(i)].generator for i in spec],
        default_generator,
        None
        if draft_probs is None
        else torch.nn.functional.pad(draft_probs, (0, vocab - draft_probs.shape[1])),
    )
    counts = np.ones(len(nd), dtype=np.int32)
    counts[spec] = res.counts
    tokens = np.empty(int(counts.sum()), dtype=np.int64)
    lps = np.zeros(len(tokens), dtype=np.float32)
    at_out = np.cumsum(counts) - counts
    plain = np.nonzero(nd == 0)[0]
    tokens[at_out[plain]] = out.sampled_token_ids[plain]
    if out.sampled_logprobs is not None:
        lps[at_out[plain]] = out.sampled_logprobs[plain]
    at_res = 0
    for i in spec:
        c = int(counts[i])
        tokens[at_out[i] : at_out[i] + c] = res.token_ids[at_res : at_res + c]
        lps[at_out[i] : at_out[i] + c] = res.logprobs[at_res : at_res + c]
        at_res += c
    if out.logprobs is not None:
        out.logprobs = _token_layout_logprobs(out.logprobs, spec_logits, nd, spec, counts, tokens, at_out)
    out.sampled_token_ids = tokens
    out.sampled_logprobs = lps
    out.token_counts = counts


def _token_layout_logprobs(
    lp: LogprobsTensors,
    spec_logits: Tensor,
    nd: np.ndarray,
    spec: np.ndarray,
    counts: np.ndarray,
    tokens: np.ndarray,
    at_out: np.ndarray,
) -> LogprobsTensors:
    """The top-k logprobs one row per emitted token (the layout of the new `sampled_token_ids`): a plain
    sequence keeps its sampler row; a speculating sequence's token j gets the raw logprobs of its
    verification row j (the row it was accepted or drawn from, grammar mask applied, as the sampler
    reports them), so they equal those of the same token decoded without speculation."""
    width = lp.token_ids.shape[1]
    n = len(tokens)
    ids = torch.zeros(n, width, dtype=lp.token_ids.dtype)
    vals = torch.zeros(n, width, dtype=lp.logprobs.dtype)
    ranks = torch.zeros(n, dtype=lp.ranks.dtype)
    plain = torch.as_tensor(np.nonzero(nd == 0)[0])
    dest = torch.as_tensor(at_out[nd == 0])
    ids[dest], vals[dest], ranks[dest] = lp.token_ids[plain], lp.logprobs[plain], lp.ranks[plain]
    if len(spec):
        # every speculating sequence's first counts[i] verification rows, in one log-softmax
        spec_counts = counts[spec].astype(np.int64)
        starts = np.cumsum(1 + nd[spec]) - (1 + nd[spec])
        src = np.concatenate([np.arange(st, st + c) for st, c in zip(starts, spec_counts, strict=True)])
        dst = np.concatenate([np.arange(at_out[i], at_out[i] + counts[i]) for i in spec])
        raw = (
            spec_logits.index_select(0, torch.as_tensor(src, device=spec_logits.device))
            .float()
            .log_softmax(-1)
        )
        got = compute_token_logprobs(raw, torch.as_tensor(tokens[dst], device=raw.device), width - 1)
        where = torch.as_tensor(dst)
        ids[where] = got.token_ids.cpu()
        vals[where] = got.logprobs.cpu().to(vals.dtype)
        ranks[where] = got.ranks.cpu()
    return LogprobsTensors(token_ids=ids, logprobs=vals, ranks=ranks)


def _mask_by_grammar(logits: Tensor, nd: np.ndarray, drafts: np.ndarray, matchers: Sequence[Any]) -> None:
    """Limit each constrained sequence's rows to the tokens its grammar allows after the drafts before
    them: row j gets the mask of the state after drafts 0..j-1. A draft the grammar rejects gets
    probability 0 in its row, so verification cuts the proposal there (the rows after it are never read;
    they keep the mask of the rejecting state). The matcher is rolled back: the core advances it by the
    tokens actually emitted."""
    import xgrammar as xgr

    vocab = logits.shape[-1]
    row = 0
    at = 0
    for i, m in enumerate(matchers):
        d = int(nd[i])
        if m is not None:
            mask = xgr.allocate_token_bitmask(d + 1, vocab)
            advanced = 0
            for j in range(d + 1):
                m.fill_next_token_bitmask(mask, j)
                if j == d or not m.accept_token(int(drafts[at + j])):
                    mask[j + 1 :] = mask[j]
                    break
                advanced += 1
            if advanced:
                m.rollback(advanced)
            xgr.apply_token_bitmask_inplace(
                logits[row : row + d + 1], mask.to(logits.device), vocab_size=vocab
            )
        row += d + 1
        at += d
