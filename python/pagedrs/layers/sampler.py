"""The batched sampler: one row of logits per sampled sequence -> one token id each (+ logprobs).

Order and definitions follow vLLM V1:
  raw logprobs (log-softmax of the model's logits, what `logprobs` reports)
  -> logit_bias, min_tokens (stop tokens masked until min_tokens outputs)
  -> penalties: repetition (prompt + output tokens: positive logits / p, negative * p),
     frequency (- f * count in output), presence (- p * [count > 0])
  -> greedy rows: argmax; random rows: / temperature -> min_p -> top-k -> top-p
     -> exponential race argmax(probs / q), q ~ Exp(1) drawn from the row's own generator when seeded.
A seeded row draws exactly one vocab-sized sample from its own generator per token, so its tokens do not
depend on what else is in the batch.

A batch of greedy rows without logit processors (bias, min_tokens, penalties) takes the fast path: argmax,
and the raw logprobs only as far as they are asked for (the sampled token's logprob always, for
cumulative_logprob; the top-k when `logprobs` is set). Host-known facts (which rows sample at random, the
largest top-k) travel in the metadata, so sampling never waits for the device. On a CPU, top-k with top-p
takes each row's k largest logits instead of sorting the vocabulary, with the same bits
(`_top_k_then_top_p`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from pagedrs import _core
from pagedrs.sampling_params import SamplingParams

__all__ = [
    "GREEDY_EPS",
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRow",
    "apply_min_p",
    "apply_penalties",
    "apply_top_k_top_p",
    "compute_token_logprobs",
    "padded_token_ids",
]

GREEDY_EPS = 1e-5  # a temperature below this samples greedily


class SamplingRow(Protocol):
    """What the sampler needs to know of the sequence a logits row belongs to."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int]
    is_simple_greedy: bool  # greedy, no penalties / bias / min_tokens / logprobs

    @property
    def output_token_ids(self) -> Sequence[int]:
        """The tokens sampled so far."""
        ...

    @property
    def num_output_tokens(self) -> int: ...


@dataclass
class LogprobsTensors:
    """Per row: [sampled token, top-k tokens] ids and logprobs ([S, 1 + k]) and the sampled token's rank."""

    token_ids: Tensor
    logprobs: Tensor
    ranks: Tensor


@dataclass
class SamplerOutput:
    sampled_token_ids: Tensor  # [S] int64
    logprobs: LogprobsTensors | None = None
    # [S] float32: each sampled token's raw logprob (for cumulative_logprob, which vLLM 0.4 always fills)
    sampled_logprobs: Tensor | None = None


def argmax_logsumexp(logits: Tensor) -> tuple[Tensor, Tensor]:
    """Per row of logits [S, V]: the argmax (int64, the first largest, as torch's) and the logsumexp
    (float32). A float32 matrix on the CPU takes one Rust call over the rows (two reads of each row,
    and no torch parallel op to leave OpenMP threads spinning on the cores the next step needs); the
    rest takes torch's `argmax` and `logsumexp`."""
    if (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.shape[1] > 0
        and logits.is_contiguous()
    ):
        n = logits.shape[0]
        ids = torch.empty(n, dtype=torch.int64)
        lse = torch.empty(n, dtype=torch.float32)
        _core.cpu_argmax_logsumexp(logits.numpy(), ids.numpy(), lse.numpy(), torch.get_num_threads())
        return ids, lse
    return logits.argmax(dim=-1), logits.float().logsumexp(dim=-1)


def sampled_token_logprobs(logits: Tensor, token_ids: Tensor, lse: Tensor | None = None) -> Tensor:
    """log_softmax(logits)[i, token_ids[i]] per row, without materialising the [S, V] log-softmax
    (`lse`: the rows' logsumexp when the caller has it)."""
    chosen = logits.gather(-1, token_ids.view(-1, 1)).squeeze(-1).float()
    return chosen - (argmax_logsumexp(logits)[1] if lse is None else lse)


@dataclass
class SamplingMetadata:
    """Batched sampling parameters, one entry per logits row."""

    num_rows: int
    all_greedy: bool
    temperature: Tensor | None = None  # [S] float32, 0 = greedy row
    top_k: Tensor | None = None  # [S] int64, vocab size = off
    top_p: Tensor | None = None  # [S] float32
    min_p: Tensor | None = None  # [S] float32
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> its own generator
    default_generator: torch.Generator | None = None
    prompt_token_ids: Tensor | None = None  # [S, Lp] int64 padded with vocab_size
    output_token_ids: Tensor | None = None  # [S, Lo] int64 padded with vocab_size
    presence_penalties: Tensor | None = None
    frequency_penalties: Tensor | None = None
    repetition_penalties: Tensor | None = None
    # (rows, token ids) pairs whose logits are set to -inf (min_tokens) / get a bias added (logit_bias)
    banned: tuple[Tensor, Tensor] | None = None
    bias: tuple[Tensor, Tensor, Tensor] | None = None
    max_num_logprobs: int | None = None
    # Host-side facts, so that sampling needs no device sync (None: derived on the device).
    random_rows_cpu: np.ndarray | None = None  # int64, ascending: the rows with temperature >= GREEDY_EPS
    random_rows: Tensor | None = None  # the same on the device
    top_k_max: int | None = None  # an upper bound of the top_k values below the vocab size (>= 1)

    @property
    def is_plain_greedy(self) -> bool:
        """Every row greedy and no logit processor: argmax (+ raw logprobs) is the whole sampler."""
        return (
            self.all_greedy
            and self.banned is None
            and self.bias is None
            and self.repetition_penalties is None
        )

    @classmethod
    def greedy(cls, num_rows: int) -> SamplingMetadata:
        return cls(num_rows=num_rows, all_greedy=True)


def padded_token_ids(num_rows: int, seqs: dict[int, Sequence[int]], pad: int) -> np.ndarray:
    """int64 [num_rows, max(1, longest)]: row i holds seqs[i] (rows not in seqs: empty), padded with pad."""
    width = max((len(s) for s in seqs.values()), default=0)
    out = np.full((num_rows, max(width, 1)), pad, dtype=np.int64)
    for i, s in seqs.items():
        if len(s):
            out[i, : len(s)] = s
    return out


def _bin_counts(tokens: Tensor, vocab_size: int) -> Tensor:
    """[S, L] ids padded with vocab_size -> [S, V] counts."""
    counts = torch.zeros(tokens.shape[0], vocab_size + 1, dtype=torch.int64, device=tokens.device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: Tensor,
    prompt_token_ids: Tensor,
    output_token_ids: Tensor,
    presence_penalties: Tensor,
    frequency_penalties: Tensor,
    repetition_penalties: Tensor,
) -> Tensor:
    """vLLM's penalties, in place on float32 logits [S, V]."""
    vocab_size = logits.shape[1]
    prompt_mask = _bin_counts(prompt_token_ids, vocab_size) > 0
    output_counts = _bin_counts(output_token_ids, vocab_size)
    output_mask = output_counts > 0
    rep = repetition_penalties.unsqueeze(1).expand_as(logits)
    penalties = torch.where(prompt_mask | output_mask, rep, torch.ones_like(rep))
    logits *= torch.where(logits > 0, 1.0 / penalties, penalties)
    logits -= frequency_penalties.unsqueeze(1) * output_counts.to(logits.dtype)
    logits -= presence_penalties.unsqueeze(1) * output_mask.to(logits.dtype)
    return logits


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below min_p times the top token's probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: Tensor, k: Tensor | None, p: Tensor | None, *, k_max: int | None = None
) -> Tensor:
    """Keep the k largest logits of each row (k = vocab size: off), then the smallest set of tokens whose
    probability sums to at least p (always at least one). `k_max`: a bound on the k below the vocab size,
    if the caller knows one (else max(k) is read from the device)."""
    if p is None:
        if k is None:
            return logits
        vocab_size = logits.shape[1]
        off = k >= vocab_size
        k = k.masked_fill(off, 1)
        top = int(k.max()) if k_max is None else max(1, min(k_max, vocab_size))
        kth = logits.topk(top, dim=1).values.gather(1, (k - 1).unsqueeze(1))
        kth.masked_fill_(off.unsqueeze(1), float("-inf"))
        return logits.masked_fill_(logits < kth, float("-inf"))
    if k is not None and logits.device.type == "cpu":
        done = _top_k_then_top_p(logits, k, p)
        if done is not None:
            return done
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        kth = logits_sort.gather(1, (logits_sort.shape[1] - k).clamp(min=0).unsqueeze(1))
        logits_sort.masked_fill_(logits_sort < kth, float("-inf"))
    probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
    top_p_mask = probs_sum <= 1 - p.unsqueeze(1)
    top_p_mask[:, -1] = False
    logits_sort.masked_fill_(top_p_mask, float("-inf"))
    return logits.scatter_(dim=-1, index=logits_idx, src=logits_sort)


def _top_k_then_top_p(logits: Tensor, k: Tensor, p: Tensor) -> Tensor | None:
    """`apply_top_k_top_p` with both k and p, bit for bit, from each row's max(k) largest logits instead of
    a sort of the whole vocabulary (on a CPU: 16 ms of a 150k-vocabulary row). The sorted path's row after
    the top-k mask is -inf, then the kept logits ascending at its end: that row is built as it is, so its
    softmax and cumsum (summed in the same order) give the same top-p mask. None (the sorted path then) for
    a row this cannot reproduce: k at or above the vocabulary, more logits tied at the k-th value than the
    window holds, a NaN, or equal logits on both sides of the top-p cut (a sort may order ties either way)."""
    vocab = logits.shape[1]
    top = int(k.max()) if len(k) else vocab
    if top >= vocab or int(k.min()) < 1:
        return None
    vals, idx = logits.topk(top + 1, dim=1)  # descending; one past the window tells a tie at the k-th
    if bool(vals.isnan().any()):
        return None
    kth = vals.gather(1, (k - 1).unsqueeze(1))
    if bool((vals[:, top:] >= kth).any()):  # more logits at or above the k-th than the window holds
        return None
    vals, idx = vals[:, :top], idx[:, :top]
    row = torch.full_like(logits, float("-inf"))
    window = row[:, vocab - top :]
    window.copy_(vals.flip(1))
    window.masked_fill_(window < kth, float("-inf"))
    # the softmax over the whole row (its sum in the sorted path's order); before the window it is 0.0
    # exactly, so the cumsum (sequential) over the window alone gives the sorted path's values
    probs_sum = row.softmax(dim=-1)[:, vocab - top :].cumsum(dim=-1)
    top_p_mask = probs_sum <= 1 - p.unsqueeze(1)
    top_p_mask[:, -1] = False
    cut = top_p_mask[:, :-1] & ~top_p_mask[:, 1:]  # the last position the top-p mask drops
    if bool((cut & (window[:, :-1] == window[:, 1:]) & (window[:, 1:] > float("-inf"))).any()):
        return None
    window.masked_fill_(top_p_mask, float("-inf"))
    return logits.fill_(float("-inf")).scatter_(dim=-1, index=idx.flip(1), src=window)


def compute_token_logprobs(logprobs: Tensor, token_ids: Tensor, num_logprobs: int) -> LogprobsTensors:
    """The sampled token's logprob and rank, and the top `num_logprobs` alternatives, from [S, V] logprobs."""
    token_ids = token_ids.long().unsqueeze(-1)
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(-1)
    if num_logprobs > 0:
        top_lp, top_ids = logprobs.topk(num_logprobs, dim=-1)
        token_ids = torch.cat((token_ids, top_ids), dim=1)
        token_logprobs = torch.cat((token_logprobs, top_lp), dim=1)
    return LogprobsTensors(token_ids=token_ids, logprobs=token_logprobs, ranks=ranks)


class Sampler(torch.nn.Module):
    """logits [S, V] + SamplingMetadata -> SamplerOutput."""

    def forward(self, logits: Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if meta.is_plain_greedy:
            return self.greedy(logits, meta.max_num_logprobs)
        return self.full(logits, meta)

    @staticmethod
    def greedy(logits: Tensor, num_logprobs: int | None) -> SamplerOutput:
        """The fast path: argmax; the sampled tokens' raw logprobs; the top-k only when asked for."""
        if num_logprobs is None:
            ids, lse = argmax_logsumexp(logits)
            return SamplerOutput(
                sampled_token_ids=ids, sampled_logprobs=sampled_token_logprobs(logits, ids, lse)
            )
        ids = logits.argmax(dim=-1)
        lp = compute_token_logprobs(logits.float().log_softmax(dim=-1), ids, num_logprobs)
        return SamplerOutput(sampled_token_ids=ids, logprobs=lp, sampled_logprobs=lp.logprobs[:, 0])

    def full(self, logits: Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Every step of the module docstring (any batch)."""
        raw_logits = logits
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = logits.float().log_softmax(dim=-1)
        logits = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
        if meta.bias is not None:
            rows, ids, vals = meta.bias
            logits.index_put_((rows, ids), vals, accumulate=True)
        if meta.banned is not None:
            logits[meta.banned] = float("-inf")
        if meta.repetition_penalties is not None:
            assert meta.presence_penalties is not None and meta.frequency_penalties is not None
            assert meta.prompt_token_ids is not None and meta.output_token_ids is not None
            apply_penalties(
                logits,
                meta.prompt_token_ids,
                meta.output_token_ids,
                meta.presence_penalties,
                meta.frequency_penalties,
                meta.repetition_penalties,
            )
        sampled = self._sample(logits, meta)
        lp = None
        if raw_logprobs is not None:
            lp = compute_token_logprobs(raw_logprobs, sampled, meta.max_num_logprobs or 0)
            sampled_lp = lp.logprobs[:, 0]
        else:
            sampled_lp = sampled_token_logprobs(raw_logits, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=lp, sampled_logprobs=sampled_lp)

    @staticmethod
    def _sample(logits: Tensor, meta: SamplingMetadata) -> Tensor:
        if meta.all_greedy:
            return logits.argmax(dim=-1)
        assert meta.temperature is not None
        temp = meta.temperature
        if meta.random_rows_cpu is not None and meta.random_rows is not None:
            rows_cpu, random_rows = meta.random_rows_cpu, meta.random_rows
        else:  # built by hand: ask the device
            random_rows = (temp >= GREEDY_EPS).nonzero().squeeze(1)
            rows_cpu = random_rows.cpu().numpy()
        all_random = len(rows_cpu) == meta.num_rows
        greedy = None if all_random else logits.argmax(dim=-1)  # before `logits` is changed below
        sub = logits if all_random else logits.index_select(0, random_rows)
        sub = sub / (temp if all_random else temp.index_select(0, random_rows)).unsqueeze(1)

        def pick(t: Tensor) -> Tensor:
            return t if all_random else t.index_select(0, random_rows)

        if meta.min_p is not None:
            sub = apply_min_p(sub, pick(meta.min_p))
        sub = apply_top_k_top_p(
            sub,
            None if meta.top_k is None else pick(meta.top_k),
            None if meta.top_p is None else pick(meta.top_p),
            k_max=meta.top_k_max,
        )
        probs = sub.softmax(dim=-1)
        q = torch.empty_like(probs)
        # Seeded rows by their position among the random rows (rows_cpu is ascending).
        seeded: dict[int, torch.Generator] = {}
        for r, g in meta.generators.items():
            j = int(np.searchsorted(rows_cpu, r))
            if j < len(rows_cpu) and rows_cpu[j] == r:
                seeded[j] = g
        if len(seeded) < q.shape[0]:
            q.exponential_(generator=meta.default_generator)
        for j, gen in seeded.items():
            q[j].exponential_(generator=gen)
        random_sampled = probs.div_(q).argmax(dim=-1)
        if greedy is None:
            return random_sampled
        return greedy.index_copy_(0, random_rows, random_sampled)
