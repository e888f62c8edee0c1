"""Tiny random Qwen3, Gemma 2, Gemma 3 and SmolLM3 configs (float32 tests against HF transformers), and one engine
run that forces chunked prefill, prefix-cache hits and preemption at once and checks each fired."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
from tests.helpers import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, load_hf_model

WINDOW = 8  # Gemma's sliding window in the tiny configs: every test prompt is longer


def qwen3_config(**overrides: Any) -> transformers.Qwen3Config:
    """head_dim 32 with 4 heads of a 64-wide model (head_dim != hidden / heads, as Qwen3-0.6B)."""
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    return transformers.Qwen3Config(**{**kwargs, **overrides})


def gemma2_config(**overrides: Any) -> transformers.Gemma2Config:
    """Alternating sliding (even) and global (odd) layers; caps small enough to bite on random weights;
    query_pre_attn_scalar != head_dim."""
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        attn_logit_softcapping=4.0,
        final_logit_softcapping=8.0,
        max_position_embeddings=256,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    return transformers.Gemma2Config(**{**kwargs, **overrides})


def gemma3_config(**overrides: Any) -> transformers.Gemma3TextConfig:
    """Two local layers then a global one; local RoPE base 10k, global 1M with linear scaling (as the 4B+
    checkpoints); head_dim 256 over one KV head (as Gemma 3 1B)."""
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=48,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        },
        max_position_embeddings=256,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    return transformers.Gemma3TextConfig(**{**kwargs, **overrides})


def smollm3_config(**overrides: Any) -> transformers.SmolLM3Config:
    """Four layers: the fourth a NoPE layer (`no_rope_layers` as HF derives it: every 4th)."""
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    return transformers.SmolLM3Config(**{**kwargs, **overrides})


def hf_reference(folder: Path) -> HFReference:
    hf = load_hf_model(folder)
    hf.generation_config.eos_token_id = None  # never stop early: the engine runs with ignore_eos
    return HFReference(hf)


def assert_engine_greedy_matches_hf(
    folder: Path,
    ref: HFReference,
    max_tokens: int = 10,
    num_kv_blocks: int = 14,
    unshared: tuple[int, int] = (21, 12),
    **engine_kw: Any,
) -> None:
    """Greedy ids through the engine == HF `generate`, float32, with a step budget of 8 tokens (prompts
    prefilled in chunks), a prompt sharing a cached 16-token prefix (prefix-cache hits), two `unshared`
    prompts of those lengths, and a `num_kv_blocks` pool of 4-token blocks too small for the batch
    (preemption); each checked to have fired. Every prompt is longer than the tiny Gemma and gpt-oss
    configs' window."""
    engine = make_engine(
        folder,
        dtype="float32",
        block_size=4,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
        **engine_kw,
    )
    spy = PlanSpy().attach(engine)
    prefix = random_prompts([16], seed=1)[0]
    first = [prefix + [7, 8, 9]]
    batch = [prefix + tail for tail in random_prompts([5, 2], seed=2)] + random_prompts(
        list(unshared), seed=3
    )
    for prompts in (first, batch):  # the first request's blocks are cached when the batch arrives
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, greedy(max_tokens))
        outs = run_all(engine)
        for i, prompt in enumerate(prompts):
            assert outs[str(i)].outputs[0].token_ids == ref(prompt, max_tokens), (
                f"prompt {len(prompt)} tokens"
            )
    stats = engine.get_stats()
    assert spy.chunked_prefills > 0, "no prompt was prefilled in chunks"
    assert stats.prefix_cache_hits >= 16, stats
    assert stats.num_preemptions > 0 and spy.preemptions > 0, stats
    assert_pool_free(engine)
