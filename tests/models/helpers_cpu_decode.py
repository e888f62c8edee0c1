"""The CPU decode step's check shared by its family tests: a spy counting the steps the fast path took and
declined, and the forced workload (preemption, chunked prefill, prefix hits, n=2) through a model quantized
at load, whose ids and top-5 logprobs must equal the modules' (PAGEDRS_CPU_DECODE=0)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagedrs.models.cpu_decode import CpuDecodeStep
from pagedrs.models.layer_desc import ModelDesc
from tests.distributed.helpers_tp import check_forced, run_workload_logprobs, tp_engine
from tests.engine.conftest import PlanSpy


def spy_fast_step(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """[taken, declined] steps of the fast path, counted from now."""
    calls = [0, 0]
    real = CpuDecodeStep.forward

    def spy(step: CpuDecodeStep, *args: Any) -> Any:
        out = real(step, *args)
        calls[out is None] += 1
        return out

    monkeypatch.setattr(CpuDecodeStep, "forward", spy)
    return calls


def assert_fast_step_matches_modules(path: Path, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> ModelDesc:
    """The forced workload over `path` quantized at load (`kw`: engine overrides): the fast step taken on
    every decode step and declined on the others, ids and top-5 logprobs equal to the modules'. Returns the
    replayed description."""
    calls = spy_fast_step(monkeypatch)
    kw = {"quantization": "q8_0", **kw}
    fast = tp_engine(path, 1, **kw)
    step = fast.runner.model.model.cpu_decode
    assert isinstance(step, CpuDecodeStep), "a model quantized at load on one CPU rank takes the fast step"
    spy = PlanSpy().attach(fast)
    got = run_workload_logprobs(fast)
    check_forced(fast, spy)
    assert calls[0] > 0 and calls[1] > 0, calls  # decode steps taken, prefill steps declined

    monkeypatch.setenv("PAGEDRS_CPU_DECODE", "0")
    slow = tp_engine(path, 1, **kw)
    assert slow.runner.model.model.cpu_decode is None
    taken = calls[0]
    want = run_workload_logprobs(slow)
    assert calls[0] == taken  # off: never called
    assert got == want  # ids and top-5 logprobs
    monkeypatch.delenv("PAGEDRS_CPU_DECODE")
    return step.desc
