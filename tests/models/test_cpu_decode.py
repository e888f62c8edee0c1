"""The quantized CPU decode step (pagedrs.models.cpu_decode): the same bits as the torch modules it replaces.

Engines over GGUF files kept quantized (tiny random Llama and Qwen2 with q/k/v biases, in two block types,
and the default model), with the fast path and without it (PAGEDRS_CPU_DECODE=0), under forced
preemption, chunked prefill, prefix-cache hits and n=2: token ids and every top-5 logprob are equal, not
close, and the fast path is checked to have run on the decode steps (and only on them). It calls a linear
layer with hooks as its module (LoRA's deltas: the same bits as the modules, with an adapter and without in
one batch; pre-hooks too) and declines steps it does not cover (prefill chunks) and models it does not
cover (float32 weights)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedrs import LLM, LoRARequest, SamplingParams
from pagedrs.engine.llm_engine import LLMEngine
from pagedrs.models.cpu_decode import CpuDecodeStep, enable_cpu_decode
from tests.distributed.helpers_tp import check_forced, run_workload, run_workload_logprobs, tp_engine
from tests.helpers import make_tiny_gguf
from tests.lora.helpers_lora import make_peft_adapter


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


def test_hooks_run_in_the_fast_path_and_float32_models_decline(
    gguf_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _Calls(monkeypatch)
    engine = tp_engine(gguf_file, 1, dtype="auto")
    layer = _model(engine).model.layers[0]
    # A forward hook on a linear layer (what LoRA adds) runs in the fast path, on its input and output.
    seen: list[tuple[int, int]] = []
    layer.mlp.down_proj.register_forward_hook(lambda m, a, out: seen.append((a[0].shape[0], out.shape[0])))
    run_workload(engine)
    assert calls.taken > 0
    assert seen and all(rows_in == rows_out for rows_in, rows_out in seen)
    # A pre-hook (it may change the input) runs there too: the layer is called as its module.
    other = tp_engine(gguf_file, 1, dtype="auto")
    pre: list[int] = []
    _model(other).model.layers[0].mlp.down_proj.register_forward_pre_hook(
        lambda m, a: pre.append(a[0].shape[0])
    )
    before, seen_before = calls.taken, len(pre)
    run_workload(other)
    assert calls.taken > before and len(pre) > seen_before

    dense = tp_engine(gguf_file, 1, dtype="float32")
    assert _model(dense).model.cpu_decode is None
    assert not enable_cpu_decode(_model(dense))
    with pytest.raises(ValueError, match="CPU decode step does not apply"):
        CpuDecodeStep(_model(dense).model)


def test_lora_deltas_in_the_fast_path_are_the_modules_bits(
    gguf_file: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A PEFT adapter on the quantized model: its decode steps take the fast path, which runs the LoRA
    hooks as the modules do; ids and logprobs equal the module path's, and the adapter changes them."""
    src = gguf_file.with_name(f"{gguf_file.stem}-gguf-src")
    adapter = make_peft_adapter(src, tmp_path / "adapter", seed=3, r=4)
    lora = LoRARequest("a", 1, str(adapter))
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": list(range(20, 47))}] * 2
    loras = [lora, lora, None, None]  # the same prompts with and without the adapter, in one batch
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    engine = dict(device="cpu", dtype="auto", enable_lora=True, num_kv_blocks=64, disable_log_stats=True)
    calls = _Calls(monkeypatch)
    got = [
        o.outputs[0]
        for o in LLM(str(gguf_file), **engine).generate(prompts, params, use_tqdm=False, lora_request=loras)
    ]
    assert calls.taken > 0
    monkeypatch.setenv("PAGEDRS_CPU_DECODE", "0")
    want = [
        o.outputs[0]
        for o in LLM(str(gguf_file), **engine).generate(prompts, params, use_tqdm=False, lora_request=loras)
    ]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.logprobs for g in got] == [w.logprobs for w in want]
    assert got[0].token_ids != got[2].token_ids or got[1].token_ids != got[3].token_ids
