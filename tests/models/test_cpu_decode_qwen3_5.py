"""The CPU decode step replays Qwen3.5's hybrid description (`models.layer_desc`): tiny random Qwen3.5 dense and
MoE models quantized at load (`quantization="q8_0"`) take the fast step on their decode steps (and only there),
with the same token ids and top-5 logprobs as the modules (PAGEDRS_CPU_DECODE=0) under forced preemption (the
recurrent state recomputed), chunked prefill (the state carried across chunks), prefix-cache hits (the state
resumed from a snapshot) and n=2 (the state forked). The description is the family: Gated DeltaNet mixers on the
linear-attention layers, gated attention (q|gate projection, zero-centred q/k norms, partial rotary, output
gate) on the full-attention layer. A Q8_0 GGUF file of the family takes the step too."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from pagedrs import _core
from pagedrs.models.cpu_decode import CpuDecodeStep
from pagedrs.models.layer_desc import (
    Block,
    GatedQKVProj,
    HeadNorm,
    LinearAttention,
    ModelDesc,
    OutputGate,
    Rope,
)
from tests.distributed.helpers_tp import check_forced, run_workload, run_workload_logprobs, tp_engine
from tests.engine.conftest import PlanSpy, greedy, make_engine, random_prompts, run_all
from tests.helpers import make_tiny_model
from tests.models import helpers_gguf_hybrid
from tests.models.helpers_cpu_decode import spy_fast_step
from tests.models.helpers_qwen3_5 import LAYER_TYPES, qwen3_5_config, qwen3_5_moe_config

FAMILIES: dict[str, Callable[[Path], Path]] = {
    "qwen3_5": lambda d: make_tiny_model(d / "qwen3_5", qwen3_5_config()),
    "qwen3_5_moe": lambda d: make_tiny_model(d / "qwen3_5_moe", qwen3_5_moe_config()),
}


def _kernel_spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Rows the Gated DeltaNet layers' decode steps ran through the Rust kernel, by the calling module (the
    fast step's or the layer's)."""
    rows: dict[str, int] = {}
    real = _core.cpu_gated_delta_decode

    def spy(qkv: Any, *args: Any, **kw: Any) -> Any:
        caller = sys._getframe(1).f_globals["__name__"]
        rows[caller] = rows.get(caller, 0) + qkv.shape[0]
        return real(qkv, *args, **kw)

    monkeypatch.setattr(_core, "cpu_gated_delta_decode", spy)
    return rows


def _check_description(desc: ModelDesc) -> None:
    kinds = [[type(op) for op in layer] for layer in desc.layers]
    for kind, ops in zip(LAYER_TYPES, kinds, strict=True):
        full = kind == "full_attention"
        assert (LinearAttention in ops) != full
        for op in (GatedQKVProj, HeadNorm, Rope, OutputGate):
            assert (op in ops) == full, (kind, ops)
        assert ops.count(Block) == 1  # the MLP (dense or MoE) as one op
    rope = next(op for layer in desc.layers for op in layer if isinstance(op, Rope)).module
    assert rope.rotary_dim < rope.head_size  # partial rotary


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fast_step_replays_qwen3_5_as_the_modules(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = FAMILIES[family](tmp_path)
    calls, kernel = spy_fast_step(monkeypatch), _kernel_spy(monkeypatch)
    kw = {"quantization": "q8_0"}
    fast = tp_engine(path, 1, **kw)
    step = fast.runner.model.model.cpu_decode
    assert isinstance(step, CpuDecodeStep), "a model quantized at load on one CPU rank takes the fast step"
    _check_description(step.desc)
    ids, spy = run_workload(fast)
    check_forced(fast, spy)
    assert calls[0] > 0 and calls[1] > 0, calls  # decode steps taken, prefill steps declined
    assert kernel.get("pagedrs.models.cpu_decode_hybrid", 0) > 0  # the fast step's decode rows on the kernel
    got = run_workload_logprobs(tp_engine(path, 1, **kw))

    monkeypatch.setenv("PAGEDRS_CPU_DECODE", "0")
    slow = tp_engine(path, 1, **kw)
    assert slow.runner.model.model.cpu_decode is None
    taken = calls[0]
    kernel.clear()
    want_ids, _ = run_workload(slow)
    assert calls[0] == taken  # off: never called
    assert kernel.get("pagedrs.layers.delta_rule", 0) > 0  # the modules' decode rows: the same kernel
    assert ids == want_ids
    assert got == run_workload_logprobs(tp_engine(path, 1, **kw))


def test_a_q8_0_gguf_takes_the_fast_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3.5 GGUF with every projection in Q8_0 (as llama.cpp's converter writes it) takes the fast step on
    its decode steps, with the modules' greedy ids (prompts chunked, the pool forcing preemption)."""
    monkeypatch.setenv("PAGEDRS_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(qwen3_5_config(linear_value_head_dim=32)).eval()
    q8_0 = tuple(n for n, _ in hf.named_parameters() if n.endswith("proj.weight"))
    real = helpers_gguf_hybrid._round
    monkeypatch.setattr(helpers_gguf_hybrid, "_round", lambda m: real(m, q8_0, ()))
    path = helpers_gguf_hybrid.write_qwen35_gguf(hf, tmp_path / "tiny-qwen35.gguf", "qwen35")
    calls = spy_fast_step(monkeypatch)

    def run() -> dict[str, list[int]]:
        engine = make_engine(path, block_size=4, max_num_batched_tokens=8, num_kv_blocks=14)
        spy = PlanSpy().attach(engine)
        for i, prompt in enumerate(random_prompts([13, 6, 20], seed=3)):
            engine.add_request(str(i), prompt, greedy(12))
        outs = run_all(engine)
        assert spy.preemptions > 0 and spy.chunked_prefills > 0
        return {rid: list(o.outputs[0].token_ids) for rid, o in outs.items()}

    ids = run()
    assert calls[0] > 0 and calls[1] > 0, calls
    monkeypatch.setenv("PAGEDRS_CPU_DECODE", "0")
    assert run() == ids
