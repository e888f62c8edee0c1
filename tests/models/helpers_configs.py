"""Tiny random HF configs of the non-Llama architectures (GPT-2, OPT, Phi-3), shared by the model, engine
and distributed tests; write one out with `tests.helpers.make_tiny_model(folder, config)`."""

from __future__ import annotations

import transformers

from tests.helpers import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

PHI3_HEAD_SIZE = 16
PHI3_ORIGINAL_MAX = 12  # longrope: sequences longer than this use the long factors


def gpt2_config(**overrides: object) -> transformers.GPT2Config:
    kwargs: dict[str, object] = dict(
        vocab_size=VOCAB_SIZE,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=128,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    return transformers.GPT2Config(**{**kwargs, **overrides})


def opt_config(**overrides: object) -> transformers.OPTConfig:
    kwargs: dict[str, object] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    return transformers.OPTConfig(**{**kwargs, **overrides})


def phi3_config(**overrides: object) -> transformers.Phi3Config:
    kwargs: dict[str, object] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    return transformers.Phi3Config(**{**kwargs, **overrides})


def longrope_overrides(rotary_dim: int = PHI3_HEAD_SIZE) -> dict[str, object]:
    """As the 128k checkpoints write it: rope_scaling {type, short_factor, long_factor} + the original
    context at the top level (HF derives factor = max / original and the attention factor from it)."""
    n = rotary_dim // 2
    return {
        "original_max_position_embeddings": PHI3_ORIGINAL_MAX,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(n)],
            "long_factor": [1.0 + 0.9 * i for i in range(n)],
        },
    }
