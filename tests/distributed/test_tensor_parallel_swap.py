"""Preemption by swap under tensor parallelism: every rank swaps its own KV heads out to its CPU pool and
back in from the same plan; greedy ids equal one rank."""

from __future__ import annotations

from pathlib import Path

from tests.distributed.helpers_tp import run_workload, tp_engine
from tests.helpers import make_tiny_llama


def test_swap_preemption_on_every_rank(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path)
    kw = dict(swap_space=0.001)  # ~1 MiB of CPU swap per rank
    want, _ = run_workload(tp_engine(folder, 1, **kw))
    engine = tp_engine(folder, 2, **kw)
    try:
        got, spy = run_workload(engine)
        assert spy.swap_outs > 0 and spy.swap_ins > 0, "the small pool was meant to swap"
        assert got == want
        stats = engine.get_stats()
        assert stats.num_free_swap_blocks == stats.num_swap_blocks > 0
    finally:
        engine.shutdown()
