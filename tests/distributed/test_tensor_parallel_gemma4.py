"""Gemma 4 under tensor parallelism: each rank holds its share of the query heads, of the sliding layers'
two KV heads (the global layers' one KV head, k = v, replicated), of the MLPs (double-wide on the shared-KV
layers) and of the embedding tables; the per-layer input projections are whole on every rank, and the
shared-KV layers read their owners' caches on each rank. TP=2 gives TP=1's greedy ids on the forced
workload (preemption, chunked prefill, prefix hits, n=2, prompts longer than the window); the check before
the ranks start reads each layer type's KV heads."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedrs.executor import TPExecutor
from pagedrs.models.utils import check_tensor_parallel
from tests.distributed.helpers_tp import check_forced, run_workload, tp_engine
from tests.models.helpers_gemma4 import gemma4_config, make_gemma4_model


def test_tp2_gemma4_equals_tp1(tmp_path: Path) -> None:
    folder = make_gemma4_model(tmp_path / "gemma4", gemma4_config())
    one = tp_engine(folder, 1)
    ids1, spy1 = run_workload(one)
    check_forced(one, spy1)
    two = tp_engine(folder, 2)
    try:
        assert isinstance(two.engine_core.executor, TPExecutor)
        runner = two.engine_core.executor.runner
        attns = [layer.self_attn.attn for layer in runner.model.model.layers]
        # a local layer's 2 KV heads split, a global layer's one kept on both ranks
        assert [(a.num_heads, a.num_kv_heads) for a in attns[1:3]] == [(2, 1), (2, 1)]
        ids2, spy2 = run_workload(two)
        check_forced(two, spy2)
    finally:
        two.shutdown()
    assert ids2 == ids1


def test_each_layer_types_kv_heads_must_split_over_the_ranks() -> None:
    """The global layers' own KV head count is checked too (3 of them cannot split over 2 ranks)."""
    check_tensor_parallel(gemma4_config(), 4)  # 2 local KV heads on 2 ranks each, the global one on all
    config = gemma4_config(num_attention_heads=6, num_global_key_value_heads=3)
    with pytest.raises(ValueError, match="does not divide the model's 3 KV heads"):
        check_tensor_parallel(config, 2)
