"""Qwen3 (per-head q/k RMSNorm before RoPE, head_dim != hidden / heads, tied and untied heads) against HF
transformers, float32: logits plain and paged, and greedy ids through the engine with chunked prefill,
prefix hits and preemption."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedrs.loader import load_model
from pagedrs.models.llama import Qwen3ForCausalLM
from tests.helpers import make_tiny_model
from tests.models.helpers_families import assert_engine_greedy_matches_hf, hf_reference, qwen3_config
from tests.models.helpers_hf import assert_load_errors, assert_matches_hf, random_prompts


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def qwen3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("qwen3")
    return make_tiny_model(root / "m", qwen3_config(tie_word_embeddings=request.param))


def test_qwen3_logits_match_hf(qwen3: Path) -> None:
    assert_matches_hf(qwen3, random_prompts([20, 10, 17]), chunk=5)


def test_qwen3_engine_greedy_matches_hf(qwen3: Path) -> None:
    assert_engine_greedy_matches_hf(qwen3, hf_reference(qwen3))


def test_qwen3_model_shape(qwen3: Path) -> None:
    model = load_model(str(qwen3), dtype="float32").model
    assert isinstance(model, Qwen3ForCausalLM)
    assert (model.num_kv_heads, model.head_size) == (2, 32)  # head_dim 32, not 64 / 4
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (32,) and attn.qkv_proj.bias is None
    tied = model.config.tie_word_embeddings
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_qwen3_load_errors(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "q", qwen3_config())
    assert_load_errors(folder, "model.layers.1.self_attn.k_norm.weight", "Qwen3ForCausalLM")
