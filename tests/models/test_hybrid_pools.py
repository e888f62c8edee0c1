"""A hybrid model's recurrent group (Qwen3.5: Gated DeltaNet layers beside full attention) in the engine's
figures: the start-up pools line names its state slots and counts them in the concurrency, the per-group usage
metrics carry it, and preemption with a swap space falls back to recomputing (the state is not swapped), the
greedy ids unchanged."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tests.engine.conftest import assert_pool_free, greedy, make_engine, random_prompts
from tests.helpers import make_tiny_model
from tests.models.helpers_qwen3_5 import qwen3_5_config

SLOTS = 4  # max_num_seqs: one live state slot each


def _engine(folder: Path, num_kv_blocks: int, **kw: Any):
    return make_engine(
        folder,
        dtype="float32",
        block_size=4,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=8,
        max_num_seqs=SLOTS,
        max_model_len=64,
        **kw,
    )


def test_recurrent_group_in_startup_line_metrics_and_swap(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = make_tiny_model(tmp_path / "m", qwen3_5_config())
    prompts = random_prompts([14, 9, 11], seed=4)
    want: dict[str, list[int]] = {}
    ref = _engine(folder, 64)
    for i, p in enumerate(prompts):
        ref.add_request(str(i), p, greedy(8))
    while ref.has_unfinished_requests():
        want.update({o.request_id: list(o.outputs[0].token_ids) for o in ref.step() if o.finished})
    with caplog.at_level(logging.INFO, logger="pagedrs"):
        engine = _engine(folder, 12, swap_space=0.001)
    # 12 blocks hold 12 / 16 = 0.75 requests of 64 tokens; the 4 state slots hold 4
    assert (
        "KV cache pools: full attention 12 blocks (1 layers); recurrent state 4 slots (3 layers); maximum "
        "concurrency for 64 tokens per request over every pool: 0.75x"
    ) in caplog.text
    assert "Maximum concurrency for 64 tokens per request: 0.75x" in caplog.text
    swaps = preempted = 0
    execute = engine.engine_core.executor.execute

    def spy(plan: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal swaps, preempted
        swaps += len(plan.swap_out) + len(plan.group_swap_out)
        preempted += len(plan.preempted)
        return execute(plan, *args, **kwargs)

    engine.engine_core.executor.execute = spy  # type: ignore[method-assign]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(8))
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        got.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
        stats = engine.get_stats()
        assert set(stats.kv_group_usage) == {"full", "recurrent"}
        assert stats.kv_group_usage["recurrent"] == pytest.approx(stats.num_running / SLOTS)
        assert stats.kv_usage == pytest.approx(max(stats.kv_group_usage.values()))
    assert got == want
    assert preempted > 0 and swaps == 0, (preempted, swaps)  # recomputed, not swapped
    assert engine.get_stats().num_swap_blocks > 0
    assert_pool_free(engine)
