"""The fused layer kernels (cuda/layer_ops.cu) on a GPU against the torch path of the same layers, at model
shapes: hidden 896..8192, 1..512 tokens, head sizes 64/128, positions to 8k, every dtype. Skipped only
where no CUDA GPU is present (the CPU emulator runs the same kernels in tests/kernels/test_emu_layer_ops.py).
The end-to-end greedy tests in test_backend_gpu.py run them too: the cupy backend switches them on."""

from __future__ import annotations

import pytest
import torch

from pagedrs.layers.activation import GeluAndMul, SiluAndMul
from pagedrs.layers.norm import RMSNorm
from pagedrs.layers.rotary import RotaryEmbedding

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    atol, rtol = TOL[ref.dtype]
    torch.testing.assert_close(ours.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [896, 2048, 4096, 8192, 5120 + 8])
@pytest.mark.parametrize("tokens", [1, 64, 512])
def test_norms(dtype: torch.dtype, hidden: int, tokens: int) -> None:
    norm = RMSNorm(hidden, 1e-5, dtype=dtype, device="cuda")
    norm.weight.data = torch.rand(hidden, device="cuda").add_(0.5).to(dtype)
    x = torch.randn(tokens, hidden, device="cuda").to(dtype)
    residual = torch.randn(tokens, hidden, device="cuda").to(dtype)
    ref = norm(x)
    ref_out, ref_res = norm(x.clone(), residual.clone())
    norm.use_kernels = True
    _close(norm(x), ref)
    out, res = norm(x, residual)
    torch.cuda.synchronize()
    assert torch.equal(res, ref_res)
    _close(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize(("head", "rotary_dim"), [(128, 128), (64, 64), (128, 64), (80, 80)])
def test_rotary(dtype: torch.dtype, neox: bool, head: int, rotary_dim: int) -> None:
    heads, kv_heads, tokens = 32, 8, 300
    params = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    rope = RotaryEmbedding(head, rotary_dim, 8192, params, is_neox_style=neox, device="cuda")
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head, device="cuda").to(dtype)
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    q, k, _ = qkv.split([heads * head, kv_heads * head, kv_heads * head], dim=-1)
    ref_q, ref_k = rope(positions, q.clone(), k.clone())
    rope.use_kernels = True
    out_q, out_k = rope(positions, q, k)
    if dtype == torch.float32:  # fma contraction may differ in the last bit
        _close(out_q, ref_q)
        _close(out_k, ref_k)
    else:  # the torch path's roundings, to the bit
        assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layer", [SiluAndMul(), GeluAndMul("none"), GeluAndMul("tanh")])
@pytest.mark.parametrize(("tokens", "d"), [(1, 14336), (256, 8192), (64, 4864), (7, 1000)])
def test_gated_activations(dtype: torch.dtype, layer: torch.nn.Module, tokens: int, d: int) -> None:
    x = torch.randn(tokens, 2 * d, device="cuda").mul_(3).to(dtype)
    layer.use_kernels = False
    ref = layer(x)
    layer.use_kernels = True
    ours = layer(x)
    layer.use_kernels = False
    _close(ours, ref)
