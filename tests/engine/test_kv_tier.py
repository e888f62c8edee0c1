"""The host KV tier (`kv_offloading_size`): blocks evicted from a small pool come back from host memory
instead of being recomputed, and the ids served from them equal HF transformers' (a cold run's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedrs import LLMEngine
from tests.engine.conftest import HFReference, PlanSpy, greedy, make_engine, random_prompts, run_all

ARCHS = ("llama", "qwen2")  # the tiny Mistral is all sliding-window: its KV-cache groups have no tier


def tier_stats(engine: LLMEngine) -> object:
    return engine.engine_core.scheduler.stats()


def turn(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int) -> object:
    engine.add_request(rid, prompt, greedy(max_tokens))
    return run_all(engine)[rid]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_returning_session_is_served_from_the_tier(
    arch: str, tiny_models: dict[str, Path], hf_refs: dict[str, HFReference]
) -> None:
    # 12 blocks of 16 tokens: one session of ~100 tokens at a time; chunks of 32 tokens.
    engine = make_engine(
        tiny_models[arch], num_kv_blocks=12, max_num_batched_tokens=32, kv_offloading_size=0.002
    )
    assert tier_stats(engine).num_tier_blocks >= 60
    first, other1, other2 = random_prompts([100, 110, 120], seed=3)
    out = turn(engine, "a1", first, 8)
    assert out.outputs[0].token_ids == hf_refs[arch](first, 8)
    for i, p in enumerate((other1, other2)):  # other sessions take the whole pool
        turn(engine, f"b{i}", p, 4)
    assert tier_stats(engine).tier_loaded_blocks == 0
    back = first + list(out.outputs[0].token_ids) + random_prompts([20], seed=4)[0]
    spy = PlanSpy().attach(engine)
    out = turn(engine, "a2", back, 8)
    stats = tier_stats(engine)
    # The first turn's 6 full blocks (96 tokens; its 108 tokens' 7th block filled on the return only) came
    # from the tier: the pool's own cache no longer held them.
    assert stats.tier_loaded_blocks == stats.tier_hit_blocks == 6, stats
    assert out.num_cached_tokens == 6 * 16
    assert spy.plans[0].num_computed == [96]
    assert out.outputs[0].token_ids == hf_refs[arch](back, 8)
    assert stats.num_used_tier_blocks <= stats.num_tier_blocks
    check_tier_metrics(engine)


def check_tier_metrics(engine: LLMEngine) -> None:
    """The engine's stats and Prometheus families after the return above: 6 blocks (96 tokens) loaded."""
    from pagedrs.entrypoints.openai.server.metrics import _EngineStatsCollector

    es = engine.get_stats()
    per_block = engine.engine_core.executor.runner.kv_pool.bytes_per_block
    assert es.external_prefix_cache_hits == 96
    assert es.external_prefix_cache_queries >= 96
    assert es.kv_offload_bytes_loaded == 6 * per_block
    # Every full block cached once was stored once: the three prompts' blocks, and the return's new ones.
    assert es.kv_offload_bytes_stored == es.kv_offload_used_blocks * per_block
    assert 0 < es.kv_offload_usage < 1
    samples = {m.name: m.samples[0].value for m in _EngineStatsCollector(engine.get_stats, "tiny").collect()}
    assert samples["pagedrs:external_prefix_cache_hits"] == 96
    assert samples["pagedrs:kv_offload_bytes_loaded"] == 6 * per_block
    assert samples["pagedrs:kv_offload_usage_perc"] == es.kv_offload_usage


@pytest.mark.parametrize("arch", ARCHS)
def test_tier_hits_under_preemption_and_chunked_prefill(
    arch: str, tiny_models: dict[str, Path], hf_refs: dict[str, HFReference]
) -> None:
    engine = make_engine(
        tiny_models[arch], num_kv_blocks=14, max_num_batched_tokens=24, kv_offloading_size=0.002
    )
    spy = PlanSpy().attach(engine)
    firsts = random_prompts([60, 70, 80], seed=5)
    for i, p in enumerate(firsts):  # three sessions at once in 14 blocks: preemptions
        engine.add_request(f"s{i}", p, greedy(24))
    outs = run_all(engine)
    for i, p in enumerate(firsts):
        assert outs[f"s{i}"].outputs[0].token_ids == hf_refs[arch](p, 24)
    returning = [
        p + list(outs[f"s{i}"].outputs[0].token_ids) + random_prompts([9], seed=6 + i)[0]
        for i, p in enumerate(firsts)
    ]
    for i, p in enumerate(returning):
        engine.add_request(f"r{i}", p, greedy(16))
    outs = run_all(engine)
    for i, p in enumerate(returning):
        assert outs[f"r{i}"].outputs[0].token_ids == hf_refs[arch](p, 16)
    stats = tier_stats(engine)
    assert stats.num_preemptions > 0 and spy.preemptions > 0
    assert spy.chunked_prefills > 0
    assert stats.tier_loaded_blocks > 0, stats
    tier = engine.engine_core.executor.runner.kv_pool.tier
    assert tier.background  # the ids above came with the stores on the tier's worker thread
    tier.flush()
    # every store a plan carried was copied (the last blocks cached ride on a plan yet to come)
    assert 0 < tier.blocks_stored <= stats.tier_stored_blocks


def test_without_prefix_caching_there_is_no_tier(tiny_models: dict[str, Path]) -> None:
    engine = make_engine(
        tiny_models["llama"], num_kv_blocks=12, kv_offloading_size=0.002, enable_prefix_caching=False
    )
    assert tier_stats(engine).num_tier_blocks == 0
    assert engine.engine_core.executor.runner.kv_pool.tier is None


def test_bad_offloading_args_are_rejected() -> None:
    from pagedrs.config import CacheConfig

    with pytest.raises(ValueError, match="kv_offloading_size"):
        CacheConfig(kv_offloading_size=-1.0)
    with pytest.raises(ValueError, match="kv_offloading_backend"):
        CacheConfig(kv_offloading_backend="lmcache")
