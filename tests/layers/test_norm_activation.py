"""RMSNorm / LayerNorm / activations against HF transformers' and torch's definitions."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pagedrs.layers.activation import get_act_and_mul_fn, get_act_fn
from pagedrs.layers.norm import GemmaRMSNorm, LayerNorm, RMSNorm


def test_rmsnorm_matches_hf_and_fuses_residual():
    x, res, w = torch.randn(5, 32), torch.randn(5, 32), torch.rand(32) + 0.5
    ours = RMSNorm(32, eps=1e-5)
    ours.weight.data.copy_(w)
    hf = LlamaRMSNorm(32, eps=1e-5)
    hf.weight.data.copy_(w)
    torch.testing.assert_close(ours(x), hf(x))
    normed, new_res = ours(x, res)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(normed, hf(x + res))
    xb = x.bfloat16()
    torch.testing.assert_close(RMSNorm(32, dtype=torch.bfloat16)(xb), LlamaRMSNorm(32).bfloat16()(xb))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rmsnorm_matches_hf(dtype):
    """(1 + w) in float32, cast back once at the end (Gemma 2 and Gemma 3 share the definition)."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    x, w = torch.randn(5, 32).to(dtype), torch.randn(32) * 0.3
    ours = GemmaRMSNorm(32, eps=1e-6, dtype=dtype)
    torch.testing.assert_close(
        ours(x), x.float().mul(torch.rsqrt(x.float().pow(2).mean(-1, True) + 1e-6)).to(dtype)
    )
    ours.weight.data.copy_(w)
    for cls in (Gemma2RMSNorm, Gemma3RMSNorm):
        hf = cls(32, eps=1e-6).to(dtype)
        hf.weight.data.copy_(w)
        assert torch.equal(ours(x), hf(x))


def test_layernorm():
    x = torch.randn(4, 16)
    ln = LayerNorm(16, eps=1e-5)
    ln.weight.data.normal_()
    ln.bias.data.normal_()
    ref = torch.nn.functional.layer_norm(x, (16,), ln.weight, ln.bias, 1e-5)
    torch.testing.assert_close(ln(x), ref)
    assert LayerNorm(16, bias=False).bias is None


@pytest.mark.parametrize("name", ["gelu_new", "gelu_pytorch_tanh", "relu", "silu", "gelu"])
def test_activations_match_hf(name):
    x = torch.randn(100) * 3
    torch.testing.assert_close(get_act_fn(name)(x), ACT2FN[name](x))


def test_gated_activations():
    x = torch.randn(3, 8)
    torch.testing.assert_close(get_act_and_mul_fn("silu")(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
    gelu = torch.nn.functional.gelu(x[:, :4], approximate="tanh") * x[:, 4:]
    torch.testing.assert_close(get_act_and_mul_fn("gelu_pytorch_tanh")(x), gelu)
    with pytest.raises(ValueError, match="unsupported"):
        get_act_fn("swiglu_fancy")
    with pytest.raises(ValueError, match="unsupported"):
        get_act_and_mul_fn("relu")
