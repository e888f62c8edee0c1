"""The CPU decode step replays each family's layer description (`models.layer_desc`): tiny random
Llama, Qwen2, Qwen3, Gemma 2, Gemma 3, SmolLM3, Mistral (sliding window) and Phi-3 (longrope) models quantized at load (`quantization="q8_0"`) take
the fast step on their decode steps (and only there), with the same token ids and top-5 logprobs as the
modules (PAGEDRS_CPU_DECODE=0) under forced preemption, chunked prefill, prefix-cache hits and n=2. The
descriptions are what each family is: Gemma's sandwich norms, per-head q/k norms, soft caps and windows,
SmolLM3's NoPE layers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pagedrs.models.cpu_decode import CpuDecodeStep
from pagedrs.models.layer_desc import AddResidual, Attend, HeadNorm, ModelDesc, Rope
from tests.distributed.helpers_tp import (
    ENGINE_FOR,
    check_forced,
    run_workload,
    run_workload_logprobs,
    tp_engine,
)
from tests.helpers import make_tiny_llama, make_tiny_model
from tests.models.helpers_configs import longrope_overrides, phi3_config
from tests.models.helpers_cpu_decode import spy_fast_step
from tests.models.helpers_families import gemma2_config, gemma3_config, qwen3_config, smollm3_config

FAMILIES: dict[str, Callable[[Path], Path]] = {
    "llama": lambda d: make_tiny_llama(d, arch="llama"),
    "qwen2": lambda d: make_tiny_llama(d, arch="qwen2"),
    "qwen3": lambda d: make_tiny_model(d / "qwen3", qwen3_config()),
    "gemma2": lambda d: make_tiny_model(d / "gemma2", gemma2_config()),
    "gemma3": lambda d: make_tiny_model(d / "gemma3", gemma3_config()),
    "smollm3": lambda d: make_tiny_model(d / "smollm3", smollm3_config()),
    "mistral-window": lambda d: make_tiny_llama(d, arch="mistral", sliding_window=6),
    # longrope: the rotary op runs its module (per-request factors), the other ops the Rust calls
    "phi3-longrope": lambda d: make_tiny_model(d / "phi3", phi3_config(**longrope_overrides())),
}


def _ops(desc: ModelDesc, kind: type) -> list[list[Any]]:
    return [[op for op in layer if isinstance(op, kind)] for layer in desc.layers]


def _check_description(family: str, desc: ModelDesc) -> None:
    gemma = family.startswith("gemma")
    assert all(len(ops) == (2 if gemma else 0) for ops in _ops(desc, AddResidual))  # sandwich norms
    assert all(len(ops) == int(family in ("qwen3", "gemma3")) for ops in _ops(desc, HeadNorm))
    ropes = [len(ops) for ops in _ops(desc, Rope)]
    assert ropes == ([1, 1, 1, 0] if family == "smollm3" else [1] * len(desc.layers))
    attends = [ops[0].module for ops in _ops(desc, Attend)]
    if family == "gemma2":
        assert all(a.logits_soft_cap == 4.0 for a in attends)
        assert [a.sliding_window for a in attends] == [8, None, 8]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fast_step_replays_each_family_as_the_modules(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = FAMILIES[family](tmp_path)
    calls = spy_fast_step(monkeypatch)
    kw = {"quantization": "q8_0", **ENGINE_FOR.get(family, {})}  # a pool that forces preemption
    fast = tp_engine(path, 1, **kw)
    step = fast.runner.model.model.cpu_decode
    assert isinstance(step, CpuDecodeStep), "a model quantized at load on one CPU rank takes the fast step"
    _check_description(family, step.desc)
    ids, spy = run_workload(fast)
    check_forced(fast, spy)
    assert calls[0] > 0 and calls[1] > 0, calls  # decode steps taken, prefill steps declined
    got = run_workload_logprobs(tp_engine(path, 1, **kw))

    monkeypatch.setenv("PAGEDRS_CPU_DECODE", "0")
    slow = tp_engine(path, 1, **kw)
    assert slow.runner.model.model.cpu_decode is None
    taken = calls[0]
    want_ids, _ = run_workload(slow)
    assert calls[0] == taken  # off: never called
    assert ids == want_ids
    assert got == run_workload_logprobs(tp_engine(path, 1, **kw))
