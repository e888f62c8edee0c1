"""The Rust CPU ops the quantized path switches on (RMSNorm with the residual add fused in, SiLU-and-mul)
against the torch path of the same layers: equal up to float32 summation order (1e-5 relative)."""

from __future__ import annotations

import torch

from pagedrs.layers.activation import SiluAndMul
from pagedrs.layers.norm import RMSNorm
from pagedrs.layers.quantized import use_cpu_fused_ops


def _norm(fused: bool) -> RMSNorm:
    norm = RMSNorm(40, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 40))
    norm.cpu_fused = fused
    return norm


def test_rms_norm_matches_torch_path():
    x, res = torch.randn(7, 40), torch.randn(7, 40)
    torch.testing.assert_close(_norm(True)(x), _norm(False)(x), rtol=1e-5, atol=1e-6)
    want_x, want_res = _norm(False)(x.clone(), res.clone())
    fx, fres = x.clone(), res.clone()
    got_x, got_res = _norm(True)(fx, fres)
    assert got_x is fx and got_res is fres  # in place, as the CUDA kernel
    torch.testing.assert_close(got_res, want_res, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_x, want_x, rtol=1e-5, atol=1e-6)


def test_inputs_the_ops_do_not_take_use_torch():
    x = torch.randn(40, 7).T  # not contiguous
    torch.testing.assert_close(_norm(True)(x), _norm(False)(x))
    x64 = torch.randn(3, 40, dtype=torch.float64)
    assert _norm(True)(x64).dtype == torch.float64


def test_silu_and_mul_matches_torch_path():
    x = torch.randn(5, 2 * 24) * 4
    fused, plain = SiluAndMul(), SiluAndMul()
    fused.cpu_fused = True
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-5, atol=1e-6)
    assert fused(x[:, :46]).shape == (5, 23)  # a non-contiguous slice: torch path


def test_switch_counts_the_layers():
    model = torch.nn.Sequential(RMSNorm(8), SiluAndMul(), torch.nn.Linear(2, 2), RMSNorm(8))
    assert use_cpu_fused_ops(model) == 3
    assert all(m.cpu_fused for m in model if isinstance(m, (RMSNorm, SiluAndMul)))


def test_rope_on_column_slices_of_qkv_matches_torch_path():
    from pagedrs.layers.rotary import RotaryEmbedding

    plain = RotaryEmbedding(16, 16, 64, {"rope_theta": 10000.0})
    fused = RotaryEmbedding(16, 16, 64, {"rope_theta": 10000.0})
    fused.cpu_fused = True
    positions = torch.tensor([0, 5, 63, 2])
    qkv = torch.randn(4, 3 * 16 + 2 * 16 + 2 * 16)
    want_q, want_k = plain(positions, *qkv.clone().split([48, 32, 32], dim=-1)[:2])
    q, k, v = qkv.split([48, 32, 32], dim=-1)  # strided views, as split_qkv gives them
    v_before = v.clone()
    got_q, got_k = fused(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(v, v_before)
