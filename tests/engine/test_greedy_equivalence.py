"""Greedy decoding through the whole engine gives HF transformers' token ids exactly (float32), on tiny
random Llama / Qwen2 / Mistral models, in settings that force each scheduler mechanism; every test checks
that the mechanism really fired and that the KV pool is free at the end."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.conftest import (
    TINY_ARCHS,
    HFReference,
    PlanSpy,
    assert_pool_free,
    greedy,
    make_engine,
    random_prompts,
    run_all,
)
from tests.engine.helpers_greedy import check_against_hf, run_batch

PROMPT_LENS = [1, 9, 40, 150, 300]
MAX_TOKENS = [64, 64, 48, 40, 12]
PROMPTS = random_prompts(PROMPT_LENS, seed=1)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_preemption_by_recompute(
    arch: str, tiny_models: dict[str, Path], hf_refs: dict[str, HFReference]
) -> None:
    engine = make_engine(tiny_models[arch], num_kv_blocks=22, max_num_batched_tokens=512)
    spy = PlanSpy().attach(engine)
    outs = run_batch(engine, PROMPTS, MAX_TOKENS)
    check_against_hf(outs, PROMPTS, MAX_TOKENS, hf_refs[arch])
    assert engine.get_stats().num_preemptions > 0 and spy.preemptions > 0
    assert spy.swap_outs == 0
    assert_pool_free(engine)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_preemption_by_swap(arch: str, tiny_models: dict[str, Path], hf_refs: dict[str, HFReference]) -> None:
    engine = make_engine(tiny_models[arch], num_kv_blocks=22, max_num_batched_tokens=512, swap_space=0.002)
    assert engine.get_stats().num_swap_blocks >= 60
    spy = PlanSpy().attach(engine)
    outs = run_batch(engine, PROMPTS, MAX_TOKENS)
    check_against_hf(outs, PROMPTS, MAX_TOKENS, hf_refs[arch])
    assert spy.swap_outs > 0 and spy.swap_ins > 0
    assert_pool_free(engine)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_chunked_prefill(arch: str, tiny_models: dict[str, Path], hf_refs: dict[str, HFReference]) -> None:
    engine = make_engine(tiny_models[arch], max_num_batched_tokens=24, num_kv_blocks=128)
    spy = PlanSpy().attach(engine)
    outs = run_batch(engine, PROMPTS, MAX_TOKENS)
    check_against_hf(outs, PROMPTS, MAX_TOKENS, hf_refs[arch])
    assert spy.chunked_prefills >= 300 // 24
    assert max(sum(p.num_scheduled) for p in spy.plans) <= 24
    assert_pool_free(engine)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_prefix_cache_hits(arch: str, tiny_models: dict[str, Path], hf_refs: dict[str, HFReference]) -> None:
    engine = make_engine(tiny_models[arch], num_kv_blocks=128)
    base = random_prompts([70], seed=5)[0]
    suffixes = random_prompts([1, 5, 30, 17], seed=6)
    prompts = [base + s for s in suffixes]
    max_tokens = [16, 24, 8, 30]
    engine.add_request("0", prompts[0], greedy(max_tokens[0]))
    outs = run_all(engine)  # the first one fills (and caches) the shared blocks
    assert outs["0"].num_cached_tokens == 0
    for i in range(1, len(prompts)):
        engine.add_request(str(i), prompts[i], greedy(max_tokens[i]))
    outs.update(run_all(engine))
    check_against_hf(outs, prompts, max_tokens, hf_refs[arch])
    stats = engine.get_stats()
    assert stats.prefix_cache_hits >= 3 * 64, stats
    for i in range(1, len(prompts)):
        assert outs[str(i)].num_cached_tokens == 64  # 4 full blocks of 16 of the shared 70 tokens
    assert_pool_free(engine)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_requests_added_while_others_run(
    arch: str, tiny_models: dict[str, Path], hf_refs: dict[str, HFReference]
) -> None:
    engine = make_engine(tiny_models[arch], num_kv_blocks=128, max_num_batched_tokens=64)
    spy = PlanSpy().attach(engine)
    final: dict = {}
    schedule = {0: [0, 1], 3: [2], 5: [3], 9: [4]}  # step -> requests added before it
    step = 0
    while step < 10 or engine.has_unfinished_requests():
        for i in schedule.get(step, []):
            engine.add_request(str(i), PROMPTS[i], greedy(MAX_TOKENS[i]))
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        step += 1
    check_against_hf(final, PROMPTS, MAX_TOKENS, hf_refs[arch])
    # a later request was prefilled in the same step as earlier ones decoded
    mixed = [
        p for p in spy.plans if any(n == 1 for n in p.num_scheduled) and any(n > 1 for n in p.num_scheduled)
    ]
    assert mixed and spy.max_batch >= 3
    assert_pool_free(engine)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_n2_parallel_samples(
    arch: str, tiny_models: dict[str, Path], hf_refs: dict[str, HFReference]
) -> None:
    engine = make_engine(tiny_models[arch], num_kv_blocks=128)
    spy = PlanSpy().attach(engine)
    prompts, max_tokens = PROMPTS[1:4], MAX_TOKENS[1:4]
    outs = run_batch(engine, prompts, max_tokens, n=2)
    check_against_hf(outs, prompts, max_tokens, hf_refs[arch])
    for out in outs.values():
        assert [c.index for c in out.outputs] == [0, 1]
    # each prompt's last token fed two logits rows (one per child) in one step
    forks = [p for p in spy.plans if len(p.logits_indices) > len(set(p.logits_indices))]
    assert len(forks) >= 1
    assert spy.copies >= 1  # 9- and 40-token prompts end in a partial block: copied on write
    assert_pool_free(engine)
