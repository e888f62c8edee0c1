"""The quantized CPU decode step (pagedrs.models.cpu_decode): the same bits as the torch modules it replaces.

Engines over GGUF files kept quantized (tiny random Llama and Qwen2 with q/k/v biases, in two block types,
and the default model), with the fast path and without it (PAGEDRS_CPU_DECODE=0), under forced
preemption, chunked prefill, prefix-cache hits and n=2: token ids and every top-5 logprob are equal, not
close, and the fast path is checked to have run on the decode steps (and only on them). It declines steps
it does not cover (a forward hook as LoRA adds, prefill chunks) and models it does not cover (float32
weights)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedrs import LLM, SamplingParams
from pagedrs.engine.llm_engine import LLMEngine
from pagedrs.models.cpu_decode import CpuDecodeStep, enable_cpu_decode
from tests.distributed.helpers_tp import check_forced, run_workload, run_workload_logprobs, tp_engine
from tests.helpers import make_tiny_gguf


class _Calls:
    """Counts the fast path's steps taken and declined."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.taken = self.declined = 0
        real = CpuDecodeStep.forward

        def spy(step: CpuDecodeStep, *args: Any) -> Any:
            out = real(step, *args)
            if out is None:
                self.declined += 1
            else:
                self.taken += 1
            return out

        monkeypatch.setattr(CpuDecodeStep, "forward", spy)


def _model(engine: LLMEngine) -> torch.nn.Module:
    return engine.runner.model


@pytest.fixture(scope="module", params=[("llama", "Q8_0"), ("qwen2", "Q4_0"), ("llama", "Q4_1")])
def gguf_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, qtype = request.param
    return make_tiny_gguf(tmp_path_factory.mktemp(f"{arch}-{qtype}"), arch, qtype=qtype)


def test_fast_path_equals_the_modules_bit_for_bit(gguf_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _Calls(monkeypatch)
    fast = tp_engine(gguf_file, 1, dtype="auto")
    assert _model(fast).model.cpu_decode is not None, "a quantized GGUF on one CPU rank takes the fast path"
    ids, spy = run_workload(fast)
    check_forced(fast, spy)
    assert calls.taken > 0 and calls.declined > 0, (calls.taken, calls.declined)
    with_logprobs = run_workload_logprobs(tp_engine(gguf_file, 1, dtype="auto"))

    monkeypatch.setenv("PAGEDRS_CPU_DECODE", "0")
    slow = tp_engine(gguf_file, 1, dtype="auto")
    assert _model(slow).model.cpu_decode is None
    want_ids, _ = run_workload(slow)
    want = run_workload_logprobs(tp_engine(gguf_file, 1, dtype="auto"))
    assert ids == want_ids
    assert with_logprobs == want  # ids and top-5 logprobs exactly (the same kernels in the same order)


def test_default_model_decode_is_bit_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    """The main job's model: a batch of chat-length prompts, sampled (seeded) with logprobs."""
    prompts = [
        "The capital of France is",
        "Write a haiku about the sea.",
        "List three prime numbers greater than ten, then explain why each one is prime.",
    ]
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=24, logprobs=3)
    small = {"cpu_kv_cache_gb": 0.25, "disable_log_stats": True}
    calls = _Calls(monkeypatch)
    got = [o.outputs[0] for o in LLM(**small).generate(prompts, params, use_tqdm=False)]
    assert calls.taken > 0
    monkeypatch.setenv("PAGEDRS_CPU_DECODE", "0")
    want = [o.outputs[0] for o in LLM(**small).generate(prompts, params, use_tqdm=False)]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.logprobs for g in got] == [w.logprobs for w in want]


def test_declines_hooked_layers_and_float32_models(gguf_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _Calls(monkeypatch)
    engine = tp_engine(gguf_file, 1, dtype="auto")
    layer = _model(engine).model.layers[0]
    # A hook on a linear layer (what LoRA adds) must run, so the step goes through the modules.
    seen: list[int] = []
    layer.mlp.down_proj.register_forward_hook(lambda m, a, out: seen.append(out.shape[0]))
    run_workload(engine)
    assert calls.taken == 0 and calls.declined > 0
    assert seen and max(seen) >= 1

    dense = tp_engine(gguf_file, 1, dtype="float32")
    assert _model(dense).model.cpu_decode is None
    assert not enable_cpu_decode(_model(dense))
    with pytest.raises(ValueError, match="CPU decode step does not apply"):
        CpuDecodeStep(_model(dense).model)
