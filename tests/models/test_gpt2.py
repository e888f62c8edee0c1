"""GPT-2: logits equal HF transformers (float32) through plain causal attention and through the paged
path (chunked prefill + decodes, batched), from safetensors and .bin; load errors name the tensor or the
architecture (the checks live in tests/models/helpers_hf.py, shared with test_opt.py and test_phi3.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedrs.loader import load_model
from tests.helpers import make_tiny_model
from tests.models.helpers_configs import gpt2_config
from tests.models.helpers_hf import assert_load_errors, assert_matches_hf, random_prompts


@pytest.mark.parametrize("weights_format", ["safetensors", "bin"])
def test_gpt2_matches_hf(tmp_path: Path, weights_format: str) -> None:
    folder = make_tiny_model(tmp_path / "gpt2", gpt2_config(), weights_format=weights_format)
    assert_matches_hf(folder, random_prompts([21, 9, 14]))


def test_gpt2_variants_match_hf(tmp_path: Path) -> None:
    """Untied LM head, an explicit n_inner, relu, and attention scaled by 1/(layer+1) (GPT-2's options)."""
    config = gpt2_config(
        tie_word_embeddings=False,
        n_inner=96,
        activation_function="relu",
        scale_attn_by_inverse_layer_idx=True,
    )
    folder = make_tiny_model(tmp_path / "gpt2-var", config)
    assert_matches_hf(folder, random_prompts([17, 8], seed=1))


def test_gpt2_loads_unprefixed_checkpoint_with_mask_buffers(tmp_path: Path) -> None:
    """openai-community/gpt2 stores "h.0.attn.c_attn.weight" (no "transformer.") plus attn.bias buffers."""
    folder = make_tiny_model(tmp_path / "gpt2-old", gpt2_config())
    path = folder / "model.safetensors"
    state = {k.removeprefix("transformer."): v for k, v in load_file(str(path)).items()}
    for i in range(2):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 128, 128))
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(state, str(path))
    assert_matches_hf(folder, random_prompts([12]), num_decode=2)


def test_gpt2_load_errors(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "gpt2", gpt2_config())
    model = load_model(str(folder), dtype="float32").model
    assert (model.num_layers, model.num_kv_heads, model.head_size) == (2, 4, 16)
    assert model.sliding_window is None and model.max_position == 128
    assert_load_errors(folder, "transformer.h.1.attn.c_attn.weight", "GPT2LMHeadModel")
