"""Verification of speculative drafts: lossless acceptance (Leviathan et al. 2023, Chen et al. 2023).

Matches vLLM's rejection sampler. Sequence i owns 1 + num_drafts[i] consecutive logits rows; row j
predicts the token after draft j (row 0: after the last real token).
  greedy sequences (temperature < GREEDY_EPS): a = the number of leading drafts equal to their row's
     argmax; emit drafts[:a], then the argmax of row a (token for token what plain greedy decoding gives).
  random sequences: p_j = row j / temperature -> min_p -> top-k -> top-p -> softmax, as the Sampler does;
     q_j = the draft distribution (a point mass at the draft when `draft_probs` is None). Draft d_j is
     accepted when u_j * q_j(d_j) < p_j(d_j), u_j ~ U[0, 1) (probability min(1, p/q)); at the first
     rejection the sequence emits a sample of norm(max(p_j - q_j, 0)) and stops; when every draft is
     accepted it emits a sample of the last row's p as the bonus token. The emitted tokens are then
     distributed exactly as the target's.
The categorical sample is the Sampler's exponential race argmax(w / E), E ~ Exp(1) over the vocabulary.
A seeded sequence draws from its own generator only, always num_drafts uniforms then one vocab-sized E,
whatever is accepted: its tokens do not depend on the batch, and with no drafts they are the Sampler's.
Unseeded sequences draw from `default_generator` (torch's global RNG when None).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from pagedrs.layers.sampler import (
    GREEDY_EPS,
    apply_min_p,
    apply_top_k_top_p,
    argmax_logsumexp,
    sampled_token_logprobs,
)

__all__ = ["SpecVerifyResult", "sampling_probs", "verify_drafts"]


@dataclass
class SpecVerifyResult:
    """Per sequence, in order: the accepted drafts then one more token (flat), and how many that is."""

    token_ids: np.ndarray  # int64, flat
    counts: np.ndarray  # int32 [S]: 1 + accepted drafts
    logprobs: np.ndarray  # float32, flat like token_ids: raw log_softmax of the row that predicted each


@dataclass(frozen=True)
class _Layout:
    """Where each sequence's rows and drafts lie in the flat inputs."""

    num_drafts: np.ndarray  # int64 [S]
    row_starts: np.ndarray  # int64 [S]: first logits row of each sequence
    draft_starts: np.ndarray  # int64 [S]: first draft of each sequence in draft_token_ids
    draft_seq: np.ndarray  # int64 [D]: the sequence each draft belongs to
    draft_rows: np.ndarray  # int64 [D]: the logits row that judges each draft


def verify_drafts(
    logits: Tensor,
    num_drafts: np.ndarray,
    draft_token_ids: np.ndarray,
    temperature: np.ndarray,
    top_k: np.ndarray | None,
    top_p: np.ndarray | None,
    min_p: np.ndarray | None,
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
    draft_probs: Tensor | None = None,
) -> SpecVerifyResult:
    """Accept or reject each sequence's drafts against the target logits [R, V] (module docstring).

    `top_k` <= 0 or >= V is off; `draft_probs` [sum(num_drafts), V]: the distribution each draft was
    sampled from (None: deterministic drafts). Raises ValueError on inconsistent shapes or ids."""
    layout = _check_inputs(
        logits, num_drafts, draft_token_ids, temperature, top_k, top_p, min_p, generators, draft_probs
    )
    logits = logits.float()
    device, vocab_size = logits.device, logits.shape[1]
    drafts = np.asarray(draft_token_ids, dtype=np.int64)
    is_random = np.asarray(temperature, dtype=np.float32) >= GREEDY_EPS
    accepted = np.zeros(len(drafts), dtype=bool)
    final = np.zeros(len(layout.num_drafts), dtype=np.int64)

    greedy_seqs = np.flatnonzero(~is_random)
    greedy_argmax = _judge_greedy(logits, layout, drafts, greedy_seqs, accepted)
    random_seqs = np.flatnonzero(is_random)
    if len(random_seqs):
        rows = _rows_of(random_seqs, layout)
        probs = _target_probs(logits, rows, layout, temperature, top_k, top_p, min_p)
        row_pos = np.full(logits.shape[0], -1, dtype=np.int64)
        row_pos[rows] = np.arange(len(rows))
        random_drafts = np.flatnonzero(is_random[layout.draft_seq])
        uniforms, race = _draws(random_seqs, layout, generators, default_generator, vocab_size, device)
        draft_ids = torch.from_numpy(drafts[random_drafts]).to(device)
        p_draft = probs[_on(row_pos[layout.draft_rows[random_drafts]], device), draft_ids]
        q_draft = None
        if draft_probs is not None:
            q_draft = draft_probs.float()[_on(random_drafts, device), draft_ids]
        accepted[random_drafts] = _accept_mask(uniforms, p_draft, q_draft).cpu().numpy()

    num_accepted = _num_accepted(accepted, layout)
    final_rows = layout.row_starts + num_accepted
    final[greedy_seqs] = greedy_argmax[final_rows[greedy_seqs]]
    if len(random_seqs):
        p_final = probs.index_select(0, _on(row_pos[final_rows[random_seqs]], device))
        rejected = np.flatnonzero(num_accepted[random_seqs] < layout.num_drafts[random_seqs])
        rejected_drafts = layout.draft_starts[random_seqs[rejected]] + num_accepted[random_seqs[rejected]]
        weights = _recovered_weights(
            p_final,
            _on(rejected, device),
            torch.from_numpy(drafts[rejected_drafts]).to(device),
            None
            if draft_probs is None
            else draft_probs.float().index_select(0, _on(rejected_drafts, device)),
        )
        final[random_seqs] = weights.div_(race).argmax(dim=-1).cpu().numpy()
    return _emit(logits, layout, drafts, num_accepted, final)


def _check_inputs(
    logits: Tensor,
    num_drafts: np.ndarray,
    draft_token_ids: np.ndarray,
    temperature: np.ndarray,
    top_k: np.ndarray | None,
    top_p: np.ndarray | None,
    min_p: np.ndarray | None,
    generators: Sequence[torch.Generator | None],
    draft_probs: Tensor | None,
) -> _Layout:
    """The caller-error checks, one per argument, then the row / draft layout they imply."""
    if logits.ndim != 2 or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a float [rows, vocab] tensor, got {logits.dtype} {tuple(logits.shape)}"
        )
    n = np.asarray(num_drafts)
    if n.ndim != 1 or not np.issubdtype(n.dtype, np.integer):
        raise ValueError(f"num_drafts must be a 1-D integer array, got {n.dtype} {n.shape}")
    if (n < 0).any():
        raise ValueError(f"num_drafts must be >= 0, got {n.tolist()}")
    n = n.astype(np.int64)
    num_seqs, num_rows, vocab_size = len(n), int(n.sum()) + len(n), logits.shape[1]
    if logits.shape[0] != num_rows:
        raise ValueError(f"logits has {logits.shape[0]} rows, num_drafts {n.tolist()} needs {num_rows}")
    drafts = np.asarray(draft_token_ids)
    if drafts.shape != (num_rows - num_seqs,):
        raise ValueError(
            f"draft_token_ids has shape {drafts.shape}, num_drafts needs ({num_rows - num_seqs},)"
        )
    if len(drafts) and (drafts.min() < 0 or drafts.max() >= vocab_size):
        bad = drafts[(drafts < 0) | (drafts >= vocab_size)]
        raise ValueError(f"draft token id {int(bad[0])} is outside the vocabulary [0, {vocab_size})")
    for name, values in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        if values is not None and np.shape(values) != (num_seqs,):
            raise ValueError(f"{name} has shape {np.shape(values)}, expected ({num_seqs},)")
    if len(generators) != num_seqs:
        raise ValueError(f"{len(generators)} generators for {num_seqs} sequences")
    if draft_probs is not None and tuple(draft_probs.shape) != (num_rows - num_seqs, vocab_size):
        raise ValueError(
            f"draft_probs has shape {tuple(draft_probs.shape)}, expected ({num_rows - num_seqs}, {vocab_size})"
        )
    row_starts = np.cumsum(n + 1) - (n + 1)
    draft_starts = np.cumsum(n) - n
    draft_seq = np.repeat(np.arange(num_seqs), n)
    local = np.arange(len(drafts)) - draft_starts[draft_seq]
    return _Layout(n, row_starts, draft_starts, draft_seq, row_starts[draft_seq] + local)


def _on(index: np.ndarray, device: torch.device) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64)).to(device)


def _index_rows(logits: Tensor, rows: np.ndarray) -> Tensor:
    """logits[rows] for ascending, distinct rows (so as many as logits has: all of them, uncopied)."""
    return logits if len(rows) == logits.shape[0] else logits.index_select(0, _on(rows, logits.device))


def _rows_of(seqs: np.ndarray, layout: _Layout) -> np.ndarray:
    """Every logits row of `seqs` (ascending sequence ids), in order."""
    sizes = layout.num_drafts[seqs] + 1
    offsets = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    return np.repeat(layout.row_starts[seqs], sizes) + offsets


def _judge_greedy(
    logits: Tensor, layout: _Layout, drafts: np.ndarray, greedy_seqs: np.ndarray, accepted: np.ndarray
) -> np.ndarray:
    """Mark in `accepted` the greedy sequences' drafts that equal their row's argmax; return the argmax
    per logits row (-1 on the rows of other sequences)."""
    argmax = np.full(logits.shape[0], -1, dtype=np.int64)
    if len(greedy_seqs):
        rows = _rows_of(greedy_seqs, layout)
        argmax[rows] = argmax_logsumexp(_index_rows(logits, rows))[0].cpu().numpy()
        greedy_drafts = np.flatnonzero(np.isin(layout.draft_seq, greedy_seqs))
        accepted[greedy_drafts] = argmax[layout.draft_rows[greedy_drafts]] == drafts[greedy_drafts]
    return argmax


def _target_probs(
    logits: Tensor,
    rows: np.ndarray,
    layout: _Layout,
    temperature: np.ndarray,
    top_k: np.ndarray | None,
    top_p: np.ndarray | None,
    min_p: np.ndarray | None,
) -> Tensor:
    """softmax(top-k/top-p(min_p(row / temperature))) of `rows`, each with its sequence's parameters."""
    row_seq = np.repeat(np.arange(len(layout.num_drafts)), layout.num_drafts + 1)[rows]

    def per_row(values: np.ndarray | None) -> np.ndarray | None:
        return None if values is None else np.asarray(values)[row_seq]

    temps = np.asarray(temperature)[row_seq]
    return sampling_probs(_index_rows(logits, rows), temps, per_row(top_k), per_row(top_p), per_row(min_p))


def sampling_probs(
    logits: Tensor,
    temperature: np.ndarray,
    top_k: np.ndarray | None = None,
    top_p: np.ndarray | None = None,
    min_p: np.ndarray | None = None,
) -> Tensor:
    """The distribution the Sampler draws row i of `logits` [n, V] from: softmax(top-k/top-p(min_p(row /
    temperature[i]))), each parameter per row (top_k <= 0 or >= V: off). Temperatures must be > 0."""
    device, vocab_size = logits.device, logits.shape[1]

    def on(values: np.ndarray, dtype: npt.DTypeLike) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(values, dtype=dtype)).to(device)

    x = logits.float() / on(temperature, np.float32).unsqueeze(1)
    if min_p is not None and (np.asarray(min_p) > 0).any():
        x = apply_min_p(x, on(min_p, np.float32))
    k, k_max = None, None
    if top_k is not None:
        k_host = np.asarray(top_k, dtype=np.int64)
        k_host = np.where((k_host <= 0) | (k_host >= vocab_size), vocab_size, k_host)
        if (k_host < vocab_size).any():
            k = on(k_host, np.int64)
            k_max = int(k_host[k_host < vocab_size].max())
    p = None
    if top_p is not None and (np.asarray(top_p) < 1.0).any():
        p = on(top_p, np.float32)
    return apply_top_k_top_p(x, k, p, k_max=k_max).softmax(dim=-1)


def _draws(
    seqs: np.ndarray,
    layout: _Layout,
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None,
    vocab_size: int,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """U[0, 1) per draft of `seqs` (flat, in order) and Exp(1) [len(seqs), V] for their last token.
    A seeded sequence draws its uniforms, then its exponentials, from its own generator."""
    n = layout.num_drafts[seqs]
    uniforms = torch.empty(int(n.sum()), device=device)
    race = torch.empty(len(seqs), vocab_size, device=device)
    seeded = np.array([generators[s] is not None for s in seqs], dtype=bool)
    uniform_seeded = np.repeat(seeded, n)
    if not seeded.all():
        uniforms[_on(np.flatnonzero(~uniform_seeded), device)] = torch.rand(
            int(n[~seeded].sum()), device=device, generator=default_generator
        )
        race[_on(np.flatnonzero(~seeded), device)] = torch.empty(
            int((~seeded).sum()), vocab_size, device=device
        ).exponential_(generator=default_generator)
    starts = np.cumsum(n) - n
    for j in np.flatnonzero(seeded):
        gen = generators[seqs[j]]
        uniforms[starts[j] : starts[j] + n[j]] = torch.rand(int(n[j]), device=device, generator=gen)
        race[j].exponential_(generator=gen)
    return uniforms, race


def _accept_mask(uniforms: Tensor, p_draft: Tensor, q_draft: Tensor | None) -> Tensor:
    """u < min(1, p / q), written u * q < p so that q = 0 needs no division (q None: a point mass)."""
    return uniforms < p_draft if q_draft is None else uniforms * q_draft < p_draft


def _num_accepted(accepted: np.ndarray, layout: _Layout) -> np.ndarray:
    """Per sequence: the length of the leading run of accepted drafts."""
    num_accepted = layout.num_drafts.copy()
    rejects = np.flatnonzero(~accepted)
    seqs = layout.draft_seq[rejects]
    np.minimum.at(num_accepted, seqs, rejects - layout.draft_starts[seqs])
    return num_accepted


def _recovered_weights(
    p_final: Tensor, rejected: Tensor, rejected_ids: Tensor, rejected_q: Tensor | None
) -> Tensor:
    """The distribution each sequence's last token is drawn from (unnormalised): p of its final row, or
    max(p - q, 0) where that row rejected its draft (q None: p with the draft's mass removed).
    A residual with no mass left (p <= q everywhere, only by rounding) falls back to p."""
    weights = p_final.clone()
    if len(rejected) == 0:
        return weights
    if rejected_q is None:
        weights[rejected, rejected_ids] = 0.0
    else:
        weights[rejected] = (weights[rejected] - rejected_q).clamp_(min=0.0)
    empty = weights.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, p_final, weights)


def _emit(
    logits: Tensor, layout: _Layout, drafts: np.ndarray, num_accepted: np.ndarray, final: np.ndarray
) -> SpecVerifyResult:
    """Flatten each sequence's accepted drafts + final token, with the raw logprob of each."""
    counts = num_accepted + 1
    out_starts = np.cumsum(counts) - counts
    out_seq = np.repeat(np.arange(len(counts)), counts)
    local = np.arange(int(counts.sum())) - out_starts[out_seq]
    token_ids = np.empty(len(local), dtype=np.int64)
    is_draft = local < num_accepted[out_seq]
    token_ids[is_draft] = drafts[layout.draft_starts[out_seq[is_draft]] + local[is_draft]]
    token_ids[~is_draft] = final
    rows = layout.row_starts[out_seq] + local
    logprobs = sampled_token_logprobs(
        _index_rows(logits, rows), torch.from_numpy(token_ids).to(logits.device)
    )
    return SpecVerifyResult(
        token_ids=token_ids,
        counts=counts.astype(np.int32),
        logprobs=logprobs.cpu().numpy().astype(np.float32),
    )
