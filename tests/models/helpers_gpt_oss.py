"""A tiny random gpt-oss (transformers' GptOssConfig, float32) and its MXFP4 form, written by hand from
the float weights as OpenAI's format stores them: two FP4 e2m1 codes a byte (even element in the low
nibble), a uint8 e8m0 exponent per 32 elements (value = code's value * 2 ** (scale - 127))."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.helpers import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, make_tiny_model

SLIDING_WINDOW = 6
# FP4 e2m1 by code (sign bit 3), written out here rather than taken from the code under test
FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def gpt_oss_config(**overrides: object) -> transformers.GptOssConfig:
    """2 layers (sliding then full, window 6), 8 experts top-2, YaRN, a low SwiGLU limit (1.0) so that
    the clamps act on the tiny model's activations."""
    kwargs: dict[str, object] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=32,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=SLIDING_WINDOW,
        max_position_embeddings=256,
        swiglu_limit=1.0,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
    )
    return transformers.GptOssConfig(**{**kwargs, **overrides})


def make_tiny_gpt_oss(folder: Path, **overrides: object) -> Path:
    """A random tiny gpt-oss folder (safetensors + tokenizer) with sinks large enough to matter (std 1)."""
    make_tiny_model(folder, gpt_oss_config(**overrides))
    path = folder / "model.safetensors"
    state = load_file(str(path))
    gen = torch.Generator().manual_seed(7)
    for name in state:
        if name.endswith(".self_attn.sinks"):
            state[name] = torch.randn(state[name].shape, generator=gen)
    save_file(state, str(path), metadata={"format": "pt"})
    return folder


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [..., cols] (cols a multiple of 32) -> (blocks uint8 [..., cols/32, 16], scales uint8
    [..., cols/32]): per block the exponent that brings its largest magnitude within 6, each value
    rounded to the nearest FP4 code."""
    blocks = w.reshape(*w.shape[:-1], -1, 32).astype(np.float64)
    amax = np.abs(blocks).max(axis=-1)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).clip(-127, 127)
    scaled = blocks / np.exp2(exp)[..., None]
    lut = np.array(FP4)
    codes = np.abs(scaled[..., None] - lut).argmin(axis=-1).astype(np.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.astype(np.uint8), (exp + 127).astype(np.uint8)


def dequantize_reference(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float value of every element, one at a time (the oracle for pagedrs' vectorized dequantizer)."""
    out = np.zeros((*blocks.shape[:-1], 32), dtype=np.float64)
    for idx in np.ndindex(*blocks.shape[:-1]):
        scale = 2.0 ** (int(scales[idx]) - 127)
        for j in range(16):
            byte = int(blocks[idx][j])
            out[idx][2 * j] = FP4[byte & 0x0F] * scale
            out[idx][2 * j + 1] = FP4[byte >> 4] * scale
    return out.reshape(*blocks.shape[:-2], -1).astype(np.float32)


def write_mxfp4_pair(src: Path, quantized: Path, dequantized: Path) -> None:
    """From the float folder `src`: `quantized` holds its experts as MXFP4 (`*_blocks`, `*_scales` in
    [E, out, in] rows, quantization_config mxfp4), `dequantized` the same experts dequantized by
    `dequantize_reference`, in HF's float layout (what HF transformers runs as the reference)."""
    for folder in (quantized, dequantized):
        shutil.copytree(src, folder)
    state = load_file(str(src / "model.safetensors"))
    q_state: dict[str, torch.Tensor] = {}
    f_state: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            q_state[name] = f_state[name] = t
            continue
        rows = t.transpose(-1, -2).contiguous().numpy()  # HF holds [E, in, out]; MXFP4 rows are [E, out, in]
        blocks, scales = quantize_mxfp4(rows)
        q_state[f"{name}_blocks"] = torch.from_numpy(blocks)
        q_state[f"{name}_scales"] = torch.from_numpy(scales)
        deq = torch.from_numpy(dequantize_reference(blocks, scales))
        f_state[name] = deq.transpose(-1, -2).contiguous()
    save_file(q_state, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    save_file(f_state, str(dequantized / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (quantized / "config.json").write_text(json.dumps(config))
