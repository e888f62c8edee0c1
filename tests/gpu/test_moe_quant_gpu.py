"""Quantized experts kept quantized on a GPU (as vLLM's fused_moe keeps them): the fused experts kernel's fp8
form with 128 x 128 block scales (the block-FP8 checkpoints') against the torch step on the dequantized
weights at a Qwen3-MoE-like shape, and whole tiny checkpoints loaded on the GPU (block FP8 and
compressed-tensors per-channel FP8 experts kept fp8, a GGUF file's Q8_0 experts kept Q8_0) against their
float32 dequantized models. Skipped only where no CUDA GPU is present (the CPU emulator runs the same
kernels in tests/kernels/test_emu_moe_quant.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedrs.kernels.moe_ops import ExpertMatrix, fused_experts
from pagedrs.layers.moe import CudaExperts, FusedExperts, RoutingConfig, fused_experts_torch, route
from pagedrs.loader import LoadedModel, load_model
from tests.kernels.helpers_moe_quant import make_fp8_moe_pair
from tests.loader.helpers_quant import fp8_block_quantize

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
IDS = [7, 8, 9, 10, 120, 3, 55, 201, 17]


def _block_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[ExpertMatrix, torch.Tensor]:
    qs = [fp8_block_quantize(w[e].cpu(), block) for e in range(w.shape[0])]
    q = torch.stack([a for a, _ in qs]).cuda()
    s = torch.stack([b for _, b in qs]).cuda()
    full = s.repeat_interleave(block[0], 1).repeat_interleave(block[1], 2)[:, : w.shape[1], : w.shape[2]]
    return ExpertMatrix(q, "fp8", s, block=block), q.float() * full


@pytest.mark.parametrize("tokens", [1, 16, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_block_fp8_experts_match_their_dequantized_weights(tokens: int, dtype: torch.dtype) -> None:
    experts, k, hidden, inter = 32, 8, 1024, 384  # Qwen3-30B-A3B scaled down: 128-blocks over both dims
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype)
    wgu = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) / hidden**0.5
    wd = torch.randn(experts, hidden, inter, device="cuda", generator=g) / inter**0.5
    weights, ids = route(torch.randn(tokens, experts, device="cuda", generator=g), RoutingConfig(experts, k))
    (mgu, dgu), (md, dd) = _block_fp8(wgu, (128, 128)), _block_fp8(wd, (128, 128))
    ref = fused_experts_torch(x, dgu.to(dtype), dd.to(dtype), weights.to(dtype), ids)
    out = fused_experts(x, mgu, md, weights.to(dtype), ids)
    torch.cuda.synchronize()
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}[dtype]
    assert (out.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()


def _logits(loaded: LoadedModel, ids: list[int], device: str) -> torch.Tensor:
    """One prefill without a KV cache (as tests.helpers.logits_of), on `device`; float32 on the CPU."""
    from pagedrs.layers.attention import ForwardContext

    m = loaded.model
    with torch.no_grad():
        tokens, pos = torch.tensor(ids, device=device), torch.arange(len(ids), device=device)
        return m.compute_logits(m(tokens, pos, ForwardContext(None, [], None))).float().cpu()


def _experts(loaded: LoadedModel) -> list[FusedExperts]:
    found = [m for m in loaded.model.modules() if isinstance(m, FusedExperts)]
    for m in found:
        m.use_cuda_kernels(True)  # as the "cupy" backend's layer kernels switch them on
        assert isinstance(m.method, CudaExperts)
    assert found
    return found


@pytest.mark.parametrize("strategy", ["block", "channel"])
def test_fp8_moe_checkpoint_on_gpu_keeps_fp8_experts(tmp_path: Path, strategy: str) -> None:
    qdir, rdir = make_fp8_moe_pair(tmp_path, strategy, (32, 32))
    quant = load_model(str(qdir), dtype="float32", device="cuda", with_tokenizer=False)
    ref = load_model(str(rdir), dtype="float32", device="cuda", with_tokenizer=False)
    for m in _experts(quant):
        kw = m.gate_up.kernel_weight
        assert kw is not None and kw.data.dtype == torch.float8_e4m3fn and kw.data.is_cuda
    got, want = _logits(quant, IDS, "cuda"), _logits(ref, IDS, "cuda")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_q8_0_moe_gguf_on_gpu_keeps_q8_0_experts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("gguf")
    from tests.models.helpers_moe import make_tiny_moe_gguf

    monkeypatch.setenv("PAGEDRS_CACHE", str(tmp_path / "cache"))
    path = make_tiny_moe_gguf(tmp_path, "qwen3_moe", qtype="Q8_0")
    quant = load_model(str(path), dtype="bfloat16", device="cuda", with_tokenizer=False)
    dense = load_model(str(path), dtype="float32", device="cpu", with_tokenizer=False)
    for m in _experts(quant):
        kw = m.down.kernel_weight
        assert kw is not None and kw.form == "q8_0" and kw.data.is_cuda
    got, want = _logits(quant, IDS, "cuda"), _logits(dense, IDS, "cpu")
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
