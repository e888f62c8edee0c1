"""Top-k with top-p on a CPU without sorting the vocabulary (`sampler._top_k_then_top_p`): the same bits
as the sorted path on a 150k vocabulary and on rows built to hit each case it hands back to the sort (ties
at the k-th value and at the top-p cut, k at the vocabulary size, fewer finite logits than k, NaN), and
the same seeded tokens through the sampler."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedrs.layers import sampler as sampler_mod
from pagedrs.layers.sampler import Sampler, SamplingMetadata, apply_top_k_top_p


def _sorted(
    logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(sampler_mod, "_top_k_then_top_p", lambda *a: None)
        return apply_top_k_top_p(logits.clone(), k, p)


class _Sorts:
    """Counts vocabulary sorts."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        real = torch.Tensor.sort

        def sort(t: torch.Tensor, *args: object, **kwargs: object) -> object:
            self.n += 1
            return real(t, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(torch.Tensor, "sort", sort)


def test_large_vocabulary_without_a_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 150_000, generator=g) * 3
    k = torch.tensor([40, 20, 1, 64])
    p = torch.tensor([0.95, 0.8, 0.5, 0.999])
    want = _sorted(logits, k, p, monkeypatch)
    sorts = _Sorts(monkeypatch)
    got = apply_top_k_top_p(logits.clone(), k, p)
    assert sorts.n == 0
    assert torch.equal(got, want)
    kept = torch.isfinite(got).sum(dim=1)
    assert kept[2] == 1 and (kept <= k).all() and (kept[[0, 1, 3]] > 1).all()


def test_ties_and_edge_rows_equal_the_sorted_path(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1)
    taken = declined = 0
    real = sampler_mod._top_k_then_top_p

    def spy(*args: torch.Tensor) -> torch.Tensor | None:
        nonlocal taken, declined
        out = real(*args)
        taken, declined = taken + (out is not None), declined + (out is None)
        return out

    for trial in range(120):
        vocab = int(rng.integers(20, 400))
        rows = int(rng.integers(1, 5))
        logits = torch.from_numpy(rng.standard_normal((rows, vocab)).astype(np.float32) * 2)
        if trial % 3 == 0:  # many ties: at the k-th value and at the top-p cut
            logits = logits.round()
        if trial % 5 == 0:  # banned tokens (min_tokens): -inf logits, some rows with fewer finite than k
            logits[:, rng.integers(0, vocab, vocab // 2)] = float("-inf")
        k = torch.from_numpy(rng.integers(1, min(vocab, 80), rows))
        if trial % 7 == 0:
            k[0] = vocab  # top-k off in one row
        if trial == 11:
            logits[0, 3] = float("nan")
        p = torch.from_numpy(rng.choice([1.0, 0.9999, rng.uniform(0.05, 1.0)], rows).astype(np.float32))
        want = _sorted(logits, k, p, monkeypatch)
        with monkeypatch.context() as m:
            m.setattr(sampler_mod, "_top_k_then_top_p", spy)
            got = apply_top_k_top_p(logits.clone(), k, p)
        assert torch.equal(got.isnan(), want.isnan()), trial
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)), trial
    assert taken > 10 and declined > 10, (taken, declined)
    # two equal top logits split by the top-p cut: which one a sort keeps is its tie order, so the sort
    logits = torch.tensor([[3.0, -5.0, 3.0, -6.0, -7.0, -8.0]])
    k, p = torch.tensor([2]), torch.tensor([0.5])
    assert real(logits.clone(), k, p) is None
    assert torch.isfinite(apply_top_k_top_p(logits.clone(), k, p)).sum() == 1


def test_seeded_sampling_gives_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(3, 50_000, generator=torch.Generator().manual_seed(2)) * 4

    def sample() -> list[int]:
        meta = SamplingMetadata(
            num_rows=3,
            all_greedy=False,
            temperature=torch.tensor([0.7, 1.0, 1.3]),
            top_k=torch.tensor([20, 40, 64]),
            top_p=torch.tensor([0.9, 0.95, 0.8]),
            generators={r: torch.Generator().manual_seed(10 + r) for r in range(3)},
            random_rows_cpu=np.arange(3),
            random_rows=torch.arange(3),
            top_k_max=64,
        )
        return [Sampler()(logits, meta).sampled_token_ids.tolist() for _ in range(5)]

    fast = sample()
    monkeypatch.setattr(sampler_mod, "_top_k_then_top_p", lambda *a: None)
    assert fast == sample()
