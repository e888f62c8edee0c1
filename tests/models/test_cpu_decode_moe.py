"""The quantized CPU decode step over mixture-of-experts models (Mixtral, Qwen2-MoE with its gated shared
expert, Qwen3-MoE with per-head q/k norms): tiny Q8_0 GGUF files as llama.cpp writes them. The fast path is
taken on the decode steps (each MoE block called as one op, through its own forward), gives the same token ids and top-5 logprobs as the modules (PAGEDRS_CPU_DECODE=0)
under forced preemption, chunked prefill and prefix-cache hits, and its greedy ids follow HF transformers'
on the file's dequantized weights (equal up to a near tie the 8-bit activations may break otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedrs.models.layer_desc import Block
from tests.distributed.helpers_tp import PROMPTS, check_forced, run_workload, run_workload_logprobs, tp_engine
from tests.helpers import hf_greedy_q8_0_rounded
from tests.models.helpers_cpu_decode import spy_fast_step
from tests.models.helpers_moe import make_tiny_moe_gguf

# the largest logprob gap at which a Q8_0 run may pick another token than float32 HF
NEAR_TIE_NATS = 0.1


def _hf_greedy(src: Path, prompt: list[int], n: int) -> list[int]:
    """HF transformers' greedy ids on the source model with the GGUF file's weights: every matrix the
    file holds in Q8_0 (all but the routers and the shared expert's gate) quantized and dequantized."""
    return hf_greedy_q8_0_rounded(
        src,
        prompt,
        n,
        lambda name, p: p.dim() >= 2 and not name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")),
    )


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_fast_path_equals_the_modules_and_hf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    monkeypatch.setenv("PAGEDRS_CACHE", str(tmp_path / "cache"))
    path = make_tiny_moe_gguf(tmp_path, kind, qtype="Q8_0")
    calls = spy_fast_step(monkeypatch)
    fast = tp_engine(path, 1, dtype="auto")
    step = fast.runner.model.model.cpu_decode
    assert step is not None and any(isinstance(op, Block) for layer in step.desc.layers for op in layer)
    ids, spy = run_workload(fast)
    check_forced(fast, spy)
    assert calls[0] > 0 and calls[1] > 0, calls  # decode steps taken, prefill steps declined
    with_logprobs = run_workload_logprobs(tp_engine(path, 1, dtype="auto"))

    monkeypatch.setenv("PAGEDRS_CPU_DECODE", "0")
    slow = tp_engine(path, 1, dtype="auto")
    assert slow.runner.model.model.cpu_decode is None
    want_ids, _ = run_workload(slow)
    assert ids == want_ids
    assert with_logprobs == run_workload_logprobs(tp_engine(path, 1, dtype="auto"))
    # against HF: the kernels quantize activations to 8 bits as llama.cpp does (the modules as the fast
    # path), so on these tiny random models' flat distributions a near tie may go the other way; up to the
    # first difference the ids are HF's, and there HF's pick is within NEAR_TIE_NATS of the fast path's
    src = tmp_path / f"{kind}-gguf-src"
    for rid, prompt in (("0", PROMPTS[0]), ("2", PROMPTS[2])):
        got, lps = with_logprobs[rid][0]
        hf = _hf_greedy(src, prompt, len(got))
        diff = next((i for i, (a, b) in enumerate(zip(got, hf, strict=True)) if a != b), None)
        if diff is not None:
            top = {t: lp.logprob for t, lp in lps[diff].items()}
            assert hf[diff] in top and top[got[diff]] - top[hf[diff]] <= NEAR_TIE_NATS, (rid, diff, top)
