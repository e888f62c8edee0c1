"""Gemma 2 (soft-capped attention and logits, alternating sliding / global layers) and Gemma 3 text (q/k
norm, local and global RoPE bases with linear scaling, head_dim 256 over one KV head) against HF
transformers, float32, with prompts longer than the sliding window: logits plain and paged, and greedy ids
through the engine with chunked prefill, prefix hits and preemption."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from pagedrs.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from tests.helpers import make_tiny_model
from tests.models.helpers_families import (
    WINDOW,
    assert_engine_greedy_matches_hf,
    gemma2_config,
    gemma3_config,
    hf_reference,
)
from tests.models.helpers_hf import assert_load_errors, assert_matches_hf, random_prompts

CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "gemma2": gemma2_config,
    "gemma3": gemma3_config,
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def gemma(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / "m", CONFIGS[request.param]())


def test_gemma_logits_match_hf(gemma: Path) -> None:
    prompts = random_prompts([20, 10, 17])
    assert min(len(p) for p in prompts) > WINDOW
    assert_matches_hf(gemma, prompts, chunk=5)


def test_gemma_engine_greedy_matches_hf(gemma: Path) -> None:
    assert_engine_greedy_matches_hf(gemma, hf_reference(gemma))


def test_gemma2_layers() -> None:
    """Soft caps, scale and windows reach the attention layers; the final cap is applied to the logits."""
    model = Gemma2ForCausalLM(gemma2_config(), dtype=torch.float32, device="cpu")
    attns = [layer.self_attn.attn for layer in model.model.layers]
    assert [a.sliding_window for a in attns] == [WINDOW, None, WINDOW]
    assert all(a.logits_soft_cap == 4.0 and a.scale == 24**-0.5 for a in attns)
    assert model.model.layers[0].self_attn.q_norm is None and model.model.local_rotary_emb is None
    model.lm_head.weight.data.normal_()  # tied to the embeddings; the model is built without weights
    hidden = torch.randn(3, 64) * 50
    logits, raw = model.compute_logits(hidden), model.lm_head.compute_logits(hidden)
    assert logits is not None and raw is not None and raw.abs().max() > 8.0
    torch.testing.assert_close(logits, torch.tanh(raw / 8.0) * 8.0)


def test_gemma3_layers() -> None:
    """q/k norm, no attention soft cap, and local layers on the 10k RoPE base, global ones on 1M / 8."""
    model = Gemma3ForCausalLM(gemma3_config(), dtype=torch.float32, device="cpu")
    layers = model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [WINDOW, WINDOW, None]
    assert all(layer.self_attn.attn.logits_soft_cap is None for layer in layers)
    assert model.head_size == 256 and model.num_kv_heads == 1
    local, full = layers[0].self_attn.rotary_emb, layers[2].self_attn.rotary_emb
    assert local is layers[1].self_attn.rotary_emb and local is not full
    torch.testing.assert_close(local.inv_freq[1], torch.tensor(10_000.0 ** (-2 / 256)))
    torch.testing.assert_close(full.inv_freq[1], torch.tensor(1_000_000.0 ** (-2 / 256) / 8))
    assert model.final_logit_softcapping is None


def test_gemma_load_errors(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "g3", gemma3_config())
    assert_load_errors(folder, "model.layers.2.post_feedforward_layernorm.weight", "Gemma3ForCausalLM")
