"""Models whose every layer is windowed (Mistral with a sliding window shorter than the context) keep only
the window's blocks too: the window group's pool is all their KV memory, the full-attention pool is
bookkeeping only. Block usage stays bounded by the window while generating far past it, and the greedy ids
stay HF transformers' own with chunked prefill, a prefix hit across the window and preemption forced on."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedrs.runner.kv_groups import max_live_blocks
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
    """Steps to the end; the window pool's blocks in use after each step are appended to `used`."""
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = list(out.outputs[0].token_ids)
        ((_, _, n, free),) = engine.scheduler.kv_group_pools()
        used.append(n - free)
    return final


def test_an_all_windowed_model_keeps_only_the_window_blocks(mistral: Path) -> None:
    ref = hf_reference(mistral)
    engine = _engine(mistral)
    runner = engine.engine_core.executor.runner
    assert [(g.window, len(g.layers)) for g in runner.kv_groups] == [(WINDOW, int(runner.model.num_layers))]
    ((name, window, num_window_blocks, _),) = engine.scheduler.kv_group_pools()
    assert (name, window, num_window_blocks) == (f"window:{WINDOW}", WINDOW, NUM_KV_BLOCKS)
    # No layer stores KV in the full-attention pool: its size is bookkeeping, never a limit.
    assert all(int(kv.shape[1]) == NUM_KV_BLOCKS for kv in runner.kv_pool.kv_caches)
    live = max_live_blocks(WINDOW, BLOCK, STEP)
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
