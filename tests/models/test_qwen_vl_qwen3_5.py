"""Qwen3.5's multimodal checkpoints, dense and MoE (Gated DeltaNet hybrid text model, interleaved M-RoPE over a
partial rotary, the Qwen3-VL-style tower without DeepStack) against HF transformers, float32: positions equal
`get_rope_index`, the tower equals `get_image_features`, logits with one and two images of different sizes
equal HF's (no KV cache: the recurrent layers run the whole prompt), and prompts with images through the
engine give HF's greedy ids, with prefix-cache hits resuming the recurrent state from a snapshot past an
image."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from PIL import Image

from pagedrs.layers.attention import ForwardContext
from pagedrs.loader import load_model
from pagedrs.models.qwen3_vl import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration
from pagedrs.multimodal import MultiModalBatch, item_tensors
from tests.engine.conftest import PlanSpy, assert_pool_free, greedy, make_engine, run_all
from tests.models.helpers_qwen3_5 import qwen3_5_config, qwen3_5_moe_config
from tests.models.helpers_qwen_vl import (
    IMAGE_ID,
    SIZES,
    build_prompt,
    hf_greedy,
    hf_logits,
    images,
    make_vl_model,
    process,
    vl_ids,
    vl_processor,
)

ATOL = 1e-4


def qwen3_5_vl_config(moe: bool = False) -> transformers.PretrainedConfig:
    """Head size 16 with half of it rotated: interleaved sections [2, 1, 1] over 4 frequency pairs; the text
    model dense or MoE."""
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    }
    make_text = qwen3_5_moe_config if moe else qwen3_5_config
    text = make_text(rope_parameters=rope, max_position_embeddings=512)
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
    make = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    return make(text_config=text.to_dict(), vision_config=vision, **vl_ids())


@dataclass
class Family:
    folder: Path
    cls: type
    hf: Any  # HF's model of the folder, float32
    model: Any  # pagedrs's, loaded by load_model


FAMILIES = {"dense": Qwen3_5ForConditionalGeneration, "moe": Qwen3_5MoeForConditionalGeneration}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    folder = make_vl_model(tmp_path_factory.mktemp(request.param), qwen3_5_vl_config(request.param == "moe"))
    hf = transformers.AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()
    model = load_model(str(folder), dtype="float32", with_tokenizer=False).model
    assert type(model) is FAMILIES[request.param]
    return Family(folder, FAMILIES[request.param], hf, model)


def test_qwen3_5_images_equal_hf(family: Family) -> None:
    hf, model = family.hf, family.model
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


def test_engine_images_greedy_equals_hf_with_prefix_hits(family: Family) -> None:
    """A prompt with two images of different sizes through the engine gives HF's greedy ids (a step budget of
    8 tokens: the placeholders split over prefill chunks, the recurrent state carried between them). A second
    wave: the same prompt with more text hits every prompt block and resumes the recurrent state from the
    snapshot past both images; the same text with another second image hits only the blocks before it (the
    image hash keys the blocks, and so the snapshots). Both give a cold run's ids."""
    engine = make_engine(
        family.folder,
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
        skip_tokenizer_init=True,
    )
    engine.input_processor.mm_processor = vl_processor(family.cls, engine.hf_config)
    spy = PlanSpy().attach(engine)
    img = [Image.fromarray(a) for a in images()]  # 4 and 12 placeholder tokens
    other = Image.fromarray(images(SIZES[1:], seed=1)[0])
    # x <start> 4 x image <end> y <start> 12 x image <end> z z: 24 tokens, the second image from token 10
    two = "x<|vision_start|><|image_pad|><|vision_end|>y<|vision_start|><|image_pad|><|vision_end|>zz"
    waves = [[("two", two, img)], [("longer", two + "more", img), ("mixed", two + "more", [img[0], other])]]
    cached = {}
    for wave in waves:
        for rid, text, imgs in wave:
            engine.add_request(rid, {"prompt": text, "multi_modal_data": {"image": imgs}}, greedy(4))
        outs = run_all(engine)
        for rid, text, imgs in wave:
            assert outs[rid].outputs[0].token_ids == hf_greedy(family.hf, text, imgs, 4), rid
            cached[rid] = outs[rid].num_cached_tokens
    # hits up to the last block boundary before the first token that differs
    assert cached == {"two": 0, "longer": 24, "mixed": 8}, cached
    assert spy.chunked_prefills > 0
    assert_pool_free(engine)
