"""Sliding-window layers in a KV pool of their own (`runner.kv_groups`, the core's `kv_groups`): a tiny
Gemma 3 (window 8, two local layers and one global) keeps only the window's blocks of its local layers —
freed mid-request and reused by other requests — while its greedy ids stay HF transformers' own, with
chunked prefill, prefix hits across the window and preemption; a model without a short window is unchanged.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedrs.runner.kv_groups import max_live_blocks, split_pool, split_pools, window_groups_for
from tests.engine.conftest import assert_pool_free, greedy, make_engine, random_prompts
from tests.helpers import make_tiny_model
from tests.models.helpers_families import WINDOW, gemma3_config, hf_reference

BLOCK = 4
STEP = 8


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gemma3w") / "m", gemma3_config())


def _engine(folder: Path, num_kv_blocks: int):
    return make_engine(
        folder,
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=STEP,
        enable_prefix_caching=True,
    )


def _window_pool(engine) -> tuple[int, int, int]:
    """(window, num_blocks, num_free_blocks) of the engine's one window group."""
    ((_, window, num_blocks, num_free),) = engine.scheduler.kv_group_pools()
    return window, num_blocks, num_free


def _run(engine, window_used: list[int]) -> dict:
    """Steps to the end; the window pool's blocks in use after each step are appended to `window_used`."""
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
        _, num_blocks, num_free = _window_pool(engine)
        window_used.append(num_blocks - num_free)
    return final


def test_window_blocks_freed_mid_request_and_reused(gemma3: Path) -> None:
    ref = hf_reference(gemma3)
    engine = _engine(gemma3, num_kv_blocks=40)
    window, num_window_blocks, _ = _window_pool(engine)
    live = max_live_blocks(WINDOW, BLOCK, STEP)
    assert window == WINDOW and num_window_blocks < 40
    # One 60-token prompt alone: 15+ full blocks, never more than the window's live blocks of local ones.
    used: list[int] = []
    prompt = random_prompts([60], seed=5)[0]
    engine.add_request("long", prompt, greedy(8))
    assert _run(engine, used)["long"] == ref(prompt, 8)
    assert max(used) <= live < 60 // BLOCK, used
    # Three long prompts at once: more window blocks than the pool has are used over the run (freed ones
    # are reused), and the full pool is too small for all of them (preemption); ids unchanged.
    prompts = random_prompts([50, 44, 37], seed=6)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(6))
    outs = _run(engine, used)
    for i, p in enumerate(prompts):
        assert outs[str(i)] == ref(p, 6), i
    stats = engine.get_stats()
    assert stats.num_preemptions > 0, stats
    assert sum(-(-len(p) // BLOCK) for p in prompts) > num_window_blocks
    assert_pool_free(engine)
    _, n, free = _window_pool(engine)
    assert free == n
    engine.scheduler.check_invariants()


def test_prefix_hit_across_the_window(gemma3: Path) -> None:
    ref = hf_reference(gemma3)
    engine = _engine(gemma3, num_kv_blocks=40)
    prefix = random_prompts([36], seed=7)[0]
    engine.add_request("a", prefix + [5, 6], greedy(4))
    _run(engine, [])
    before = engine.get_stats().prefix_cache_hits
    # The same 36-token prefix: its local layers' blocks 0..6 were freed (outside the window); the hit
    # takes the global layer's 9 blocks and the local layers' last 2, never a freed one.
    prompt = prefix + [9, 10, 11]
    engine.add_request("b", prompt, greedy(6))
    assert _run(engine, [])["b"] == ref(prompt, 6)
    assert engine.get_stats().prefix_cache_hits - before == 36
    engine.scheduler.check_invariants()


def test_pool_split_and_when_a_group_applies() -> None:
    assert window_groups_for([8, 8, None], 256)[0].layers == (0, 1)
    assert window_groups_for([8, 8, None], 8) == ()  # the window covers the context
    assert window_groups_for([None, None], 256) == ()
    assert [g.layers for g in window_groups_for([8, 8], 256)] == [(0, 1)]  # all layers windowed (Mistral)
    several = window_groups_for([16, None, 8, 16, 512], 256)  # one group per window size
    assert [(g.window, g.layers) for g in several] == [(8, (2,)), (16, (0, 3))]
    full, sizes = split_pools(10_000, full_block_bytes=10, groups=[(20, 5), (20, 10)], blocks_per_seq=64)
    # within the budget, in the ratio of their live blocks, each at least what a max-length sequence uses
    assert full * 10 + sum(sizes) * 20 <= 10_000 and abs(sizes[1] - 2 * sizes[0]) <= 1
    assert sizes[0] >= -(-full * 5 // 64) and sizes[1] >= -(-full * 10 // 64)
    full, window = split_pool(
        10_000, full_block_bytes=10, window_block_bytes=20, blocks_per_seq=64, live_per_seq=5
    )
    assert full * 10 + window * 20 <= 10_000
    assert window == -(-full * 5 // 64) and full > 10_000 // 30


def test_forked_sequences_copy_their_shared_window_block(gemma3: Path) -> None:
    """n=2 over a prompt ending mid-block: both samples write the shared partial block of the local layers
    too, each into its own copy (copy-on-write in the window pool); both give HF's greedy ids."""
    ref = hf_reference(gemma3)
    engine = _engine(gemma3, num_kv_blocks=40)
    prompt = random_prompts([38], seed=8)[0]
    engine.add_request("n2", prompt, greedy(6, n=2))
    outs = []
    while engine.has_unfinished_requests():
        outs = [o for o in engine.step() if o.finished] or outs
    assert [c.token_ids for c in outs[0].outputs] == [ref(prompt, 6)] * 2
    engine.scheduler.check_invariants()
    _, n, free = _window_pool(engine)
    assert free == n


def test_ngram_speculation_rolls_back_only_above_the_window(gemma3: Path) -> None:
    """Drafts are written to the window pool too; rejected ones are dropped, and blocks are freed only at
    the committed position, so the ids stay HF's."""
    ref = hf_reference(gemma3)
    engine = make_engine(
        gemma3,
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=40,
        max_num_batched_tokens=STEP,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    assert engine.scheduler.kv_group_pools() != []
    prompt = random_prompts([6], seed=9)[0] * 5  # repeats: the n-gram lookup proposes
    engine.add_request("s", prompt, greedy(12))
    assert _run(engine, [])["s"] == ref(prompt, 12)
    assert engine.get_stats().spec_num_draft_tokens > 0
    engine.scheduler.check_invariants()


def test_gemma3_1b_shape_figure() -> None:
    """The docs' figure: 8192-token requests in 4 GiB of bf16 KV, Gemma-3-1B shape (22 local layers with
    a 512-token window, 4 global, one KV head of 256), blocks of 16, a 2048-token step."""
    per_layer = 2 * 16 * 1 * 256 * 2
    budget = 4 << 30
    assert budget // (per_layer * 26) // 512 == 19  # every layer keeps all its blocks
    live = max_live_blocks(512, 16, 2048)
    full, window = split_pool(
        budget,
        full_block_bytes=per_layer * 4,
        window_block_bytes=per_layer * 22,
        blocks_per_seq=512,
        live_per_seq=live,
    )
    assert min(full // 512, window // live) == 46


class _GroupSwaps:
    """Counts the (group, block, block) swap ops of every plan the engine executes."""

    def __init__(self, engine) -> None:
        self.out = self.back = 0
        executor = engine.engine_core.executor
        inner = executor.execute

        def execute(plan, *args, **kwargs):
            self.out += len(plan.group_swap_out)
            self.back += len(plan.group_swap_in)
            return inner(plan, *args, **kwargs)

        executor.execute = execute


def test_preemption_by_swap_moves_the_window_blocks_too(
    gemma3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With swap space the window group keeps its own pool: a preempted request's live window blocks go to
    the group's own swap pool beside its full-attention blocks, and come back, and the ids stay HF's. The
    device's default swap space (CUDA's, faked here: the CPU default is none) keeps the window pool too."""
    import pagedrs.engine.arg_utils as arg_utils

    ref = hf_reference(gemma3)
    engine = make_engine(
        gemma3,
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=40,
        max_num_batched_tokens=STEP,
        swap_space=0.002,
    )
    assert engine.get_stats().num_swap_blocks > 0
    window, num_window_blocks, _ = _window_pool(engine)
    assert window == WINDOW and num_window_blocks < 40
    swaps = _GroupSwaps(engine)
    prompts = random_prompts([50, 44, 37], seed=6)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(6))
    outs = _run(engine, [])
    for i, p in enumerate(prompts):
        assert outs[str(i)] == ref(p, 6), i
    stats = engine.get_stats()
    assert stats.num_preemptions > 0 and swaps.out > 0 and swaps.back == swaps.out, (stats, vars(swaps))
    assert stats.num_free_swap_blocks == stats.num_swap_blocks
    assert_pool_free(engine)
    _, n, free = _window_pool(engine)
    assert free == n
    engine.scheduler.check_invariants()
    monkeypatch.setattr(arg_utils, "default_swap_space", lambda device_type: 4.0)
    engine = _engine(gemma3, num_kv_blocks=40)
    assert engine.engine_core.config.cache.swap_space == 4.0  # the (faked) default, not given
    assert engine.get_stats().num_swap_blocks > 0 and engine.scheduler.kv_group_pools() != []
