"""Images under tensor parallelism: a tiny Qwen2.5-VL at TP=2 (gloo) gives TP=1's greedy ids with one image
and with two images of different sizes, prefill chunks splitting the images' placeholder tokens. Rank 0
runs the vision tower and broadcasts each step's encoder rows and M-RoPE positions (`runner.mm_share`)."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from pagedrs.engine.llm_engine import LLMEngine
from pagedrs.executor import TPExecutor
from pagedrs.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from tests.distributed.helpers_tp import tp_engine
from tests.engine.conftest import PlanSpy, greedy, run_all
from tests.models.helpers_qwen_vl import images, make_vl_model, qwen2_5_vl_config, vl_processor

ONE = "ab<|vision_start|><|image_pad|><|vision_end|>cd"
TWO = "x<|vision_start|><|image_pad|><|vision_end|>y<|vision_start|><|image_pad|><|vision_end|>zz"


def _run(engine: LLMEngine) -> tuple[dict[str, list[int]], PlanSpy]:
    engine.input_processor.mm_processor = vl_processor(Qwen2_5_VLForConditionalGeneration, engine.hf_config)
    spy = PlanSpy().attach(engine)
    small, large = (Image.fromarray(a) for a in images())
    reqs = [("one", ONE, [large]), ("two", TWO, [small, large]), ("text", "hello", [])]
    for rid, text, imgs in reqs:
        prompt = {"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else list(text.encode())
        engine.add_request(rid, prompt, greedy(8))
    return {rid: list(o.outputs[0].token_ids) for rid, o in run_all(engine).items()}, spy


def test_tp2_images_equal_tp1(tmp_path: Path) -> None:
    folder = make_vl_model(tmp_path / "q25vl", qwen2_5_vl_config())
    settings = dict(skip_tokenizer_init=True, max_num_batched_tokens=8, num_kv_blocks=40)
    one = tp_engine(folder, 1, **settings)
    ids1, _ = _run(one)
    two = tp_engine(folder, 2, **settings)
    try:
        assert isinstance(two.engine_core.executor, TPExecutor)
        ids2, spy = _run(two)
    finally:
        two.shutdown()
    assert ids2 == ids1
    assert spy.chunked_prefills > 0  # images split over prefill chunks
    assert len(set(map(tuple, ids1.values()))) == 3
