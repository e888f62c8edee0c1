"""OPT: logits equal HF transformers (float32), plain and paged, from safetensors and .bin, for LayerNorm
before and after the sub-blocks, embeddings narrower than the hidden size (project_in/project_out, as in
opt-350m) and LayerNorms without affine parameters; load errors name the tensor or the architecture."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedrs.loader import load_model
from tests.helpers import make_tiny_model
from tests.models.helpers_configs import opt_config
from tests.models.helpers_hf import assert_load_errors, assert_matches_hf, random_prompts

VARIANTS = {
    "pre-ln": {"do_layer_norm_before": True},
    "post-ln": {"do_layer_norm_before": False},
    "proj-pre-ln": {"do_layer_norm_before": True, "word_embed_proj_dim": 32},
    "proj-post-ln": {"do_layer_norm_before": False, "word_embed_proj_dim": 32},  # opt-350m's layout
}


@pytest.mark.parametrize("weights_format", ["safetensors", "bin"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_opt_matches_hf(tmp_path: Path, variant: str, weights_format: str) -> None:
    folder = make_tiny_model(tmp_path / "opt", opt_config(**VARIANTS[variant]), weights_format=weights_format)
    assert_matches_hf(folder, random_prompts([19, 10, 7]))


def test_opt_variants_match_hf(tmp_path: Path) -> None:
    """LayerNorms without weight/bias, an untied LM head, no final LayerNorm (old checkpoints)."""
    config = opt_config(
        layer_norm_elementwise_affine=False, tie_word_embeddings=False, _remove_final_layer_norm=True
    )
    folder = make_tiny_model(tmp_path / "opt-var", config)
    model = load_model(str(folder), dtype="float32").model
    assert model.model.decoder.final_layer_norm is None
    assert_matches_hf(folder, random_prompts([15, 9], seed=2))


def test_opt_loads_checkpoint_without_model_prefix(tmp_path: Path) -> None:
    """facebook/opt-* checkpoints name their tensors "decoder.*" (saved from OPTModel)."""
    from safetensors.torch import load_file, save_file

    folder = make_tiny_model(tmp_path / "opt-old", opt_config(word_embed_proj_dim=32))
    path = folder / "model.safetensors"
    state = {k.removeprefix("model."): v for k, v in load_file(str(path)).items()}
    save_file(state, str(path))
    assert_matches_hf(folder, random_prompts([11]), num_decode=2)


def test_opt_load_errors(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "opt", opt_config(word_embed_proj_dim=32))
    model = load_model(str(folder), dtype="float32").model
    assert (model.num_layers, model.num_kv_heads, model.head_size) == (2, 4, 16)
    assert model.sliding_window is None and model.max_position == 128
    assert_load_errors(folder, "model.decoder.layers.0.self_attn.k_proj.weight", "OPTForCausalLM")
    assert_load_errors(folder, "model.decoder.project_in.weight", "OPTForCausalLM")
