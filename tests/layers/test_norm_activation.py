"""RMSNorm / LayerNorm / activations against HF transformers' and torch's definitions."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pagedrs.layers.activation import get_act_and_mul_fn, get_act_fn
from pagedrs.layers.norm import LayerNorm, RMSNorm


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
