"""The batched sampler on known logits: each transformation by its definition, seeded rows independent of
the batch, logprobs from the raw log-softmax."""

from __future__ import annotations

import math

import pytest
import torch

from pagedrs import SamplingParams
from pagedrs.layers.sampler import (
    Sampler,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
)
from tests.engine.conftest import greedy, make_engine, random_prompts, run_all
from tests.helpers import SamplerRow as Row
from tests.helpers_sampling import metadata_from_rows

V = 8


def sample(logits: torch.Tensor, rows: list[Row], seed: int = 0, eos: tuple[int, ...] = ()) -> torch.Tensor:
    meta = metadata_from_rows(
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
    meta = metadata_from_rows(rows, vocab_size=4, device=torch.device("cpu"))
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
    meta = metadata_from_rows(rows, vocab_size=4, device=torch.device("cpu"))
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist() == [0]
    assert out.logprobs is not None and out.logprobs.ranks.tolist() == [4]


@pytest.mark.parametrize("n", [1, 3])
def test_all_simple_greedy_fast_path(n: int) -> None:
    rows = [Row(SamplingParams(temperature=0))] * n
    meta = metadata_from_rows(rows, vocab_size=V, device=torch.device("cpu"))
    assert meta.all_greedy and meta.temperature is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_fast_path_equals_the_full_sampler(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An all-greedy batch with logprobs asked by some rows takes the fast path (no full sampler) and gives
    the full sampler's ids, top-k logprobs, ranks and sampled-token logprobs."""
    logits = (torch.randn(6, 40, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: both paths take the first index
    rows = [Row(SamplingParams(temperature=0, logprobs=k)) for k in (3, None, 0, 5, None, 1)]
    meta = metadata_from_rows(rows, vocab_size=40, device=torch.device("cpu"))
    assert meta.is_plain_greedy and meta.max_num_logprobs == 5
    full = Sampler().full(logits.clone(), meta)

    def no_full(*args: object) -> None:
        raise AssertionError("the greedy batch took the full sampler")

    monkeypatch.setattr(Sampler, "full", no_full)
    fast = Sampler()(logits.clone(), meta)
    assert torch.equal(fast.sampled_token_ids, full.sampled_token_ids)
    assert fast.sampled_token_ids[2].item() == 7
    assert fast.logprobs is not None and full.logprobs is not None
    assert torch.equal(fast.logprobs.token_ids, full.logprobs.token_ids)
    assert torch.equal(fast.logprobs.ranks, full.logprobs.ranks)
    torch.testing.assert_close(fast.logprobs.logprobs, full.logprobs.logprobs, rtol=0, atol=0)
    assert fast.sampled_logprobs is not None and full.sampled_logprobs is not None
    torch.testing.assert_close(fast.sampled_logprobs, full.sampled_logprobs, rtol=0, atol=0)
    # without logprobs: the sampled tokens' logprobs still (cumulative_logprob), no top-k
    plain = [Row(SamplingParams(temperature=0)) for _ in range(6)]
    meta = metadata_from_rows(plain, vocab_size=40, device=torch.device("cpu"))
    fast = Sampler()(logits.clone(), meta)
    assert fast.logprobs is None and fast.sampled_logprobs is not None
    ref = logits.float().log_softmax(-1).gather(1, fast.sampled_token_ids[:, None])[:, 0]
    torch.testing.assert_close(fast.sampled_logprobs, ref)


def test_greedy_rows_with_processors_take_the_full_sampler() -> None:
    for params in (
        SamplingParams(temperature=0, min_tokens=2),
        SamplingParams(temperature=0, logit_bias={1: 2.0}),
        SamplingParams(temperature=0, presence_penalty=0.5),
        SamplingParams(temperature=0.5),
    ):
        meta = metadata_from_rows([Row(params)], vocab_size=V, device=torch.device("cpu"), eos_token_ids=(2,))
        assert not meta.is_plain_greedy, params


def test_random_rows_sample_without_asking_the_device() -> None:
    """Host-known random rows and top-k bound: the same tokens as the device-derived ones."""
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(4))
    rows = [
        Row(SamplingParams(temperature=0)),
        Row(SamplingParams(temperature=1.0, top_k=3, seed=5)),
        Row(SamplingParams(temperature=0.7, top_k=2)),
        Row(SamplingParams(temperature=0)),
        Row(SamplingParams(temperature=1.3, seed=9)),
    ]
    meta = metadata_from_rows(rows, vocab_size=V, device=torch.device("cpu"))
    assert meta.random_rows_cpu is not None and meta.random_rows_cpu.tolist() == [1, 2, 4]
    assert meta.top_k_max == 3
    states = [r.generator.get_state() if r.generator is not None else None for r in rows]
    meta.default_generator = torch.Generator().manual_seed(0)
    a = Sampler()(logits.clone(), meta).sampled_token_ids
    for r, s in zip(rows, states, strict=True):
        if r.generator is not None:
            r.generator.set_state(s)
    meta.random_rows_cpu = meta.random_rows = meta.top_k_max = None  # as a hand-built metadata
    meta.default_generator = torch.Generator().manual_seed(0)
    b = Sampler()(logits.clone(), meta).sampled_token_ids
    assert torch.equal(a, b)
    assert a[0].item() == logits[0].argmax().item() and a[3].item() == logits[3].argmax().item()


def test_engine_greedy_batch_takes_the_fast_path(tiny_models: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the engine: greedy requests, some asking for logprobs, never reach the full sampler, and
    still get their logprobs and cumulative_logprob."""
    engine = make_engine(tiny_models["llama"], max_num_seqs=4)

    def no_full(*args: object) -> None:
        raise AssertionError("an all-greedy batch took the full sampler")

    monkeypatch.setattr(Sampler, "full", no_full)
    prompts = random_prompts([7, 12, 4], seed=2)
    engine.add_request("lp", prompts[0], greedy(6, logprobs=2))
    engine.add_request("plain", prompts[1], greedy(6))
    engine.add_request("lp0", prompts[2], greedy(6, logprobs=0))
    outs = run_all(engine)
    for rid, k in (("lp", 2), ("lp0", 0)):
        c = outs[rid].outputs[0]
        assert c.logprobs is not None and len(c.logprobs) == 6
        assert all(1 <= len(step) <= 1 + k for step in c.logprobs)
        assert math.isclose(
            c.cumulative_logprob,
            sum(step[t].logprob for step, t in zip(c.logprobs, c.token_ids, strict=True)),
            abs_tol=1e-4,
        )
    plain = outs["plain"].outputs[0]
    assert plain.cumulative_logprob is not None and plain.cumulative_logprob < 0
    state = engine.runner.sampling_state
    assert state is not None and state.num_seqs == 3
