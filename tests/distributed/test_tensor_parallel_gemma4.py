"""Gemma 4 under tensor parallelism: each rank holds its share of the query heads, of the sliding layers'
two KV heads (the global layers' one KV head, k = v, replicated), of the MLPs (double-wide on the shared-KV
layers) and of the embedding tables; the per-layer input projections are whole on every rank, and the
shared-KV layers read their owners' caches on each rank. TP=2 gives TP=1's greedy ids on the forced
workload (preemption, chunked prefill, prefix hits, n=2, prompts longer than the window)."""

from __future__ import annotations

from pathlib import Path

from pagedrs.executor import TPExecutor
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
