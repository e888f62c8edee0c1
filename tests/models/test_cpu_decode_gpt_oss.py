"""gpt-oss on the quantized CPU decode step (`quantization="q8_0"`, float32 experts on the fused experts
kernel): attention sinks in the Rust decode kernel (against the torch reference's softmax with sinks), q/k/v
and o biases, the biased router, the experts' biases and clamped SwiGLU, and sliding-window layers in their
own KV pool or in the shared one. The fast path is taken on the decode steps and gives the modules' ids and
top-5 logprobs (PAGEDRS_CPU_DECODE=0) under forced preemption, chunked prefill and prefix-cache hits with
prompts longer than the window; with float activations its greedy ids follow HF transformers' on the
Q8_0-rounded weights (equal up to a near tie)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedrs.engine.llm_engine import LLMEngine
from pagedrs.layers.attention.torch_ref import TorchAttentionBackend
from pagedrs.layers.quantized import QuantizedWeight
from pagedrs.models.cpu_decode import CpuDecodeStep
from pagedrs.models.layer_desc import Attend, Block
from tests.distributed.helpers_tp import PROMPTS, check_forced, run_workload_logprobs, tp_engine
from tests.engine.conftest import PlanSpy
from tests.helpers import hf_greedy_q8_0_rounded, make_step_metadata
from tests.models.helpers_gpt_oss import SLIDING_WINDOW, make_tiny_gpt_oss

# the largest logprob gap at which a Q8_0 run may pick another token than float32 HF (as the other MoE
# families' fast-path test)
NEAR_TIE_NATS = 0.1


@pytest.mark.parametrize("window", [None, 5])
def test_decode_kernel_sinks_match_the_torch_reference(window: int | None) -> None:
    """The backend's decodes with sinks through the Rust kernel equal its torch path (HF's eager softmax
    with the sink in the denominator); sinks change the output."""
    gen = torch.Generator().manual_seed(1)
    seq_lens, bs, h, kvh, d = [1, 9, 16, 17, 40, 3], 4, 6, 2, 16
    num_blocks = sum(-(-s // bs) for s in seq_lens) + 3
    meta, _ = make_step_metadata(seq_lens, [1] * len(seq_lens), block_size=bs, num_blocks=num_blocks, seed=1)
    cache = torch.randn(2, num_blocks, bs, kvh, d, generator=gen)
    q, k, v = (torch.randn(len(seq_lens), n, d, generator=gen) for n in (h, kvh, kvh))
    sinks = torch.tensor([-1.0, 0.0, 0.5, 2.0, 4.0, -20.0])
    outs = {}
    for use, s in ((True, sinks), (False, sinks), (True, None)):
        backend = TorchAttentionBackend(use_cpu_kernels=use)
        outs[use, s is None] = backend.forward(
            q, k, v, cache.clone(), meta, scale=1 / math.sqrt(d), sliding_window=window, sinks=s
        )
    torch.testing.assert_close(outs[True, False], outs[False, False], atol=1e-5, rtol=0)
    assert (outs[True, False] - outs[True, True]).abs().max() > 1e-2


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """[taken, declined, taken with the window layers in their own pool] steps of the fast path."""
    calls = [0, 0, 0]
    real = CpuDecodeStep.forward

    def spy(step: CpuDecodeStep, *args: Any) -> Any:
        out = real(step, *args)
        calls[out is None] += 1
        calls[2] += out is not None and bool(args[2].attn_metadata.groups)
        return out

    monkeypatch.setattr(CpuDecodeStep, "forward", spy)
    return calls


def _hf_greedy(src: Path, prompt: list[int], n: int) -> list[int]:
    """HF transformers' greedy ids with the weights `quantization="q8_0"` quantizes (every linear and
    embedding matrix: attention, router, vocabulary table and output head; not the experts nor any bias)
    rounded through Q8_0."""
    return hf_greedy_q8_0_rounded(src, prompt, n, lambda name, p: p.dim() == 2 and name.endswith(".weight"))


def _float_activations(engine: LLMEngine) -> None:
    """Every quantized matmul of `engine`'s model on the dequantized weights in float32 (the path a long
    prefill chunk takes) instead of the integer kernels' 8-bit activations: the arithmetic is then HF's on
    the Q8_0-rounded weights, and the experts' routing is not flipped by activation rounding."""
    for m in engine.runner.model.modules():
        for q in (getattr(m, "qweight", None), getattr(getattr(m, "quant", None), "weight", None)):
            if isinstance(q, QuantizedWeight):
                q.dequant_min_rows = 0


@pytest.mark.parametrize("swap_space", [None, 0.01])  # the window layers' own pool, without and with swap
def test_gpt_oss_fast_path_equals_the_modules_and_hf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap_space: float | None
) -> None:
    monkeypatch.setenv("PAGEDRS_CACHE", str(tmp_path / "cache"))
    path = make_tiny_gpt_oss(tmp_path / "gpt_oss")
    kw: dict[str, Any] = dict(quantization="q8_0", swap_space=swap_space)
    calls = _spy(monkeypatch)
    fast = tp_engine(path, 1, **kw)
    step = fast.runner.model.model.cpu_decode
    assert step is not None
    attends = [op.module for layer in step.desc.layers for op in layer if isinstance(op, Attend)]
    assert all(any(isinstance(op, Block) for op in layer) for layer in step.desc.layers)
    assert all(a.sinks is not None for a in attends)
    assert [a.sliding_window for a in attends] == [SLIDING_WINDOW, None]
    spy = PlanSpy().attach(fast)
    got = run_workload_logprobs(fast)  # ids and top-5 logprobs
    check_forced(fast, spy)
    assert calls[0] > 0 and calls[1] > 0, calls  # decode steps taken, prefill steps declined
    assert calls[2] > 0, calls  # the window pool's steps taken too
    if swap_space is None:
        _check_hf(path, tp_engine(path, 1, **kw), calls)

    monkeypatch.setenv("PAGEDRS_CPU_DECODE", "0")
    slow = tp_engine(path, 1, **kw)
    assert slow.runner.model.model.cpu_decode is None
    assert got == run_workload_logprobs(slow)


def _check_hf(path: Path, engine: LLMEngine, calls: list[int]) -> None:
    """Against HF on the same Q8_0-rounded weights, with float activations (`_float_activations`): 8-bit
    activations (the modules' as the fast path's) flip near-tie expert choices of these tiny random
    routers, which moves logits by up to ~0.6 nats; in float32 the step is HF's arithmetic. Up to the
    first difference the ids are HF's, and there HF's pick is within NEAR_TIE_NATS of the engine's."""
    _float_activations(engine)
    taken = calls[0]
    outs = run_workload_logprobs(engine)
    assert calls[0] > taken
    for rid in ("0", "2"):  # 19 and 40 tokens: longer than the window
        got, lps = outs[rid][0]
        hf = _hf_greedy(path, PROMPTS[int(rid)], len(got))
        diff = next((i for i, (a, b) in enumerate(zip(got, hf, strict=True)) if a != b), None)
        if diff is not None:
            top = {t: lp.logprob for t, lp in lps[diff].items()}
            assert hf[diff] in top and top[got[diff]] - top[hf[diff]] <= NEAR_TIE_NATS, (rid, diff, top)
