"""Models whose every layer is windowed (Mistral with a sliding window shorter than the context) keep only
the window's blocks too: the window group's pool is all their KV memory, the full-attention pool is
bookkeeping only. Block usage stays bounded by the window while generating far past it, and the greedy ids
stay HF transformers' own with chunked prefill, a prefix hit across the window and preemption forced on."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pagedrs.executor.startup_log import kv_pools_line, log_kv_cache_size, pool_concurrency
from pagedrs.runner.kv_groups import WindowGroup, max_live_blocks
from tests.engine.conftest import greedy, make_engine, random_prompts
from tests.helpers import make_tiny_llama
from tests.models.helpers_families import hf_reference

BLOCK = 4
STEP = 8
WINDOW = 8
NUM_KV_BLOCKS = 8  # KV memory of 8 blocks over all layers: the window group's pool


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("mistralw"), arch="mistral", sliding_window=WINDOW)


def _engine(folder: Path):
    return make_engine(
        folder,
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=NUM_KV_BLOCKS,
        max_num_batched_tokens=STEP,
        enable_prefix_caching=True,
    )


def _run(engine, used: list[int]) -> dict[str, list[int]]:
    """Steps to the end; the window pool's blocks in use after each step are appended to `used`. The stats'
    usage covers the window pool: its own, and the fullest pool's."""
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = list(out.outputs[0].token_ids)
        ((_, _, n, free),) = engine.scheduler.kv_group_pools()
        used.append(n - free)
        stats = engine.scheduler.stats()
        assert stats.group_kv_usage == [pytest.approx((n - free) / n)]
        assert stats.kv_usage == pytest.approx(max(stats.group_kv_usage))  # the full pool: bookkeeping
        # The engine's per-group figures: the window pool only (no layer stores KV in the full pool).
        assert engine.get_stats().kv_group_usage == {f"window:{WINDOW}": pytest.approx((n - free) / n)}
    return final


def test_an_all_windowed_model_keeps_only_the_window_blocks(
    mistral: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ref = hf_reference(mistral)
    with caplog.at_level(logging.INFO, logger="pagedrs"):
        engine = _engine(mistral)
    runner = engine.engine_core.executor.runner
    assert [(g.window, len(g.layers)) for g in runner.kv_groups] == [(WINDOW, int(runner.model.num_layers))]
    ((name, window, num_window_blocks, _),) = engine.scheduler.kv_group_pools()
    assert (name, window, num_window_blocks) == (f"window:{WINDOW}", WINDOW, NUM_KV_BLOCKS)
    # No layer stores KV in the full-attention pool: its size is bookkeeping, never a limit.
    assert all(int(kv.shape[1]) == NUM_KV_BLOCKS for kv in runner.kv_pool.kv_caches)
    live = max_live_blocks(WINDOW, BLOCK, STEP)
    layers = int(runner.model.num_layers)
    assert (
        f"KV cache pools: full attention: no layer (its pool is bookkeeping only); window {WINDOW} "
        f"{NUM_KV_BLOCKS} blocks ({layers} layers); maximum concurrency for 1,024 tokens per request over "
        f"every pool: {NUM_KV_BLOCKS / live:.2f}x"
    ) in caplog.text
    # vLLM's start-up lines count the window pool (the full-attention pool would say 8 requests at once).
    assert f"GPU KV cache size: {NUM_KV_BLOCKS * BLOCK} tokens" in caplog.text
    assert f"Maximum concurrency for 1,024 tokens per request: {NUM_KV_BLOCKS / live:.2f}x" in caplog.text
    # One prompt generating far past the window: 25 blocks of context, never more than the live blocks.
    used: list[int] = []
    prompt = random_prompts([40], seed=3)[0]
    engine.add_request("long", prompt, greedy(60))
    assert _run(engine, used)["long"] == ref(prompt, 60)
    assert max(used) <= live < (40 + 60) // BLOCK, used
    # The same 36-token prefix again: the window layers' blocks 0..6 were freed (outside the window); the
    # hit takes the last 2 (still cached), never a freed one.
    engine.add_request("a", prompt[:36] + [5, 6], greedy(2))
    _run(engine, used)
    engine.add_request("b", prompt[:36] + [9, 10], greedy(8))
    assert _run(engine, used)["b"] == ref(prompt[:36] + [9, 10], 8)
    assert engine.get_stats().prefix_cache_hits == 36
    # Five long prompts (prefilled in chunks) decoding at once in a pool of 8 blocks (3 live ones each):
    # preemption, and every id HF's.
    prompts = random_prompts([50, 44, 37, 30, 41], seed=4)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(12))
    outs = _run(engine, used)
    for i, p in enumerate(prompts):
        assert outs[str(i)] == ref(p, 12), i
    stats = engine.get_stats()
    assert stats.num_preemptions > 0, stats
    assert max(used) <= NUM_KV_BLOCKS
    ((_, _, n, free),) = engine.scheduler.kv_group_pools()
    assert free == n and stats.num_free_blocks == stats.num_blocks
    engine.scheduler.check_invariants()


def test_the_pools_line_names_every_pool_and_the_least_concurrency() -> None:
    groups = [WindowGroup(8, (0, 1), 17), WindowGroup(32, (3,), 30)]
    line = kv_pools_line(40, groups, num_layers=4, block_size=4, max_model_len=64, step=8)
    # per request: 16 full blocks; window 8: 5 live blocks; window 32: 11 live blocks
    assert line == (
        "KV cache pools: full attention 40 blocks (1 layers); window 8 17 blocks (2 layers); window 32 30 "
        "blocks (1 layers); maximum concurrency for 64 tokens per request over every pool: 2.50x"
    )
    assert kv_pools_line(40, groups[:1], 4, 4, 64, 8).endswith("2.50x")
    assert kv_pools_line(90, groups[1:], 4, 4, 64, 8).endswith(f"{30 / 11:.2f}x")


def test_the_start_up_concurrency_is_the_tightest_pools(caplog: pytest.LogCaptureFixture) -> None:
    groups = [WindowGroup(8, (0, 1), 17), WindowGroup(32, (3,), 30)]
    assert pool_concurrency(40, groups, 4, 4, 64, 8) == [
        ("full", 40, 2.5),
        ("window:8", 17, 17 / 5),
        ("window:32", 30, 30 / 11),
    ]
    with caplog.at_level(logging.INFO, logger="pagedrs"):
        log_kv_cache_size(90, 4, 64, groups[1:], 4, 8)  # the window-32 pool is tighter than the full one
        log_kv_cache_size(40, 4, 64, groups, 3, 8)  # every layer windowed: the smallest window pool's size
        log_kv_cache_size(40, 4, 64)  # no group: the full pool's, as before
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "GPU KV cache size: 360 tokens",
        f"Maximum concurrency for 64 tokens per request: {30 / 11:.2f}x",
        "GPU KV cache size: 68 tokens",
        f"Maximum concurrency for 64 tokens per request: {30 / 11:.2f}x",
        "GPU KV cache size: 160 tokens",
        "Maximum concurrency for 64 tokens per request: 2.50x",
    ]


def test_an_all_windowed_model_swaps_its_window_blocks(mistral: Path) -> None:
    """Preemption by swap with every layer windowed: the full-attention pool's swap moves no layer's KV (it
    has none), the window group's own swap pool moves all of it, and the ids stay HF's."""
    ref = hf_reference(mistral)
    engine = make_engine(
        mistral,
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=NUM_KV_BLOCKS,
        max_num_batched_tokens=STEP,
        swap_space=0.002,
    )
    assert engine.get_stats().num_swap_blocks > 0 and engine.scheduler.kv_group_pools() != []
    executor = engine.engine_core.executor
    inner, swapped = executor.execute, [0, 0]

    def execute(plan, *args, **kwargs):
        swapped[0] += len(plan.group_swap_out)
        swapped[1] += len(plan.group_swap_in)
        return inner(plan, *args, **kwargs)

    executor.execute = execute
    prompts = random_prompts([50, 44, 37, 30, 41], seed=4)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(12))
    outs = _run(engine, [])
    for i, p in enumerate(prompts):
        assert outs[str(i)] == ref(p, 12), i
    assert swapped[0] > 0 and swapped[1] == swapped[0], swapped
    stats = engine.get_stats()
    assert stats.num_free_swap_blocks == stats.num_swap_blocks
    engine.scheduler.check_invariants()
