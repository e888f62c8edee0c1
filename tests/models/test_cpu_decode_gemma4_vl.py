"""The CPU decode step on Gemma 4 (dense: per-layer input embeddings, shared-KV layers reading earlier
layers' caches, k = v global layers with their own head size and KV heads, proportional partial RoPE,
double-wide MLPs; MoE: the experts beside the dense MLP) and on the text decoders of Gemma 3 with images,
Qwen3-VL and Qwen2.5-VL (M-RoPE): tiny random models quantized at load take the fast step on their decode steps only, with
the modules' ids and top-5 logprobs (PAGEDRS_CPU_DECODE=0) under forced preemption, chunked prefill, prefix
hits and n=2, on prompts longer than the sliding window. Gemma 3 and Qwen3-VL also with images: the decode
steps after them take the fast step (Qwen3-VL's at M-RoPE text positions past the images' offset)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from pagedrs.models.layer_desc import Attend, ModelDesc, ProjectQKV, SavedBlock
from pagedrs.models.qwen3_vl import Qwen3VLForConditionalGeneration
from tests.distributed.helpers_tp import PROMPTS
from tests.engine.conftest import PlanSpy, greedy, make_engine, run_all
from tests.models.helpers_cpu_decode import assert_fast_step_matches_modules, spy_fast_step
from tests.models.helpers_families import WINDOW
from tests.models.helpers_gemma4 import gemma4_config, gemma4_moe_config, make_gemma4_model
from tests.models.helpers_qwen_vl import (
    images,
    make_vl_model,
    qwen2_5_vl_config,
    qwen3_vl_config,
    vl_processor,
)
from tests.multimodal.helpers_vision import make_gemma3_vision, random_image

FAMILIES: dict[str, Callable[[Path], Path]] = {
    "gemma4": lambda d: make_gemma4_model(d / "gemma4", gemma4_config()),
    "gemma4-moe": lambda d: make_gemma4_model(d / "gemma4moe", gemma4_moe_config()),
    "gemma3-mm": lambda d: make_gemma3_vision(d / "gemma3mm"),
    "qwen3-vl": lambda d: make_vl_model(d / "qwen3vl", qwen3_vl_config()),
    "qwen2.5-vl": lambda d: make_vl_model(d / "qwen25vl", qwen2_5_vl_config()),
}


def _check_gemma4(desc: ModelDesc, moe: bool) -> None:
    attends = [op.module for layer in desc.layers for op in layer if isinstance(op, Attend)]
    # the last two layers read the caches of layers 3 (sliding) and 2 (global)
    assert [a.kv_layer for a in attends] == [0, 1, 2, 3, 3, 2]
    assert [a.sliding_window for a in attends] == [WINDOW, WINDOW, None, WINDOW, WINDOW, None]
    assert [(a.head_size, a.num_kv_heads) for a in attends][1:3] == [(16, 2), (32, 1)]
    assert all(sum(isinstance(op, ProjectQKV) for op in layer) == 1 for layer in desc.layers)
    blocks = [sum(isinstance(op, SavedBlock) for op in layer) for layer in desc.layers]
    assert blocks == [2 if moe else 1] * len(desc.layers)  # the layer output (and the MoE feed-forward)
    assert desc.saved is not None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fast_step_replays_the_modules(family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert max(len(p) for p in PROMPTS) > WINDOW
    desc = assert_fast_step_matches_modules(FAMILIES[family](tmp_path), monkeypatch)
    if family.startswith("gemma4"):
        _check_gemma4(desc, family == "gemma4-moe")


def _qwen3_vl_images(folder: Path) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    img = [Image.fromarray(a) for a in images()]
    one = "ab<|vision_start|><|image_pad|><|vision_end|>cd"
    two = "x<|vision_start|><|image_pad|><|vision_end|>y<|vision_start|><|image_pad|><|vision_end|>zz"
    return {"skip_tokenizer_init": True}, [(one, [img[0]]), (two, img)]


def _gemma3_images(folder: Path) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    a, b = random_image(40, 30, seed=0), random_image(20, 50, seed=1)
    return {"max_model_len": 128}, [("describe it <start_of_image> now", [a]), ("a <start_of_image> b", [b])]


IMAGES: dict[str, Callable[[Path], tuple[dict[str, Any], list[tuple[str, Any]]]]] = {
    "gemma3-mm": _gemma3_images,
    "qwen3-vl": _qwen3_vl_images,
}


@pytest.mark.parametrize("family", list(IMAGES))
def test_decodes_after_images_take_the_fast_step(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Image prompts (prefill chunks with image rows on the modules: Gemma 3's bidirectional image mask,
    Qwen3-VL's DeepStack), then decode steps on the fast path (Qwen3-VL: M-RoPE text positions past the
    images' offset): ids equal the modules'."""
    folder = FAMILIES[family](tmp_path)
    extra, prompts = IMAGES[family](folder)

    def run() -> dict[str, list[int]]:
        engine = make_engine(
            folder,
            dtype="float32",
            quantization="q8_0",
            block_size=4,
            num_kv_blocks=16,
            max_num_batched_tokens=8,
            **extra,
        )
        if family == "qwen3-vl":
            engine.input_processor.mm_processor = vl_processor(
                Qwen3VLForConditionalGeneration, engine.hf_config
            )
        spy = PlanSpy().attach(engine)
        for i, (text, imgs) in enumerate(prompts):
            engine.add_request(str(i), {"prompt": text, "multi_modal_data": {"image": imgs}}, greedy(6))
        outs = run_all(engine)
        assert spy.chunked_prefills > 0
        return {rid: list(o.outputs[0].token_ids) for rid, o in outs.items()}

    calls = spy_fast_step(monkeypatch)
    fast = run()
    assert calls[0] > 0, calls  # the decodes
    monkeypatch.setenv("PAGEDRS_CPU_DECODE", "0")
    taken = calls[0]
    assert run() == fast
    assert calls[0] == taken
