"""A Qwen3.5 hybrid (Gated DeltaNet + gated attention) under tensor parallelism: each rank holds its share of
the linear layers' heads, conv channels and recurrent state, and of the attention heads; every step plan
carries the recurrent group's slots and snapshots to every rank. TP=2 gives TP=1's and HF transformers'
greedy ids on the forced workload (preemption, chunked prefill, prefix hits from state snapshots, n=2)."""

from __future__ import annotations

from pathlib import Path

from pagedrs.executor import TPExecutor
from tests.distributed.helpers_tp import PROMPTS, check_forced, run_workload, tp_engine
from tests.helpers import make_tiny_model
from tests.models.helpers_families import hf_reference
from tests.models.helpers_qwen3_5 import qwen3_5_config


def test_tp2_qwen3_5_equals_tp1_and_hf(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "qwen3_5", qwen3_5_config())
    one = tp_engine(folder, 1)
    ids1, spy1 = run_workload(one)
    check_forced(one, spy1)
    two = tp_engine(folder, 2)
    try:
        assert isinstance(two.engine_core.executor, TPExecutor)
        ids2, spy2 = run_workload(two)
        check_forced(two, spy2)
    finally:
        two.shutdown()
    assert ids2 == ids1
    ref = hf_reference(folder)
    for i, prompt in enumerate(PROMPTS):
        assert ids1[str(i)][0] == ref(prompt, 10), i
