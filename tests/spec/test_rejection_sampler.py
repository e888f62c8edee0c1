"""Speculative-draft verification: greedy output equals plain greedy decoding; random sequences keep the
target distribution exactly (chi-square goodness of fit over many independent sequences, with mutated
acceptance rules shown to fail the same check); seeded sequences independent of the batch; shape errors."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from pagedrs.layers.sampler import Sampler, SamplingMetadata
from pagedrs.spec_decode import rejection_sampler as spec_sampler
from pagedrs.spec_decode.rejection_sampler import SpecVerifyResult, verify_drafts

# Chi-square critical values at p = 1e-4 (scipy.stats.chi2.isf(1e-4, df)), by degrees of freedom; checked
# against the closed-form survival function (even df: exp(-x/2) sum_k<df/2 (x/2)^k/k!; odd df via erfc).
CHI2_CRIT_1E4 = {1: 15.137, 2: 18.421, 3: 21.108, 4: 23.513}
N_TRIALS = 20_000

# Target distributions of rows 0, 1, 2 (V = 5), as logits = log(p); drafts: d0 likely, d1 unlikely.
P_ROWS = np.array(
    [
        [0.10, 0.45, 0.20, 0.05, 0.20],
        [0.30, 0.08, 0.25, 0.12, 0.25],
        [0.15, 0.35, 0.10, 0.30, 0.10],
    ]
)
D0, D1 = 1, 3


def reference_probs(
    logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    """The processed target distribution of one row, by the definitions (float64, independent of torch)."""
    x = logits / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    if 0 < top_k < len(p):
        keep &= p >= np.sort(p)[::-1][top_k - 1]
    p = np.where(keep, p, 0.0)
    p /= p.sum()
    order = np.argsort(-p)
    mass_before = np.cumsum(p[order]) - p[order]
    keep = np.zeros(len(p), dtype=bool)
    keep[order[mass_before < top_p]] = True
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def chi2_exceeds(observed: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """(statistic, critical value at p = 1e-4). Zero-probability tokens must not be observed at all:
    such an observation counts as an infinite statistic."""
    n = observed.sum()
    assert n > 0, "no samples to test"
    support = probs > 0
    if observed[~support].any():
        return float("inf"), 0.0
    expected = n * probs[support]
    stat = float(((observed[support] - expected) ** 2 / expected).sum())
    return stat, CHI2_CRIT_1E4[int(support.sum()) - 1]


@dataclass
class Case:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seeded: bool = False
    drafts: tuple[int, int] = (D0, D1)


def run_trials(case: Case, q_rows: np.ndarray | None = None, seed: int = 0) -> tuple[SpecVerifyResult, list]:
    """N_TRIALS independent sequences in one call, each with 2 drafts over the same 3 target rows.
    q_rows: draft distributions per row (drafts sampled from them, per trial); None = fixed drafts."""
    n = N_TRIALS
    logits = torch.from_numpy(np.log(P_ROWS)).float().repeat(n, 1)
    rng = np.random.default_rng(seed)
    if q_rows is None:
        drafts = np.tile(np.array(case.drafts, dtype=np.int64), n)
        draft_probs = None
    else:
        drafts = np.stack([rng.choice(5, size=n, p=q_rows[j]) for j in range(2)], axis=1).reshape(-1)
        draft_probs = torch.from_numpy(q_rows[:2]).float().repeat(n, 1)
    gens = [torch.Generator().manual_seed(seed * n + i) for i in range(n)] if case.seeded else [None] * n
    result = verify_drafts(
        logits,
        np.full(n, 2),
        drafts,
        np.full(n, case.temperature, dtype=np.float32),
        np.full(n, case.top_k, dtype=np.int64),
        np.full(n, case.top_p, dtype=np.float32),
        np.full(n, case.min_p, dtype=np.float32),
        gens,
        default_generator=torch.Generator().manual_seed(seed),
        draft_probs=draft_probs,
    )
    return result, drafts.reshape(n, 2).tolist()


def distribution_checks(
    case: Case, result: SpecVerifyResult, drafts: list, q_rows: np.ndarray | None = None
) -> dict[str, tuple[float, float]]:
    """Chi-square (statistic, critical) of: the first token vs p_0; the second vs p_1 given the first was
    the accepted draft; the third vs p_2 given both were; the number of tokens vs the acceptance rates."""
    p = [
        reference_probs(np.log(P_ROWS[j]), case.temperature, case.top_k, case.top_p, case.min_p)
        for j in range(3)
    ]
    counts = result.counts
    assert counts.sum() == len(result.token_ids)
    starts = np.cumsum(counts) - counts
    tokens = result.token_ids
    drafts_arr = np.array(drafts)
    for k in range(2):  # every emitted token before the last is the sequence's own draft
        has = counts > k + 1
        assert (tokens[starts[has] + k] == drafts_arr[has, k]).all()
    if q_rows is None:
        alpha = [p[j][case.drafts[j]] for j in range(2)]  # acceptance rate: p(d)
    else:
        alpha = [np.minimum(p[j], q_rows[j]).sum() for j in range(2)]  # 1 - total variation
    count_probs = np.array([1 - alpha[0], alpha[0] * (1 - alpha[1]), alpha[0] * alpha[1]])
    checks = {"counts": chi2_exceeds(np.bincount(counts - 1, minlength=3), count_probs)}
    for k in range(3):  # (token k exists with probability count_probs[k:].sum())
        sel = counts >= k + 1
        if count_probs[k:].sum() == 0:
            assert not sel.any()
            continue
        checks[f"token {k}"] = chi2_exceeds(np.bincount(tokens[starts[sel] + k], minlength=5), p[k])
    return checks


def assert_matches(checks: dict[str, tuple[float, float]]) -> None:
    failed = {name: sc for name, sc in checks.items() if sc[0] > sc[1]}
    assert not failed, f"chi-square above the p=1e-4 critical value: {failed}"


def assert_rejected(checks: dict[str, tuple[float, float]]) -> None:
    assert any(stat > crit for stat, crit in checks.values()), f"a wrong rule passed: {checks}"


def test_greedy_emits_matching_prefix_then_argmax() -> None:
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    num_drafts = np.array([3, 0, 4, 2, 5, 1])
    logits = torch.randn(int(num_drafts.sum()) + len(num_drafts), 50, generator=gen)
    argmax = logits.argmax(-1).tolist()
    row, drafts, expected, expected_rows = 0, [], [], []
    for n in num_drafts:
        a = int(rng.integers(0, n + 1))
        seq_drafts = [argmax[row + j] for j in range(a)]
        seq_drafts += [(argmax[row + j] + 1 + int(rng.integers(0, 49))) % 50 for j in range(a, n)]
        drafts += seq_drafts
        expected.append(seq_drafts[:a] + [argmax[row + a]])
        expected_rows += list(range(row, row + a + 1))
        row += n + 1
    result = verify_drafts(
        logits, num_drafts, np.array(drafts), np.zeros(6, np.float32), None, None, None, [None] * 6
    )
    assert result.counts.tolist() == [len(e) for e in expected]
    assert result.counts.dtype == np.int32 and result.token_ids.dtype == np.int64
    assert result.token_ids.tolist() == [t for e in expected for t in e]
    raw = torch.log_softmax(logits.double(), -1)[expected_rows, result.token_ids].numpy()
    np.testing.assert_allclose(result.logprobs, raw, rtol=1e-5, atol=1e-5)


def test_greedy_sequences_unchanged_beside_random_ones() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(12, 30, generator=gen)
    num_drafts = np.array([2, 3, 1, 2])  # sequences 0 and 2 greedy: rows 0-2, 7-8
    argmax = logits.argmax(-1).tolist()
    drafts = np.array([argmax[0], argmax[1], 4, 5, 6, argmax[7], 1, 2])
    temperature = np.array([0.0, 1.0, 0.0, 0.8], dtype=np.float32)
    result = verify_drafts(
        logits, num_drafts, drafts, temperature, np.array([0, 3, 0, 5]), None, None, [None] * 4
    )
    counts = result.counts.tolist()
    tokens = result.token_ids.tolist()
    assert counts[0] == 3 and tokens[:3] == [argmax[0], argmax[1], argmax[2]]
    start = sum(counts[:2])
    assert counts[2] == 2 and tokens[start : start + 2] == [argmax[7], argmax[8]]


@pytest.mark.parametrize(
    "case",
    [
        Case(),
        Case(top_k=3, drafts=(D0, 1)),  # draft 1 is outside row 1's top 3: always rejected
        Case(temperature=0.7, top_p=0.85, seeded=True, drafts=(D0, 2)),
        Case(min_p=0.3),
    ],
    ids=["t1", "top_k3", "t0.7_top_p_seeded", "min_p"],
)
def test_random_sequences_keep_the_target_distribution(case: Case) -> None:
    result, drafts = run_trials(case)
    if case.top_k:
        assert result.counts.max() == 2  # the zero-probability draft is never accepted
    assert_matches(distribution_checks(case, result, drafts))


def test_wrong_acceptance_rules_fail_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutations of the code under test: the statistic has the power to see each."""
    case = Case()
    with monkeypatch.context() as m:  # always accept
        m.setattr(spec_sampler, "_accept_mask", lambda u, p, q: torch.ones_like(p, dtype=torch.bool))
        assert_rejected(distribution_checks(case, *run_trials(case)))
    with monkeypatch.context() as m:  # resample from p, not the residual, after a rejection
        m.setattr(spec_sampler, "_recovered_weights", lambda p_final, *_: p_final.clone())
        assert_rejected(distribution_checks(case, *run_trials(case)))
    with monkeypatch.context() as m:  # accept with p(d) squared
        m.setattr(spec_sampler, "_accept_mask", lambda u, p, q: u < p * p)
        assert_rejected(distribution_checks(case, *run_trials(case)))


Q_ROWS = np.array(
    [
        [0.30, 0.10, 0.30, 0.20, 0.10],
        [0.05, 0.40, 0.05, 0.40, 0.10],
    ]
)


def test_sampled_drafts_keep_the_target_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    case = Case()
    result, drafts = run_trials(case, Q_ROWS)
    assert_matches(distribution_checks(case, result, drafts, Q_ROWS))
    # Mutation: ignore q (treat the sampled drafts as point masses).
    monkeypatch.setattr(spec_sampler, "_accept_mask", lambda u, p, q: u < p)
    result, drafts = run_trials(case, Q_ROWS)
    assert_rejected(distribution_checks(case, result, drafts, Q_ROWS))


def test_empty_residual_falls_back_to_the_target() -> None:
    """q = 2p (not a distribution): half the drafts are rejected with max(p - q, 0) = 0 everywhere; the
    token must still come from p's support (top-2: tokens 1 and 3), never a zero-weight argmax."""
    n = 400
    logits = torch.tensor([[0.0, 3.0, 0.5, 2.0, 1.0]] * 2).repeat(n, 1)
    p = torch.tensor(reference_probs(np.array([0.0, 3.0, 0.5, 2.0, 1.0]), 1.0, top_k=2)).float()
    result = verify_drafts(
        logits,
        np.ones(n, dtype=np.int64),
        np.full(n, 1),
        np.ones(n, np.float32),
        np.full(n, 2),
        None,
        None,
        [None] * n,
        default_generator=torch.Generator().manual_seed(0),
        draft_probs=(2 * p).repeat(n, 1),
    )
    assert 0 < (result.counts == 1).sum() < n
    assert set(result.token_ids.tolist()) <= {1, 3}


def seeded_batch(seed: int, num_drafts: np.ndarray, vocab: int = 1000) -> tuple:
    """Flat-ish logits with each draft boosted to about probability 0.5, so that both outcomes occur."""
    gen = torch.Generator().manual_seed(1234)
    rows = int(num_drafts.sum()) + len(num_drafts)
    logits = torch.randn(rows, vocab, generator=gen)
    drafts = torch.randint(0, vocab, (int(num_drafts.sum()),), generator=gen).numpy()
    starts = np.cumsum(num_drafts + 1) - num_drafts - 1
    draft_rows = np.repeat(starts, num_drafts) + np.concatenate([np.arange(k) for k in num_drafts])
    logits[draft_rows, drafts] = logits[draft_rows].logsumexp(-1)
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(num_drafts))]
    return logits, drafts, gens


def per_sequence(result: SpecVerifyResult) -> list[list[int]]:
    ends = np.cumsum(result.counts)
    return [t.tolist() for t in np.split(result.token_ids, ends[:-1])]


def test_seeded_sequences_repeat_and_do_not_depend_on_the_batch() -> None:
    num_drafts = np.array([3, 0, 2, 4, 1, 3, 2, 2])
    s = len(num_drafts)
    temp, top_k = np.ones(s, np.float32), np.full(s, 500)

    def run(seed: int) -> list[list[int]]:
        logits, drafts, gens = seeded_batch(seed, num_drafts)
        return per_sequence(verify_drafts(logits, num_drafts, drafts, temp, top_k, None, None, gens))

    first = run(0)
    assert first == run(0)
    assert first != run(100)  # another seed, other tokens (the equality above is not vacuous)
    assert 1 < len({len(t) for t in first})  # acceptance varies across sequences

    # Each seeded sequence alone vs inside a batch where unseeded sequences draw from the global RNG.
    logits, drafts, gens = seeded_batch(0, num_drafts)
    torch.manual_seed(7)
    mixed_gens = [g if i % 2 == 0 else None for i, g in enumerate(gens)]
    batch = per_sequence(verify_drafts(logits, num_drafts, drafts, temp, top_k, None, None, mixed_gens))
    starts = np.cumsum(num_drafts + 1) - num_drafts - 1
    dstarts = np.cumsum(num_drafts) - num_drafts
    for i in range(0, s, 2):
        torch.manual_seed(8)
        alone = verify_drafts(
            logits[starts[i] : starts[i] + num_drafts[i] + 1],
            num_drafts[i : i + 1],
            drafts[dstarts[i] : dstarts[i] + num_drafts[i]],
            temp[:1],
            top_k[:1],
            None,
            None,
            [torch.Generator().manual_seed(i)],
        )
        assert per_sequence(alone)[0] == first[i] == batch[i]


def test_no_drafts_is_the_samplers_sampling() -> None:
    """num_drafts = 0 everywhere: the same tokens as the Sampler with the same seeded generators."""
    gen = torch.Generator().manual_seed(3)
    s, vocab = 6, 200
    logits = torch.randn(s, vocab, generator=gen)
    temp = np.array([0.9, 1.3, 0.0, 0.6, 1.0, 2.0], dtype=np.float32)
    top_k, top_p = np.array([0, 20, 0, 50, 5, 0]), np.array([1.0, 0.9, 1.0, 0.8, 1.0, 0.95], np.float32)
    min_p = np.array([0.0, 0.0, 0.0, 0.1, 0.0, 0.05], np.float32)
    result = verify_drafts(
        logits,
        np.zeros(s, dtype=np.int64),
        np.zeros(0, dtype=np.int64),
        temp,
        top_k,
        top_p,
        min_p,
        [torch.Generator().manual_seed(i) for i in range(s)],
    )
    meta = SamplingMetadata(
        num_rows=s,
        all_greedy=False,
        temperature=torch.from_numpy(temp),
        top_k=torch.from_numpy(np.where(top_k <= 0, vocab, top_k)),
        top_p=torch.from_numpy(top_p),
        min_p=torch.from_numpy(min_p),
        generators={i: torch.Generator().manual_seed(i) for i in range(s)},
    )
    out = Sampler()(logits.clone(), meta)
    assert result.token_ids.tolist() == out.sampled_token_ids.tolist()
    assert out.sampled_logprobs is not None
    np.testing.assert_allclose(result.logprobs, out.sampled_logprobs.numpy(), rtol=1e-6)


def good_args() -> dict:
    return {
        "logits": torch.zeros(5, 8),
        "num_drafts": np.array([2, 1]),
        "draft_token_ids": np.array([1, 2, 3]),
        "temperature": np.ones(2, np.float32),
        "top_k": None,
        "top_p": None,
        "min_p": None,
        "generators": [None, None],
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"logits": torch.zeros(6, 8)}, "logits has 6 rows"),
        ({"logits": torch.zeros(5)}, r"\(5,\)"),
        ({"num_drafts": np.array([2, -1])}, r"\[2, -1\]"),
        ({"num_drafts": np.array([2.0, 1.0])}, "float64"),
        ({"draft_token_ids": np.array([1, 2])}, r"shape \(2,\)"),
        ({"draft_token_ids": np.array([1, 8, 3])}, "token id 8"),
        ({"temperature": np.ones(3, np.float32)}, r"temperature has shape \(3,\)"),
        ({"top_k": np.ones(1, np.int64)}, r"top_k has shape \(1,\)"),
        ({"top_p": np.ones((2, 1), np.float32)}, r"top_p has shape \(2, 1\)"),
        ({"min_p": np.ones(4, np.float32)}, r"min_p has shape \(4,\)"),
        ({"generators": [None]}, "1 generators for 2"),
        ({"draft_probs": torch.zeros(3, 7)}, r"draft_probs has shape \(3, 7\)"),
    ],
)
def test_inconsistent_inputs_raise_naming_the_value(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        verify_drafts(**{**good_args(), **change})
    verify_drafts(**good_args())  # the unchanged arguments are accepted
