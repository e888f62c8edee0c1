"""The Rust CPU ops the quantized path switches on (RMSNorm with the residual add fused in, SiLU-and-mul)
against the torch path of the same layers: equal up to float32 summation order (1e-5 relative)."""

from __future__ import annotations

import torch

from pagedrs.layers.activation import SiluAndMul
from pagedrs.layers.cpu_fused import use_cpu_fused_ops
from pagedrs.layers.norm import RMSNorm


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


def test_argmax_logsumexp_matches_torch() -> None:
    import numpy as np
    import pytest

    from pagedrs import _core
    from pagedrs.layers.sampler import Sampler, argmax_logsumexp

    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 49155, generator=g) * 5  # the default model's vocabulary size, plus a tail
    x[1, 100] = x[1, 40000] = 60.0  # a tie: the first index wins, as in torch
    x[2, -1] = 70.0  # the max in the tail past the vectors
    x[3] = float("-inf")  # a row masked down to one token
    x[3, 12] = 0.5
    x[4, 7] = float("nan")
    x[5] = float("-inf")  # every token masked
    ids, lse = argmax_logsumexp(x)
    assert torch.equal(ids, x.argmax(dim=-1))
    want = x.logsumexp(dim=-1)
    assert torch.isnan(lse[4]) and torch.isnan(want[4])
    keep = torch.tensor([0, 1, 2, 3, 5, 6])
    torch.testing.assert_close(lse[keep], want[keep], rtol=1e-6, atol=1e-6)
    # the greedy sampler's tokens and logprobs equal torch's log_softmax of the chosen token
    sane = x[[0, 1, 2, 6]]
    out = Sampler.greedy(sane, None)
    assert torch.equal(out.sampled_token_ids, sane.argmax(dim=-1))
    assert out.sampled_logprobs is not None
    # against float64 (torch's own float32 log_softmax is off by up to 9e-6 here since torch 2.15): the
    # logprob is max - logsumexp of values up to 70, where one float32 ulp is 7.6e-6
    ref = sane.double().log_softmax(dim=-1).gather(-1, out.sampled_token_ids.view(-1, 1)).squeeze(-1)
    torch.testing.assert_close(out.sampled_logprobs.double(), ref, rtol=0, atol=8e-6)
    # a non-contiguous or float64 matrix takes torch's ops, with the same answers
    ids_t, lse_t = argmax_logsumexp(x[keep].T.contiguous().T)
    assert torch.equal(ids_t, ids[keep])
    ids64, _ = argmax_logsumexp(x[keep].double())
    assert torch.equal(ids64, ids[keep])
    with pytest.raises(ValueError, match="ids has 3 elements, expected 7"):
        _core.cpu_argmax_logsumexp(x.numpy(), np.zeros(3, dtype=np.int64), np.zeros(7, dtype=np.float32))
