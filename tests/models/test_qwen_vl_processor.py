"""A Qwen2.5-VL folder saved with transformers' own `Qwen2_5_VLProcessor` (as real checkpoints ship it:
image processor, video processor, tokenizer) loads through `AutoProcessor` in the engine, and
`LLM.generate` with vLLM's `multi_modal_data` prompt gives HF transformers' greedy ids, the prompt
expanded by the same processor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from PIL import Image

from pagedrs import LLM, SamplingParams
from tests.models.helpers_qwen_vl import images, make_vl_model, qwen2_5_vl_config, vl_tokenizer


def test_real_processor_folder_generates_hf_ids(tmp_path: Path) -> None:
    pytest.importorskip("torchvision")  # transformers' Qwen VL processors need it (a dependency of pagedrs)
    folder = make_vl_model(tmp_path / "q25vl", qwen2_5_vl_config())
    image_processor = transformers.Qwen2VLImageProcessor(
        patch_size=14, merge_size=2, min_pixels=56 * 56, max_pixels=160 * 160
    )
    transformers.Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=vl_tokenizer(),
        video_processor=transformers.Qwen2VLVideoProcessor(),
    ).save_pretrained(str(folder))
    img = Image.fromarray(images()[1])
    text = "ab<|vision_start|><|image_pad|><|vision_end|>cd"
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=256, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": img}}, params, use_tqdm=False)[0]
    proc = transformers.AutoProcessor.from_pretrained(str(folder))
    inputs = proc(text=[text], images=[img], return_tensors="pt")
    hf = transformers.AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        ref = hf.generate(**inputs, max_new_tokens=6, do_sample=False)[0, inputs["input_ids"].shape[1] :]
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert list(out.outputs[0].token_ids) == ref.tolist()
    llm.shutdown()
