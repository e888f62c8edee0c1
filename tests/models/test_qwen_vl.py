"""Qwen2.5-VL (blocked M-RoPE, window-attention ViT) and Qwen3-VL (interleaved M-RoPE, DeepStack) against
HF transformers, float32, on tiny random checkpoints: M-RoPE positions equal HF's `get_rope_index`, each
vision tower equals HF's `get_image_features`, logits equal HF's with one and two images of different
sizes through the paged cache with chunked prefill splitting images' placeholder tokens and decodes after
(positions + delta), text-only prompts through the engine give HF's greedy ids, and a step's image-encoder
budget spreads images over steps without changing them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from PIL import Image

from pagedrs.config import SchedulerConfig
from pagedrs.engine.frontend.input_processor import InputError
from pagedrs.layers.attention import ForwardContext
from pagedrs.layers.mrope import MRotaryEmbedding, mrope_axis_map
from pagedrs.loader import load_model
from pagedrs.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from pagedrs.models.qwen3_vl import Qwen3VLForConditionalGeneration
from pagedrs.multimodal import MultiModalBatch, item_tensors
from tests.engine.conftest import (
    HFReference,
    PlanSpy,
    assert_pool_free,
    greedy,
    make_engine,
    random_prompts,
    run_all,
)
from tests.models.helpers_qwen_vl import (
    IMAGE_ID,
    SIZES,
    build_prompt,
    hf_greedy,
    hf_logits,
    images,
    make_vl_model,
    paged_logits,
    process,
    qwen2_5_vl_config,
    qwen3_vl_config,
    vl_processor,
)

ATOL = 1e-4
FAMILIES = {
    "qwen2_5_vl": (qwen2_5_vl_config, Qwen2_5_VLForConditionalGeneration),
    "qwen3_vl": (qwen3_vl_config, Qwen3VLForConditionalGeneration),
}


@dataclass
class Family:
    folder: Path
    cls: type
    hf: Any  # HF's model of the folder, float32
    model: Any  # pagedrs's, loaded by load_model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    make_config, cls = FAMILIES[request.param]
    folder = make_vl_model(tmp_path_factory.mktemp(request.param), make_config())
    hf = transformers.AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()
    model = load_model(str(folder), dtype="float32", with_tokenizer=False).model
    assert type(model) is cls
    return Family(folder, cls, hf, model)


def test_axis_maps_follow_hf_layouts() -> None:
    assert mrope_axis_map([2, 3, 3], interleaved=False).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    # HF's Qwen3-VL: pair j from h when j % 3 == 1 and j < 9, from w when j % 3 == 2 and j < 9
    assert mrope_axis_map([2, 3, 3], interleaved=True).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    # interleaved sections clip to the pairs there are (HF's strided slices): Qwen3.5's default [11, 11, 10]
    assert mrope_axis_map([11, 11, 10], interleaved=True, pairs=5).tolist() == [0, 1, 2, 0, 1]
    with pytest.raises(ValueError, match="sum"):
        MRotaryEmbedding(16, 16, 64, {"rope_type": "default"}, mrope_section=[2, 2, 2], interleaved=False)


def test_mrope_rotary_equals_hf(family: Family) -> None:
    """The rotated q/k at [3, T] positions equal HF's text rotary + apply_rotary_pos_emb; [T] positions are
    plain RoPE (the three axes equal)."""
    model, hf = family.model, family.hf
    rope = model.model.rotary_emb
    gen = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 40, (3, 9), generator=gen)
    q, k = torch.randn(9, 4 * 16, generator=gen), torch.randn(9, 2 * 16, generator=gen)
    cos, sin = hf.model.language_model.rotary_emb(q, pos[:, None, :])
    mod = __import__(type(hf).__module__, fromlist=["apply_rotary_pos_emb"])
    qh, kh = mod.apply_rotary_pos_emb(
        q.view(1, 9, 4, 16).transpose(1, 2), k.view(1, 9, 2, 16).transpose(1, 2), cos, sin
    )
    got_q, got_k = rope(pos, q.clone(), k.clone())
    torch.testing.assert_close(got_q, qh.transpose(1, 2).reshape(9, -1), atol=1e-5, rtol=0)
    torch.testing.assert_close(got_k, kh.transpose(1, 2).reshape(9, -1), atol=1e-5, rtol=0)
    flat = pos[0]
    one_q, _ = rope(flat, q.clone(), k.clone())
    three_q, _ = rope(flat.expand(3, -1), q.clone(), k.clone())
    torch.testing.assert_close(one_q, three_q, atol=1e-6, rtol=0)


def test_mrope_positions_equal_hf_get_rope_index(family: Family) -> None:
    """Mixed text/image prompts (one image; two images of different grids; an image first; text after
    the last image or none) give HF's positions and delta."""
    cls, hf = family.cls, family.hf
    data = process(images())
    cases = [
        ([[1, 2, 3], [4, 5]], data[:1]),
        ([[7] * 5, [8, 9], [10, 11, 12]], data),
        ([[], [1, 2]], data[1:]),
        ([[6], [], []], [data[1], data[0]]),
    ]
    for texts, items in cases:
        prompt = build_prompt(texts, items)
        ids = torch.tensor([prompt.ids])
        ref, ref_delta = hf.model.get_rope_index(ids, (ids == IMAGE_ID).int(), image_grid_thw=prompt.grid)
        got, delta = cls.get_mrope_input_positions(prompt.ids, prompt.items, hf.config)
        assert torch.equal(got, ref[:, 0]), texts
        assert delta == int(ref_delta), texts


def test_vision_tower_equals_hf_image_features(family: Family) -> None:
    """One image and two images of different sizes: the tower's rows (with Qwen3-VL's DeepStack rows side
    by side) equal HF's get_image_features (atol 1e-5)."""
    model, hf = family.model, family.hf
    data = process(images())
    for items in (data[:1], data):
        with torch.no_grad():
            got = torch.cat(model.embed_multimodal(items))
            out = hf.model.get_image_features(
                torch.cat([d["pixel_values"] for d in items]), torch.cat([d["image_grid_thw"] for d in items])
            )
        ref = [torch.cat(out.pooler_output)]
        ref += [torch.cat(f) for f in getattr(out, "deepstack_features", None) or []]
        torch.testing.assert_close(got, torch.cat(ref, dim=-1), atol=1e-5, rtol=0)


def test_logits_equal_hf_with_images_chunked_and_decoded(family: Family) -> None:
    """One image and two images (two requests in each step), prompts prefilled 5 tokens a step (every image
    split across steps), then 4 decodes: every token's logits equal HF's over the whole sequence."""
    model, hf = family.model, family.hf
    data = process(images())
    one = build_prompt([[5, 6, 7], [8, 9]], data[:1])
    two = build_prompt([[11, 12], [13], [14, 15, 16]], data)
    extra = {0: [20, 21, 22, 23], 1: [30, 31, 32, 33]}
    got, feeder = paged_logits(model, {0: (one, extra[0]), 1: (two, extra[1])}, chunk=5)
    for rid, prompt in ((0, one), (1, two)):
        torch.testing.assert_close(got[rid], hf_logits(hf, prompt, extra[rid]), atol=ATOL, rtol=0)
    assert feeder.image_rows_seen == sum(i.length for p in (one, two) for i in p.items)
    rows = torch.cat(model.embed_multimodal([item_tensors(i) for i in one.items]))
    mm = MultiModalBatch(embeds=rows, mask=torch.tensor(one.ids) == IMAGE_ID)
    with torch.no_grad(), pytest.raises(ValueError, match=r"\[3, T\]"):  # 1-D positions: not silently wrong
        model(torch.tensor(one.ids), torch.arange(len(one.ids)), ForwardContext(None, []), mm)
    assert len(feeder.item_steps) == 3 and all(n > 1 for n in feeder.item_steps.values()), feeder.item_steps


def test_text_only_engine_greedy_equals_hf(family: Family) -> None:
    """Text-only prompts through the VL checkpoint in the engine ([T] positions: plain RoPE) give HF's
    greedy ids, with chunked prefill; without a processor config in the folder images are refused."""
    family.hf.generation_config.eos_token_id = None
    ref = HFReference(family.hf)
    engine = make_engine(
        family.folder, dtype="float32", block_size=4, max_num_batched_tokens=8, skip_tokenizer_init=True
    )
    prompts = random_prompts([11, 19], seed=4)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(8))
    outs = run_all(engine)
    for i, prompt in enumerate(prompts):
        assert outs[str(i)].outputs[0].token_ids == ref(prompt, 8)
    # the folder has no processor config: text prompts are served, images refused at the door
    with pytest.raises(InputError, match="takes no images"):
        engine.add_request("img", {"prompt": "x", "multi_modal_data": {"image": images()[0]}}, greedy(2))


def test_engine_images_greedy_equals_hf(family: Family) -> None:
    """Prompts with one image and with two images of different sizes through the engine give HF's greedy
    ids, with a step budget of 8 tokens (images' placeholders split over prefill chunks), requests sharing
    the first one's image prefix (prefix-cache hits) and a pool too small for the batch (preemption);
    each checked to have fired."""
    engine = make_engine(
        family.folder,
        dtype="float32",
        block_size=4,
        num_kv_blocks=10,
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
        skip_tokenizer_init=True,
    )
    engine.input_processor.mm_processor = vl_processor(family.cls, engine.hf_config)
    spy = PlanSpy().attach(engine)
    img = [Image.fromarray(a) for a in images()]
    one = "ab<|vision_start|><|image_pad|><|vision_end|>cd"
    two = "x<|vision_start|><|image_pad|><|vision_end|>y<|vision_start|><|image_pad|><|vision_end|>zz"
    waves = [
        [("first", one, [img[0]])],
        [("hit", one + "ef", [img[0]]), ("two", two, img), ("swapped", "q" + two, [img[1], img[0]])],
    ]
    for wave in waves:
        for rid, text, imgs in wave:
            engine.add_request(rid, {"prompt": text, "multi_modal_data": {"image": imgs}}, greedy(6))
        outs = run_all(engine)
        for rid, text, imgs in wave:
            assert outs[rid].outputs[0].token_ids == hf_greedy(family.hf, text, imgs, 6), rid
    stats = engine.get_stats()
    assert spy.chunked_prefills > 0
    assert stats.prefix_cache_hits > 0, stats
    assert stats.num_preemptions > 0, stats


def test_encoder_budget_spreads_images_over_steps(family: Family) -> None:
    """The image-encoder budget of a step (`max_num_encoder_input_tokens`, as vLLM's scheduler): no step
    reaches more encoder rows than the budget (a prompt whose next image does not fit stops at its start and
    takes it in a later step), greedy ids stay HF's, and an image larger than the whole budget is a
    ValueError naming the value."""
    budget = 12
    engine = make_engine(
        family.folder,
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=64,  # every prompt fits one step: only the encoder budget splits them
        max_num_encoder_input_tokens=budget,
        skip_tokenizer_init=True,
    )
    engine.input_processor.mm_processor = vl_processor(family.cls, engine.hf_config)
    model = engine.runner.model
    rows_per_step: list[int] = []
    embed = model.embed_multimodal

    def counting_embed(items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        out = embed(items)
        rows_per_step.append(sum(o.shape[0] for o in out))
        return out

    model.embed_multimodal = counting_embed
    img = [Image.fromarray(a) for a in images()]  # 4 and 12 encoder rows
    other = Image.fromarray(images(SIZES[:1], seed=1)[0])  # 4 rows (not img[0]: its output would be shared)
    one = "ab<|vision_start|><|image_pad|><|vision_end|>cd"
    two = "x<|vision_start|><|image_pad|><|vision_end|>y<|vision_start|><|image_pad|><|vision_end|>zz"
    reqs = [("two", two, img), ("one", one, [other])]
    for rid, text, imgs in reqs:
        engine.add_request(rid, {"prompt": text, "multi_modal_data": {"image": imgs}}, greedy(4))
    outs = run_all(engine)
    for rid, text, imgs in reqs:
        assert outs[rid].outputs[0].token_ids == hf_greedy(family.hf, text, imgs, 4), rid
    # step 1: "two" up to its 12-row image (4 rows), "one" (4 rows); step 2: the 12-row image
    assert rows_per_step == [8, 12], rows_per_step
    assert_pool_free(engine)
    big = Image.fromarray(images([(112, 112)])[0])  # 8x8 patches: 16 encoder rows
    with pytest.raises(InputError, match=f"16 encoder tokens .*max_num_encoder_input_tokens={budget}") as err:
        engine.add_request("big", {"prompt": one, "multi_modal_data": {"image": [big]}}, greedy(2))
    assert err.value.param == "multi_modal_data"  # refused at the door, a ValueError
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="max_num_encoder_input_tokens"):
        SchedulerConfig(max_model_len=64, max_num_encoder_input_tokens=0)
