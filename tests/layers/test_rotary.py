"""RoPE against HF transformers' rotary embeddings (default, linear, dynamic, llama3, longrope, partial)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from pagedrs.layers.rotary import get_rope, rope_parameters

HEAD, HEADS, KV_HEADS = 16, 4, 2


def llama_config(rope: dict | None, max_pos: int = 64) -> transformers.LlamaConfig:
    params = {"rope_theta": 10000.0, "rope_type": "default", **(rope or {})}
    return transformers.LlamaConfig(
        hidden_size=HEAD * HEADS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=max_pos, rope_parameters=params,
    )  # fmt: skip


def hf_apply(rotary, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """HF's rotary on one sequence: q [T, H*D], k [T, KVH*D] -> same shapes."""
    t = positions.shape[0]
    qh = q.view(1, t, -1, HEAD).transpose(1, 2)
    kh = k.view(1, t, -1, HEAD).transpose(1, 2)
    cos, sin = rotary(qh, positions[None])
    qo, ko = apply_rotary_pos_emb(qh, kh, cos, sin)
    return qo.transpose(1, 2).reshape(t, -1), ko.transpose(1, 2).reshape(t, -1)


def check(cfg, rotary_hf, positions, seq_lens=None):
    rope = get_rope(cfg, HEAD)
    t = positions.shape[0]
    q, k = torch.randn(t, HEADS * HEAD), torch.randn(t, KV_HEADS * HEAD)
    ours = rope(positions, q, k, seq_lens)
    ref = hf_apply(rotary_hf, positions, q, k)
    torch.testing.assert_close(ours[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours[1], ref[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "rope",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 16},
    ],
)  # fmt: skip
def test_matches_hf(rope):
    cfg = llama_config(rope)
    check(cfg, LlamaRotaryEmbedding(cfg), torch.tensor([0, 1, 2, 7, 30, 63, 5]))


def test_dynamic_ntk_inside_and_past_max_position():
    cfg = llama_config({"rope_type": "dynamic", "factor": 2.0}, max_pos=32)
    check(cfg, LlamaRotaryEmbedding(cfg), torch.arange(20))
    # past max_position_embeddings HF rescales the base from the longest position in the batch
    rope = get_rope(cfg, HEAD, max_position=32)
    positions = torch.arange(50)
    q, k = torch.randn(50, HEADS * HEAD), torch.randn(50, KV_HEADS * HEAD)
    ours = rope(positions, q, k)
    ref = hf_apply(LlamaRotaryEmbedding(cfg), positions, q, k)
    torch.testing.assert_close(ours[0], ref[0], atol=1e-5, rtol=1e-5)


def phi3_config(**kw) -> transformers.Phi3Config:
    half = HEAD // 2
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [2.0 + 0.5 * i for i in range(half)],
    }
    return transformers.Phi3Config(
        hidden_size=HEAD * HEADS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=128, original_max_position_embeddings=32, rope_parameters=rope, **kw,
    )  # fmt: skip


def test_longrope_short_and_long():
    cfg = phi3_config()
    assert rope_parameters(cfg)["original_max_position_embeddings"] == 32
    rope = get_rope(cfg, HEAD)
    assert rope.attention_scaling > 1.0
    check(cfg, Phi3RotaryEmbedding(cfg), torch.arange(20))  # fits: short factors
    check(cfg, Phi3RotaryEmbedding(cfg), torch.arange(40))  # longer than the original: long factors


def test_longrope_per_request_choice():
    """In a batch, each request picks short/long factors from its own length (HF's rule per sequence)."""
    cfg = phi3_config()
    rope = get_rope(cfg, HEAD)
    short_pos, long_pos = (
        torch.arange(10),
        torch.arange(36, 40),
    )  # a 10-token prompt; decodes of a 40-long one
    positions = torch.cat([short_pos, long_pos])
    seq_lens = torch.tensor([10] * 10 + [40] * 4)
    q, k = torch.randn(14, HEADS * HEAD), torch.randn(14, KV_HEADS * HEAD)
    ours = rope(positions, q, k, seq_lens)
    short_ref = rope(short_pos, q[:10], k[:10])
    torch.testing.assert_close(ours[0][:10], short_ref[0])
    # the long request's tokens use the long factors: same as rotating that request alone at length 40
    lone = rope(
        torch.arange(40), torch.cat([torch.zeros(36, HEADS * HEAD), q[10:]]), torch.zeros(40, KV_HEADS * HEAD)
    )
    torch.testing.assert_close(ours[0][10:], lone[0][36:])


def test_partial_rotary_leaves_tail():
    cfg = llama_config(None)
    cfg.rope_parameters["partial_rotary_factor"] = 0.5
    rope = get_rope(cfg, HEAD)
    assert rope.rotary_dim == HEAD // 2
    q, k = torch.randn(3, HEADS * HEAD), torch.randn(3, KV_HEADS * HEAD)
    qo, _ = rope(torch.tensor([0, 5, 9]), q, k)
    torch.testing.assert_close(
        qo.view(3, HEADS, HEAD)[..., HEAD // 2 :], q.view(3, HEADS, HEAD)[..., HEAD // 2 :]
    )
    torch.testing.assert_close(qo[0], q[0])  # position 0 is the identity


def test_old_style_config_keys():
    cfg = transformers.PretrainedConfig(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    p = rope_parameters(cfg)
    assert p["rope_type"] == "linear" and p["rope_theta"] == 5e5
