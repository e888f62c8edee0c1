"""The fused experts kernels (cuda/moe_ops.cu) on a GPU against the torch step of the same layer
(`fused_experts_torch`: a per-expert loop of cuBLAS matmuls), at model-like shapes: Mixtral-, Qwen3-MoE- and
gpt-oss-like experts scaled down, 1..512 tokens, every dtype, the quantized weight forms against their
dequantized weights, and the step captured in a CUDA graph. Skipped only where no CUDA GPU is present (the
CPU emulator runs the same kernels in tests/kernels/test_emu_moe_ops.py)."""

from __future__ import annotations

import pytest
import torch

from pagedrs.kernels.moe_ops import ExpertMatrix, fused_experts
from pagedrs.layers.moe import RoutingConfig, fused_experts_torch, route
from pagedrs.layers.moe.experts import ExpertActivation

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}  # of max |reference|


def _case(tokens: int, experts: int, k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype)
    wgu = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) / hidden**0.5).to(dtype)
    wd = (torch.randn(experts, hidden, inter, device="cuda", generator=g) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, experts, device="cuda", generator=g)
    weights, ids = route(logits, RoutingConfig(experts, k))
    return x, wgu, wd, weights.to(dtype), ids


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= TOL[ref.dtype] * scale, f"max error {err:.3g}, max |ref| {scale:.3g}"


SHAPES = {  # (experts, top_k, hidden, intermediate)
    "mixtral": (8, 2, 1024, 1792),
    "qwen3_moe": (64, 8, 512, 192),
    "odd": (10, 3, 520, 100),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("tokens", [1, 16, 512])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_dense_experts_match_torch(shape: str, tokens: int, dtype: torch.dtype) -> None:
    experts, k, hidden, inter = SHAPES[shape]
    x, wgu, wd, weights, ids = _case(tokens, experts, k, hidden, inter, dtype, seed=tokens)
    ref = fused_experts_torch(x, wgu, wd, weights, ids)
    out = fused_experts(x, ExpertMatrix(wgu), ExpertMatrix(wd), weights, ids)
    torch.cuda.synchronize()
    _close(out, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpt_oss_experts_with_biases_and_clamps(dtype: torch.dtype) -> None:
    x, wgu, wd, weights, ids = _case(64, 32, 4, 512, 256, dtype, seed=3)
    x = x * 4  # so the clamps act
    bgu = torch.randn(32, 512, device="cuda").to(dtype)
    bd = torch.randn(32, 512, device="cuda").to(dtype)
    act = ExpertActivation(swiglu_limit=7.0)
    ref = fused_experts_torch(x, wgu, wd, weights, ids, activation=act, b_gate_up=bgu, b_down=bd)
    out = fused_experts(
        x, ExpertMatrix(wgu), ExpertMatrix(wd), weights, ids, activation="swiglu_oai",
        swiglu_limit=7.0, gate_up_bias=bgu, down_bias=bd,
    )  # fmt: skip
    _close(out, ref)


def test_fp8_experts_match_their_dequantized_weights() -> None:
    dtype = torch.bfloat16
    x, wgu, wd, weights, ids = _case(128, 16, 2, 512, 384, dtype, seed=5)
    mats, dense = [], []
    for w in (wgu, wd):
        scale = (w.float().abs().amax(-1) / 448.0).clamp(min=1e-8)
        q = (w.float() / scale[..., None]).to(torch.float8_e4m3fn)
        mats.append(ExpertMatrix(q, "fp8", scale.contiguous()))
        dense.append((q.float() * scale[..., None]).to(dtype))
    ref = fused_experts_torch(x, dense[0], dense[1], weights, ids)
    _close(fused_experts(x, mats[0], mats[1], weights, ids), ref)


def test_the_step_replays_in_a_cuda_graph() -> None:
    """No host synchronization in the step: it captures, and a replay on new routing gives new results."""
    dtype = torch.bfloat16
    x, wgu, wd, weights, ids = _case(8, 16, 2, 256, 128, dtype, seed=9)
    gu, d = ExpertMatrix(wgu), ExpertMatrix(wd)
    fused_experts(x, gu, d, weights, ids)  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, gu, d, weights, ids)
    _, _, _, weights2, ids2 = _case(8, 16, 2, 256, 128, dtype, seed=10)
    weights.copy_(weights2)
    ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    _close(out, fused_experts_torch(x, wgu, wd, weights, ids))


def test_q8_0_experts_match_their_dequantized_weights() -> None:
    import gguf
    import numpy as np

    dtype, q8 = torch.float16, gguf.GGMLQuantizationType.Q8_0
    x, wgu, wd, weights, ids = _case(48, 8, 2, 512, 256, dtype, seed=6)
    mats, dense = [], []
    for w in (wgu, wd):
        host = w.float().cpu().numpy()
        blocks = np.stack([gguf.quants.quantize(host[e], q8) for e in range(host.shape[0])])
        deq = np.stack([gguf.quants.dequantize(b, q8) for b in blocks]).astype(np.float32)
        mats.append(ExpertMatrix(torch.from_numpy(blocks).cuda(), "q8_0", cols=host.shape[2]))
        dense.append(torch.from_numpy(deq).cuda().to(dtype))
    ref = fused_experts_torch(x, dense[0], dense[1], weights, ids)
    _close(fused_experts(x, mats[0], mats[1], weights, ids), ref)
