"""A random-weight Qwen2.5-VL folder for bench/vision.py, laid out as the released checkpoints are (config,
safetensors, `preprocessor_config.json` naming `Qwen2_5_VLProcessor`, tokenizer files): the vision tower of
Qwen2.5-VL-3B-Instruct (hidden 1280, 16 heads, MLP 3420, 14-pixel patches merged 2x2, 112-pixel windows)
cut to `depth` blocks, on Qwen2.5-0.5B's text shape (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864)
(head size 64: M-RoPE sections [8, 12, 12], Qwen2-VL's split halved) with a byte-level vocabulary of 512 (the real 151k-token head would dominate a CPU decode step)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

SPECIALS = ["<|endoftext|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    """One token per byte (ids 0-255), then Qwen's end-of-text and vision tokens (ids 256-260)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def make_qwen2_5_vl(path: Path, depth: int = 4) -> Path:
    """The random checkpoint described in the module docstring, saved in `path`."""
    tok = _tokenizer()
    ids = {name: tok.convert_tokens_to_ids(name) for name in SPECIALS}
    vision = dict(
        depth=depth,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=896,
        patch_size=14,
        spatial_merge_size=2,
        window_size=112,
        fullatt_block_indexes=[depth - 1],
    )
    text = dict(
        vocab_size=512,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12]},
        eos_token_id=ids["<|endoftext|>"],
    )
    config = transformers.Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(str(path))
    transformers.Qwen2VLImageProcessor(patch_size=14, merge_size=2).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    pre = path / "preprocessor_config.json"
    pre.write_text(json.dumps({**json.loads(pre.read_text()), "processor_class": "Qwen2_5_VLProcessor"}))
    return path
