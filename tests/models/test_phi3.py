"""Phi-3: logits equal HF transformers (float32), plain and paged, from safetensors and .bin, with plain
RoPE, longrope (short and long factors, per request), partial rotary and a sliding window shorter than the
prompt; load errors name the tensor or the architecture."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedrs.loader import load_model
from tests.helpers import make_tiny_model
from tests.models.helpers_configs import PHI3_HEAD_SIZE as HEAD_SIZE
from tests.models.helpers_configs import longrope_overrides, phi3_config
from tests.models.helpers_hf import assert_load_errors, assert_matches_hf, random_prompts

VARIANTS: dict[str, dict[str, object]] = {
    "rope": {},
    "sliding-window": {"sliding_window": 6},
    "partial-rotary": {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
    "longrope": longrope_overrides(),
}


@pytest.mark.parametrize("weights_format", ["safetensors", "bin"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_phi3_matches_hf(tmp_path: Path, variant: str, weights_format: str) -> None:
    folder = make_tiny_model(
        tmp_path / "phi3", phi3_config(**VARIANTS[variant]), weights_format=weights_format
    )
    # longrope: the 10-token request stays within PHI3_ORIGINAL_MAX (short factors); the others exceed it
    # from their first chunk on (long factors), so one batch mixes both and each must match HF on its own.
    seqs = random_prompts([20, 10, 17])
    assert_matches_hf(folder, seqs, chunk=13 if variant == "longrope" else 5)


def test_phi3_sliding_window_limits_attention(tmp_path: Path) -> None:
    """The window reaches the attention layers, and a window shorter than the prompt changes the logits
    (the equivalence above is then not the same as full attention)."""
    folder = make_tiny_model(tmp_path / "phi3-sw", phi3_config(sliding_window=4))
    model = load_model(str(folder), dtype="float32").model
    assert model.sliding_window == 4
    assert all(layer.self_attn.attn.sliding_window == 4 for layer in model.model.layers)
    assert_matches_hf(folder, random_prompts([23, 6], seed=3), chunk=3, num_decode=6)


def test_phi3_longrope_with_partial_rotary_matches_hf(tmp_path: Path) -> None:
    overrides = longrope_overrides(rotary_dim=HEAD_SIZE // 2)
    rope_scaling = dict(overrides.pop("rope_scaling"), partial_rotary_factor=0.5)  # type: ignore[call-overload]
    folder = make_tiny_model(tmp_path / "phi3-lp", phi3_config(rope_scaling=rope_scaling, **overrides))
    assert_matches_hf(folder, random_prompts([9, 16], seed=4), chunk=14, num_decode=3)


def test_phi3_load_errors(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "phi3", phi3_config(sliding_window=6))
    model = load_model(str(folder), dtype="float32").model
    assert (model.num_layers, model.num_kv_heads, model.head_size) == (2, 2, HEAD_SIZE)
    assert model.sliding_window == 6 and model.max_position == 128
    assert_load_errors(folder, "model.layers.1.self_attn.qkv_proj.weight", "Phi3ForCausalLM")
    assert_load_errors(folder, "model.layers.0.mlp.gate_up_proj.weight", "Phi3ForCausalLM")
