"""Gemma 3 with images against HF transformers (float32, a tiny random checkpoint with its processor built
locally): greedy ids and first-token logprobs for prompts with one and two images of different sizes,
through the engine with chunked prefill (a chunk boundary that would fall inside an image is moved to the
image's start, as the bidirectional image mask needs the whole image in one chunk), preemption and prefix
hits forced on and checked to have fired; a repeated image costs no encoder run and its prompt prefix
hits, the same text with another image never does; bad inputs are errors naming the problem."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from pagedrs import SamplingParams
from pagedrs.engine.arg_utils import EngineArgs
from pagedrs.engine.frontend.input_processor import InputError, InputProcessor
from pagedrs.engine.llm_engine import LLMEngine
from pagedrs.multimodal.inputs import chat_prompt
from tests.engine.conftest import PlanSpy, assert_pool_free, make_engine, run_all
from tests.multimodal.helpers_vision import IMAGE_TOKENS, data_url, make_gemma3_vision, random_image

MAX_TOKENS = 6
BUDGET = 8  # tokens a step: every prompt is prefilled in chunks

IMG_A = random_image(40, 30, seed=0)
IMG_B = random_image(20, 50, seed=1)
# (text, images); the first and third differ only in their image
PROMPTS: list[tuple[str, list[Any]]] = [
    ("describe it <start_of_image> now", [IMG_A]),
    ("a <start_of_image> and b <start_of_image> end", [IMG_A, IMG_B]),
    ("describe it <start_of_image> now", [IMG_B]),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gemma3_vision(tmp_path_factory.mktemp("gemma3v") / "m")


@pytest.fixture(scope="module")
def hf_ref(folder: Path) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: HF's greedy ids and its first-token log-probabilities."""
    proc = transformers.AutoProcessor.from_pretrained(str(folder))
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    out = []
    for text, images in PROMPTS:
        inputs = proc(text=text, images=images, return_tensors="pt")
        with torch.no_grad():
            first = model(**inputs).logits[0, -1].log_softmax(-1)
            ids = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        out.append((ids[0, inputs["input_ids"].shape[1] :].tolist(), first))
    return out


@pytest.fixture(scope="module")
def engine(folder: Path) -> LLMEngine:
    return make_engine(
        folder,
        dtype="float32",
        block_size=4,
        num_kv_blocks=16,
        max_num_batched_tokens=BUDGET,
        enable_prefix_caching=True,
        max_model_len=128,
    )


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)


def _check(out: Any, ref: tuple[list[int], torch.Tensor]) -> None:
    ids, first = ref
    assert list(out.outputs[0].token_ids) == ids
    for tok, lp in out.outputs[0].logprobs[0].items():
        assert abs(lp.logprob - first[tok].item()) < 1e-4, (tok, lp.logprob, first[tok].item())


def test_gemma3_images_match_hf(engine: LLMEngine, hf_ref: list[tuple[list[int], torch.Tensor]]) -> None:
    spy = PlanSpy().attach(engine)
    cache = engine.runner.encoder_cache
    assert cache is not None
    mm = engine.input_processor.mm_processor
    assert mm is not None
    spans = [[(it.offset, it.offset + it.length) for it in mm.process(t, imgs)[1]] for t, imgs in PROMPTS]
    assert all(e - s == IMAGE_TOKENS for sp in spans for s, e in sp)
    # one request alone first: its blocks and its image's encoder output are cached when the batch comes
    engine.add_request("solo", {"prompt": PROMPTS[0][0], "multi_modal_data": {"image": IMG_A}}, _params())
    solo = run_all(engine)["solo"]
    _check(solo, hf_ref[0])
    assert (cache.runs, cache.hits) == (1, 0)
    seq_spans: dict[int, list[tuple[int, int]]] = {}
    for i, (text, images) in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt": text, "multi_modal_data": {"image": images}}, _params())
        seq_spans[engine.engine_core._requests[str(i)].seqs[0].seq_id] = spans[i]
    outs = run_all(engine)
    for i in range(len(PROMPTS)):
        _check(outs[str(i)], hf_ref[i])
    # each image was encoded once; the repeats (and recomputes after preemption) hit the encoder cache
    assert cache.runs == 2 and cache.hits >= 2, (cache.runs, cache.hits)
    # the same prompt and image again: a prefix hit past the image; the same text with another image hits
    # only the blocks before it
    assert outs["0"].num_cached_tokens >= spans[0][0][1] // 4 * 4
    assert outs["2"].num_cached_tokens <= spans[2][0][0]
    stats = engine.get_stats()
    assert stats.num_preemptions > 0, stats
    assert spy.chunked_prefills > 0
    # no chunk ended inside an image; some chunk was cut back to an image's start
    ends = [
        (sid, c + n)
        for p in spy.plans
        for sid, c, n in zip(p.req_ids, p.num_computed, p.num_scheduled, strict=True)
    ]
    assert not [(sid, end) for sid, end in ends for s, e in seq_spans.get(sid, []) if s < end < e]
    assert any(end == s for sid, end in ends for s, _ in seq_spans.get(sid, []))
    assert cache.split_slices == 0
    assert_pool_free(engine)


def test_bad_image_inputs(engine: LLMEngine) -> None:
    """Each bad input is an InputError naming it; the engine keeps serving."""
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"prompt": "x <start_of_image>", "multi_modal_data": {"image": b"not an image"}},
            "cannot be decoded",
        ),
        ({"prompt": "x", "multi_modal_data": {"image": IMG_A}}, "0 image placeholders"),
        ({"prompt": "x <start_of_image>", "multi_modal_data": {"video": IMG_A}}, "unsupported modalities"),
        ({"prompt": "<start_of_image>" * 17, "multi_modal_data": {"image": [IMG_A] * 17}}, "at most 16"),
    ]
    for prompt, message in cases:
        with pytest.raises(InputError, match=message):
            engine.add_request("bad", prompt, _params())
    engine.add_request("ok", {"prompt": PROMPTS[0][0], "multi_modal_data": {"image": IMG_A}}, _params())
    assert run_all(engine)["ok"].outputs[0].token_ids


def test_limit_and_local_media_flags(engine: LLMEngine, folder: Path, tmp_path: Path) -> None:
    """--limit-mm-per-prompt bounds the images of a prompt; --allowed-local-media-path admits file URLs
    under it and nothing outside."""
    model_cfg = EngineArgs(
        model=str(folder), limit_mm_per_prompt='{"image": 1}', allowed_local_media_path=str(tmp_path)
    ).early_configs()[0]
    assert model_cfg.limit_mm_per_prompt == {"image": 1}
    proc = InputProcessor(
        engine.tokenizer,
        max_model_len=128,
        vocab_size=320,
        max_logprobs=5,
        mm_processor=engine.input_processor.mm_processor,
        limit_mm_per_prompt=model_cfg.limit_mm_per_prompt,
    )
    two = {"prompt": PROMPTS[1][0], "multi_modal_data": {"image": PROMPTS[1][1]}}
    with pytest.raises(InputError, match="at most 1"):
        proc.process("r", two, _params())
    _, req = proc.process("r", {"prompt": PROMPTS[0][0], "multi_modal_data": {"image": IMG_A}}, _params())
    assert [it.length for it in req.mm_items] == [IMAGE_TOKENS]
    IMG_A.save(tmp_path / "a.png")
    msg = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{tmp_path}/a.png"}}]}
    ]
    mm = engine.input_processor.mm_processor
    assert chat_prompt(mm, msg, allowed_local_media_path=str(tmp_path))["multi_modal_data"]["image"]
    with pytest.raises(InputError, match="outside the allowed"):
        chat_prompt(mm, msg, allowed_local_media_path=str(tmp_path / "sub"))


def test_chat_image_parts(engine: LLMEngine, folder: Path) -> None:
    """A chat with an image_url data URL renders through the processor's template and gives HF's ids;
    a bad URL is an InputError naming it."""
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look "},
                {"type": "image_url", "image_url": {"url": data_url(IMG_B)}},
                {"type": "text", "text": " here"},
            ],
        }
    ]
    mm = engine.input_processor.mm_processor
    prompt = chat_prompt(mm, messages)
    proc = transformers.AutoProcessor.from_pretrained(str(folder))
    inputs = proc(text=prompt["prompt"], images=[IMG_B], add_special_tokens=False, return_tensors="pt")
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        ref = model.eval().generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    engine.add_request("chat", prompt, _params())
    out = run_all(engine)["chat"]
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert list(out.outputs[0].token_ids) == ref[0, inputs["input_ids"].shape[1] :].tolist()
    bad = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]}
    ]
    with pytest.raises(InputError, match="base64"):
        chat_prompt(mm, bad)
    local = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/hosts"}}]}]
    with pytest.raises(InputError, match="allowed-local-media-path"):
        chat_prompt(mm, local)
