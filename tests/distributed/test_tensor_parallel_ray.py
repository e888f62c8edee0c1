"""The `ray` executor on a local Ray cluster started here: TP=2 equals TP=1 (same forced workload as the
`mp` tests), a killed actor fails the step naming its rank, an unreachable cluster is a clear error."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedrs import LLM
from pagedrs.executor import ExecutorDeadError, RayRanks, TPExecutor
from tests.distributed.helpers_tp import ENGINE, check_forced, run_workload, tp_engine
from tests.helpers import make_tiny_llama

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_ray_tp2_equals_tp1(local_ray: None, tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path, arch="qwen2")
    want, _ = run_workload(tp_engine(folder, 1))
    engine = tp_engine(folder, 2, distributed_executor_backend="ray")
    try:
        executor = engine.engine_core.executor
        assert isinstance(executor, TPExecutor) and isinstance(executor.ranks, RayRanks)
        got, spy = run_workload(engine)
        check_forced(engine, spy)
        assert got == want
    finally:
        engine.shutdown()


def test_ray_killed_actor_fails_the_step(local_ray: None, tmp_path: Path) -> None:
    from pagedrs import SamplingParams

    folder = make_tiny_llama(tmp_path)
    engine = tp_engine(folder, 2, distributed_executor_backend="ray", num_kv_blocks=200)
    ranks = engine.engine_core.executor.ranks  # type: ignore[attr-defined]
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    engine.step()
    ray.kill(ranks.actors[1])
    start = time.monotonic()
    with pytest.raises(ExecutorDeadError, match="tensor-parallel rank 1 failed"):
        for _ in range(1000):
            engine.step()
    assert time.monotonic() - start < 30


def test_unreachable_ray_cluster_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    folder = make_tiny_llama(tmp_path)
    start = time.monotonic()
    with pytest.raises(ValueError, match="cannot reach the Ray cluster at 127.0.0.1:1"):
        LLM(str(folder), tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    assert time.monotonic() - start < 30
