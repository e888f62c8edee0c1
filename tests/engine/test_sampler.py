"""The batched sampler on known logits: each transformation by its definition, seeded rows independent of
the batch, logprobs from the raw log-softmax."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from pagedrs import SamplingParams
from pagedrs.layers.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
)

V = 8


@dataclass
class Row:
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    is_simple_greedy: bool = False

    def __post_init__(self) -> None:
        p = self.params
        if p.seed is not None and p.temperature > 0:
            self.generator = torch.Generator().manual_seed(p.seed)
        self.is_simple_greedy = (
            p.temperature == 0
            and not p.needs_penalties
            and p.logprobs is None
            and not p.min_tokens
            and not p.logit_bias
        )


def sample(logits: torch.Tensor, rows: list[Row], seed: int = 0, eos: tuple[int, ...] = ()) -> torch.Tensor:
    meta = SamplingMetadata.from_rows(
        rows,
        vocab_size=logits.shape[1],
        device=torch.device("cpu"),
        eos_token_ids=eos,
        default_generator=torch.Generator().manual_seed(seed),
    )
    return Sampler()(logits.clone(), meta).sampled_token_ids


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0))
    out = sample(logits, [Row(SamplingParams(temperature=0))] * 5)
    assert out.tolist() == logits.argmax(-1).tolist()


def test_top_k_1_equals_greedy() -> None:
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(1))
    rows = [Row(SamplingParams(temperature=1.5, top_k=1)) for _ in range(16)]
    for seed in range(5):
        assert sample(logits, rows, seed=seed).tolist() == logits.argmax(-1).tolist()


def test_mixed_greedy_and_random_rows() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    rows = [Row(SamplingParams(temperature=0)), Row(SamplingParams(temperature=1.0, top_k=1))] * 2
    assert sample(logits, rows).tolist() == logits.argmax(-1).tolist()


def test_penalties_follow_vllm_definitions() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0, 0.0, 4.0]])
    prompt = torch.tensor([[0, 1, V, V]])  # padded with V
    output = torch.tensor([[3, 3, 4, V]])
    out = apply_penalties(
        logits.clone(),
        prompt,
        output,
        presence_penalties=torch.tensor([0.5]),
        frequency_penalties=torch.tensor([0.25]),
        repetition_penalties=torch.tensor([2.0]),
    )
    expected = logits.clone()
    # repetition: tokens in prompt or output (0, 1, 3, 4): positive / 2, negative * 2
    expected[0, 0] = 2.0 / 2
    expected[0, 1] = -1.0 * 2
    expected[0, 3] = 3.0 / 2
    expected[0, 4] = -2.0 * 2
    # frequency (count in output) and presence (in output at all): token 3 twice, token 4 once
    expected[0, 3] -= 0.25 * 2 + 0.5
    expected[0, 4] -= 0.25 * 1 + 0.5
    torch.testing.assert_close(out, expected)


def test_penalties_through_the_sampler_change_the_argmax() -> None:
    logits = torch.tensor([[5.0, 4.9, 0.0, 0.0]])
    row = Row(SamplingParams(temperature=0, repetition_penalty=1.5), prompt_token_ids=[0])
    assert sample(logits, [row]).tolist() == [1]
    row = Row(SamplingParams(temperature=0, frequency_penalty=1.0), output_token_ids=[0])
    assert sample(logits, [row]).tolist() == [1]
    row = Row(SamplingParams(temperature=0, presence_penalty=0.05), output_token_ids=[0, 0, 0])
    assert sample(logits, [row]).tolist() == [0]  # presence counts once: 5 - 0.05 > 4.9


def test_min_p_definition() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]])
    logits = probs.log()
    out = apply_min_p(logits.clone(), torch.tensor([0.15]))  # threshold 0.075
    assert torch.isfinite(out[0, :3]).all() and torch.isinf(out[0, 3:]).all()
    rows = [Row(SamplingParams(temperature=1.0, min_p=0.15))]
    seen = {int(sample(logits, rows, seed=s)) for s in range(200)}
    assert seen <= {0, 1, 2} and len(seen) == 3


def test_top_p_and_top_k_definitions() -> None:
    probs = torch.tensor([[0.1, 0.4, 0.05, 0.3, 0.15]])
    logits = probs.log()
    # top_p 0.7: smallest set reaching 0.7 is {1 (0.4), 3 (0.3)}
    out = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.7]))
    assert torch.isfinite(out[0]).tolist() == [False, True, False, True, False]
    out = apply_top_k_top_p(logits.clone(), torch.tensor([3]), None)
    assert torch.isfinite(out[0]).tolist() == [False, True, False, True, True]
    out = apply_top_k_top_p(logits.clone(), torch.tensor([3]), torch.tensor([0.5]))
    assert torch.isfinite(out[0]).tolist() == [False, True, False, True, False]
    out = apply_top_k_top_p(logits.clone(), torch.tensor([5]), None)  # k = vocab: off
    assert torch.isfinite(out).all()


def test_random_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(4000, 3).contiguous()
    rows = [Row(SamplingParams(temperature=1.0))] * 4000
    counts = torch.bincount(sample(logits, rows, seed=3), minlength=3).float() / 4000
    torch.testing.assert_close(counts, probs, atol=0.03, rtol=0)


def test_temperature_sharpens() -> None:
    logits = torch.tensor([1.0, 0.0]).expand(2000, 2).contiguous()
    cold = sample(logits, [Row(SamplingParams(temperature=0.25))] * 2000, seed=1).float().mean()
    hot = sample(logits, [Row(SamplingParams(temperature=4.0))] * 2000, seed=1).float().mean()
    # P(token 1) = sigmoid(-1/T): 0.018 at T=0.25, 0.438 at T=4
    assert cold < 0.05 and 0.38 < hot < 0.5


def test_seeded_row_is_independent_of_the_batch() -> None:
    gen = torch.Generator().manual_seed(7)
    target = torch.randn(1, 100, generator=gen)
    others = torch.randn(6, 100, generator=gen)

    def run(batch: torch.Tensor, pos: int, seed_default: int) -> list[int]:
        row = Row(SamplingParams(temperature=1.0, seed=1234))
        toks = []
        for _ in range(10):
            rows = [Row(SamplingParams(temperature=0.8)) for _ in range(len(batch))]
            rows[pos] = row
            toks.append(int(sample(batch, rows, seed=seed_default)[pos]))
            seed_default += 1
        return toks

    alone = run(target, 0, 0)
    crowded = run(torch.cat([others[:3], target, others[3:]]), 3, 99)
    assert alone == crowded
    assert len(set(alone)) > 1  # it really sampled


def test_min_tokens_masks_stop_tokens_and_eos() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    row = Row(p, output_token_ids=[3])
    assert sample(logits, [row], eos=(1,)).tolist() == [3]  # 1 (eos) and 2 (stop) are banned
    row = Row(p, output_token_ids=[3, 3])
    assert sample(logits, [row], eos=(1,)).tolist() == [1]
    row = Row(SamplingParams(temperature=0, min_tokens=2, ignore_eos=True), output_token_ids=[])
    assert sample(logits, [row], eos=(1,)).tolist() == [1]  # ignore_eos: eos is not a stop token


def test_logit_bias() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.0]])
    row = Row(SamplingParams(temperature=0, logit_bias={2: 3.0}))
    assert sample(logits, [row]).tolist() == [2]


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    rows = [
        Row(SamplingParams(temperature=0, logprobs=2)),
        Row(SamplingParams(temperature=0, logprobs=0, repetition_penalty=2.0), prompt_token_ids=[2]),
    ]
    meta = SamplingMetadata.from_rows(rows, vocab_size=4, device=torch.device("cpu"))
    out = Sampler()(logits.clone(), meta)
    ref = logits.log_softmax(-1)
    lp = out.logprobs
    assert lp is not None
    assert out.sampled_token_ids.tolist() == [1, 2]  # 5/2 = 2.5 still beats 1
    assert lp.token_ids[0].tolist() == [1, 1, 2]
    torch.testing.assert_close(lp.logprobs[0], ref[0, [1, 1, 2]])
    # raw logprobs: before the repetition penalty
    torch.testing.assert_close(lp.logprobs[1, 0], ref[1, 2])
    assert lp.ranks.tolist() == [1, 1]
    assert math.isclose(float(lp.logprobs[0, 0]), float(ref[0, 1]), abs_tol=1e-6)


def test_rank_of_a_non_top_token() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    rows = [Row(SamplingParams(temperature=1.0, logprobs=1, logit_bias={0: 100.0}))]
    meta = SamplingMetadata.from_rows(rows, vocab_size=4, device=torch.device("cpu"))
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist() == [0]
    assert out.logprobs is not None and out.logprobs.ranks.tolist() == [4]


@pytest.mark.parametrize("n", [1, 3])
def test_all_simple_greedy_fast_path(n: int) -> None:
    rows = [Row(SamplingParams(temperature=0))] * n
    meta = SamplingMetadata.from_rows(rows, vocab_size=V, device=torch.device("cpu"))
    assert meta.all_greedy and meta.temperature is None
