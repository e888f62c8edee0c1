"""Tiny random Qwen3.5 configs (3 Gated DeltaNet layers + 1 gated full-attention layer, float32) and the engine
run that checks greedy ids against HF transformers with chunked prefill and preemption forced."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tests.engine.conftest import (
    HFReference,
    PlanSpy,
    assert_pool_free,
    greedy,
    make_engine,
    random_prompts,
    run_all,
)
from tests.helpers import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def _text_kwargs() -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=4,
        layer_types=LAYER_TYPES,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_conv_kernel_dim=4,
        max_position_embeddings=256,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )


def qwen3_5_config(**overrides: Any) -> transformers.Qwen3_5TextConfig:
    return transformers.Qwen3_5TextConfig(**{**_text_kwargs(), **overrides})


def qwen3_5_moe_config(**overrides: Any) -> transformers.Qwen3_5MoeTextConfig:
    kw = _text_kwargs()
    del kw["intermediate_size"]
    kw.update(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    )
    return transformers.Qwen3_5MoeTextConfig(**{**kw, **overrides})


def assert_hybrid_greedy_matches_hf(folder: Path, ref: HFReference, max_tokens: int = 10) -> None:
    """Greedy ids through the engine == HF `generate` with a step budget of 8 tokens (prompts prefilled in
    chunks, the state carried across chunks) and a pool of 14 4-token blocks too small for the batch
    (preemption: the state recomputed from zero or from a snapshot), each checked to have fired, and two
    prompts sharing 16 tokens with an earlier one (prefix hits: the KV blocks and the state snapshot at the
    16-token boundary)."""
    engine = make_engine(
        folder,
        dtype="float32",
        block_size=4,
        num_kv_blocks=14,
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
    )
    spy = PlanSpy().attach(engine)
    prefix = random_prompts([16], seed=1)[0]
    first = [prefix + [7, 8, 9]]
    batch = [prefix + tail for tail in random_prompts([5, 2], seed=2)] + random_prompts([21, 12], seed=3)
    for prompts in (first, batch):
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, greedy(max_tokens))
        outs = run_all(engine)
        for i, prompt in enumerate(prompts):
            assert outs[str(i)].outputs[0].token_ids == ref(prompt, max_tokens), (
                f"prompt {len(prompt)} tokens"
            )
    stats = engine.get_stats()
    assert spy.chunked_prefills > 0, "no prompt was prefilled in chunks"
    assert stats.num_preemptions > 0 and spy.preemptions > 0, stats
    assert stats.prefix_cache_hits >= 16, stats
    assert_pool_free(engine)
    ((name, _, num_slots, num_free),) = engine.scheduler.kv_group_pools()
    assert name == "recurrent" and num_free == num_slots, (name, num_slots, num_free)


def assert_second_turn_resumes_from_snapshot(folder: Path, ref: HFReference) -> None:
    """A second turn that extends the first (its prompt, its output, new tokens) reports `num_cached_tokens`
    covering the shared part up to its last block boundary (the first turn computed every token but its last
    output) and gives HF's ids, as a cold run."""
    engine = make_engine(folder, dtype="float32", block_size=4, max_num_batched_tokens=8)
    prompt = random_prompts([13], seed=6)[0]
    engine.add_request("t1", prompt, greedy(10))
    first = run_all(engine)["t1"]
    out = list(first.outputs[0].token_ids)
    assert out == ref(prompt, 10)
    second = prompt + out + [5, 6, 7, 8, 9]
    engine.add_request("t2", second, greedy(6, logprobs=0))
    turn = run_all(engine)["t2"]
    computed = len(prompt) + len(out) - 1
    assert turn.num_cached_tokens == computed // 4 * 4 == 20, turn.num_cached_tokens
    got = list(turn.outputs[0].token_ids)
    assert got == ref(second, 6)
    # the restored state gives the cold run's logprobs, not only its argmax
    with torch.no_grad():
        logp = torch.log_softmax(ref.model(torch.tensor([second + got])).logits[0].float(), -1)
    want = [float(logp[len(second) - 1 + i, t]) for i, t in enumerate(got)]
    lps = [lp[t].logprob for lp, t in zip(turn.outputs[0].logprobs, got, strict=True)]
    assert lps == pytest.approx(want, abs=1e-4)
    assert_pool_free(engine)
