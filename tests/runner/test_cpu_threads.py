"""How many torch threads a CPU rank takes: `--num-threads`, then OMP_NUM_THREADS, then the CPUs the process may
run on (its affinity mask, so `taskset -c 0` or a container's cpuset gives 1), shared out between the ranks."""

import os

import pytest

from pagedrs.executor.rank import cpu_threads_per_rank, usable_cpus


def test_explicit_num_threads_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cpu_threads_per_rank(3, 2) == 3


def test_omp_num_threads_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cpu_threads_per_rank(None, 1) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "8")  # a budget shared by the ranks, never oversubscribed
    assert cpu_threads_per_rank(None, 2) == 4
    assert cpu_threads_per_rank(None, 16) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "not-a-number")
    assert cpu_threads_per_rank(None, 1) == usable_cpus()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity API here")
def test_affinity_mask_not_machine_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert usable_cpus() == 1
        assert cpu_threads_per_rank(None, 1) == 1
    finally:
        os.sched_setaffinity(0, before)
    assert cpu_threads_per_rank(None, len(before)) == 1
    assert cpu_threads_per_rank(None, 1) == len(before)
