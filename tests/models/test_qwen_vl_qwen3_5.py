"""Qwen3.5's multimodal checkpoint (Gated DeltaNet hybrid text model, interleaved M-RoPE over a partial
rotary, the Qwen3-VL-style tower without DeepStack) against HF transformers, float32: positions equal
`get_rope_index`, the tower equals `get_image_features`, and logits with one and two images of different
sizes equal HF's (no KV cache: the recurrent layers run the whole prompt)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pagedrs.layers.attention import ForwardContext
from pagedrs.loader import load_model
from pagedrs.models.qwen3_vl import Qwen3_5ForConditionalGeneration
from pagedrs.multimodal import MultiModalBatch, item_tensors
from tests.models.helpers_qwen3_5 import qwen3_5_config
from tests.models.helpers_qwen_vl import (
    IMAGE_ID,
    build_prompt,
    hf_logits,
    images,
    make_vl_model,
    process,
    vl_ids,
)

ATOL = 1e-4


def qwen3_5_vl_config() -> transformers.Qwen3_5Config:
    """Head size 16 with half of it rotated: interleaved sections [2, 1, 1] over 4 frequency pairs."""
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    }
    text = qwen3_5_config(rope_parameters=rope, max_position_embeddings=512)
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=64,
        patch_size=14,
        num_position_embeddings=16,
        spatial_merge_size=2,
    )
    return transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision, **vl_ids())


def test_qwen3_5_images_equal_hf(tmp_path: Path) -> None:
    folder = make_vl_model(tmp_path / "m", qwen3_5_vl_config())
    hf = transformers.AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()
    model = load_model(str(folder), dtype="float32", with_tokenizer=False).model
    assert type(model) is Qwen3_5ForConditionalGeneration
    assert model.model.rotary_emb.interleaved and model.model.rotary_emb.rotary_dim == 8
    data = process(images())
    one = build_prompt([[5, 6, 7], [8, 9]], data[:1])
    two = build_prompt([[11, 12], [13], [14, 15, 16]], data)
    for prompt in (one, two):
        ids = torch.tensor([prompt.ids])
        ref_pos, ref_delta = hf.model.get_rope_index(ids, (ids == IMAGE_ID).int(), image_grid_thw=prompt.grid)
        pos, delta = model.get_mrope_input_positions(prompt.ids, prompt.items, model.config)
        assert torch.equal(pos, ref_pos[:, 0]) and delta == int(ref_delta)
        with torch.no_grad():
            rows = model.embed_multimodal([item_tensors(i) for i in prompt.items])
            feats = hf.model.get_image_features(prompt.pixel_values, prompt.grid).pooler_output
            torch.testing.assert_close(torch.cat(rows), torch.cat(feats), atol=1e-5, rtol=0)
            mm = MultiModalBatch(embeds=torch.cat(rows), mask=ids[0] == IMAGE_ID)
            hidden = model(ids[0], pos, ForwardContext(None, []), mm)
            got = model.compute_logits(hidden)
        torch.testing.assert_close(got, hf_logits(hf, prompt), atol=ATOL, rtol=0)
    with torch.no_grad(), pytest.raises(ValueError, match=r"\[3, T\]"):  # 1-D positions: not silently wrong
        model(ids[0], torch.arange(len(prompt.ids)), ForwardContext(None, []), mm)
