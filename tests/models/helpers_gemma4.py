"""Tiny random Gemma 4 text configs (float32 tests against HF transformers) and a model folder whose
per-layer output scalars are not 1 (HF initialises them to 1, so random weights alone would not check them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.helpers import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, make_tiny_model
from tests.models.helpers_families import WINDOW

_S, _F = "sliding_attention", "full_attention"
LAYER_TYPES = [_S, _S, _F, _S, _S, _F]


def gemma4_config(**overrides: Any) -> transformers.Gemma4TextConfig:
    """Six layers (two local, one global, twice); global layers with head size 32 over one KV head whose k is
    also v (`attention_k_eq_v`), local ones 16 over two; proportional RoPE on a quarter of the global
    head; the last two layers reading the KV of layers 3 and 2, with a double-wide MLP; per-layer input
    embeddings of 8; final logits capped."""
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        sliding_window=WINDOW,
        layer_types=list(LAYER_TYPES),
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB_SIZE,
        use_double_wide_mlp=True,
        final_logit_softcapping=8.0,
        max_position_embeddings=256,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    return transformers.Gemma4TextConfig(**{**kwargs, **overrides})


def gemma4_moe_config(**overrides: Any) -> transformers.Gemma4TextConfig:
    """`gemma4_config` with the MoE block (4 experts, top 2, beside the dense MLP) and without per-layer
    input embeddings, as the 26B-A4B checkpoint."""
    kwargs: dict[str, Any] = dict(
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        hidden_size_per_layer_input=0,
    )
    return gemma4_config(**{**kwargs, **overrides})


def gemma4_multimodal_config(**text_overrides: Any) -> transformers.Gemma4Config:
    """Gemma4ForConditionalGeneration around `gemma4_config` (no vision or audio tower): the layout of the
    released checkpoints, the text model's tensors under `model.language_model.`."""
    text = gemma4_config(**text_overrides)
    return transformers.Gemma4Config(text_config=text.to_dict(), vision_config=None, audio_config=None)


def make_gemma4_model(path: Path, config: transformers.PretrainedConfig) -> Path:
    """`make_tiny_model` with every `layer_scalar` set to a random value in [0.5, 1.5]."""
    folder = make_tiny_model(path, config)
    file = folder / "model.safetensors"
    state = load_file(str(file))
    gen = torch.Generator().manual_seed(5)
    scalars = [name for name in state if name.endswith("layer_scalar")]
    assert scalars, "no layer_scalar in the checkpoint"
    for name in scalars:
        state[name] = 0.5 + torch.rand(state[name].shape, generator=gen)
    save_file(state, str(file), metadata={"format": "pt"})
    return folder
