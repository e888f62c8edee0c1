"""Penalties and min_tokens through the whole engine, greedy, against HF transformers in float32: the
sampler reads each sequence's output tokens from the scheduler (the engine's one copy of them), so these
run with preemption by recompute, chunked prefill and prefix caching forced on, where a stale or short
token history would change the ids.

The reference is vLLM's rule: repetition_penalty over prompt and output tokens (HF's
RepetitionPenaltyLogitsProcessor), then frequency and presence penalties over the output tokens (which HF
does not have: written out here), then the stop tokens banned while fewer than min_tokens were sampled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from pagedrs import SamplingParams
from pagedrs.engine.llm_engine import LLMEngine
from tests.engine.conftest import PlanSpy, assert_pool_free, make_engine, random_prompts, run_all
from tests.helpers import load_hf_model

PROMPTS = random_prompts([9, 40, 150, 60], seed=21)
MAX_TOKENS = [40, 30, 12, 24]


def hf_penalized(
    model: torch.nn.Module,
    prompt: list[int],
    max_tokens: int,
    *,
    repetition: float = 1.0,
    presence: float = 0.0,
    frequency: float = 0.0,
    min_tokens: int = 0,
    stop_ids: tuple[int, ...] = (),
) -> list[int]:
    out: list[int] = []
    rep = RepetitionPenaltyLogitsProcessor(repetition) if repetition != 1.0 else None
    with torch.inference_mode():
        for _ in range(max_tokens):
            ids = torch.tensor([prompt + out])
            logits = model(ids).logits[:, -1].float()
            if rep is not None:
                logits = rep(ids, logits)
            counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=logits.shape[1])
            logits = logits - frequency * counts - presence * (counts > 0).float()
            if len(out) < min_tokens and stop_ids:
                logits[0, list(stop_ids)] = float("-inf")
            tok = int(logits[0].argmax())
            out.append(tok)
            if len(out) >= min_tokens and tok in stop_ids:
                break
    return out


@pytest.fixture(scope="module")
def hf_llama(tiny_models: dict[str, Path]) -> torch.nn.Module:
    return load_hf_model(tiny_models["llama"])


def _engine(tiny_models: dict[str, Path]) -> LLMEngine:
    # 16 blocks of 16 hold fewer tokens than the batch needs: sequences are preempted and recomputed;
    # 24-token steps chunk every prompt longer than that.
    return make_engine(
        tiny_models["llama"], num_kv_blocks=16, max_num_batched_tokens=24, enable_prefix_caching=True
    )


def test_penalties_match_hf_with_preemption_and_chunked_prefill(
    tiny_models: dict[str, Path], hf_llama: torch.nn.Module
) -> None:
    pens = dict(repetition=1.3, presence=0.4, frequency=0.25)
    engine = _engine(tiny_models)
    spy = PlanSpy().attach(engine)
    # The first prompt again as a fifth request: its blocks are found in the prefix cache.
    prompts = [*PROMPTS, PROMPTS[1]]
    max_tokens = [*MAX_TOKENS, 20]
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=n,
            ignore_eos=True,
            repetition_penalty=pens["repetition"],
            presence_penalty=pens["presence"],
            frequency_penalty=pens["frequency"],
        )
        engine.add_request(str(i), prompt, params)
    outs = run_all(engine)
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        want = hf_penalized(hf_llama, prompt, n, **pens)
        assert outs[str(i)].outputs[0].token_ids == want, f"request {i}"
    # The penalties changed the ids (else this test would not see a wrong history).
    plain = hf_penalized(hf_llama, prompts[0], max_tokens[0])
    assert outs["0"].outputs[0].token_ids != plain
    assert spy.preemptions > 0 and spy.chunked_prefills > 0
    assert engine.get_stats().prefix_cache_hits > 0
    assert_pool_free(engine)


def test_min_tokens_bans_the_stop_token_until_enough_were_sampled(
    tiny_models: dict[str, Path], hf_llama: torch.nn.Module
) -> None:
    engine = _engine(tiny_models)
    spy = PlanSpy().attach(engine)
    cases = []
    for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
        free = hf_penalized(hf_llama, prompt, n)
        stop = free[1]  # a token the model picks early: banned until min_tokens were sampled
        min_tokens = 5
        params = SamplingParams(
            temperature=0.0,
            max_tokens=n,
            min_tokens=min_tokens,
            stop_token_ids=[stop],
            repetition_penalty=1.1,
            ignore_eos=True,  # the reference knows no eos
        )
        engine.add_request(str(i), prompt, params)
        cases.append((prompt, n, min_tokens, stop))
    outs = run_all(engine)
    for i, (prompt, n, min_tokens, stop) in enumerate(cases):
        want = hf_penalized(hf_llama, prompt, n, repetition=1.1, min_tokens=min_tokens, stop_ids=(stop,))
        got = outs[str(i)].outputs[0]
        assert got.token_ids == want, f"request {i}"
        assert stop not in got.token_ids[: min_tokens - 1]
        if got.finish_reason == "stop":
            assert got.stop_reason == stop and len(got.token_ids) >= min_tokens
    assert spy.preemptions > 0 and spy.chunked_prefills > 0
    assert_pool_free(engine)
