"""A Qwen2.5-VL folder as real checkpoints ship it (`preprocessor_config.json` naming `Qwen2_5_VLProcessor`,
the tokenizer files) loads its processor in the engine — through `AutoProcessor` where torchvision is
installed, else through the image half of it (torchvision is not a dependency) — and `LLM.generate` with
vLLM's `multi_modal_data` prompt gives HF transformers' greedy ids, the prompt expanded as HF's processor
expands it (one `<|image_pad|>` per merged patch)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from PIL import Image

from pagedrs import LLM, SamplingParams
from pagedrs.multimodal.hf_processor import load_hf_processor
from tests.models.helpers_qwen_vl import IMAGE_ID, images, make_vl_model, qwen2_5_vl_config, vl_tokenizer


def test_real_processor_folder_generates_hf_ids(tmp_path: Path) -> None:
    folder = make_vl_model(tmp_path / "q25vl", qwen2_5_vl_config())
    image_processor = transformers.Qwen2VLImageProcessor(
        patch_size=14, merge_size=2, min_pixels=56 * 56, max_pixels=160 * 160
    )
    image_processor.save_pretrained(str(folder))
    vl_tokenizer().save_pretrained(str(folder))
    pre = folder / "preprocessor_config.json"
    pre.write_text(json.dumps({**json.loads(pre.read_text()), "processor_class": "Qwen2_5_VLProcessor"}))
    config = transformers.AutoConfig.from_pretrained(str(folder))
    proc = load_hf_processor(str(folder), config)
    assert proc.image_token == "<|image_pad|>"

    img = Image.fromarray(images()[1])
    text = "ab<|vision_start|><|image_pad|><|vision_end|>cd"
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=256, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": img}}, params, use_tqdm=False)[0]
    llm.shutdown()

    pixels = image_processor(images=[img], return_tensors="pt")
    n = int(pixels["image_grid_thw"][0].prod()) // 4
    ids = proc.tokenizer(text.replace("<|image_pad|>", "<|image_pad|>" * n), return_tensors="pt")["input_ids"]
    assert (ids == IMAGE_ID).sum() == n
    hf = transformers.AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        ref = hf.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=(ids == IMAGE_ID).int(),
            **pixels,
            max_new_tokens=6,
            do_sample=False,
        )
    assert out.prompt_token_ids == ids[0].tolist()
    assert list(out.outputs[0].token_ids) == ref[0, ids.shape[1] :].tolist()
