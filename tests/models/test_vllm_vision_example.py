"""vLLM's offline vision-language program, as `docs/pages/models.md` shows it (vLLM's multimodal-inputs
guide with `vllm` replaced by `pagedrs`: `LLM(model=..., limit_mm_per_prompt=...)`, `llm.generate` with a
`multi_modal_data` prompt, `llm.chat` with an `image_url` part), run as written on a tiny random Qwen2.5-VL
folder laid out as the real checkpoint ships it (processor and tokenizer files, a `chat_template.jinja`);
both outputs equal the engine's own result for the same prompt and image, and the chat form renders the
same prompt as the hand-written one."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import transformers
from PIL import Image

from pagedrs import SamplingParams
from tests.engine.conftest import make_engine, run_all
from tests.helpers_docs import PAGES, snippets
from tests.models.helpers_qwen_vl import images, make_vl_model, qwen2_5_vl_config, vl_tokenizer

HUB_NAME = "Qwen/Qwen2.5-VL-3B-Instruct"
# Qwen2-VL's chat template, image parts as its placeholder, a default system message
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _program() -> str:
    found = [s for s in snippets(PAGES / "models.md") if HUB_NAME in s.code]
    assert len(found) == 1, [s.where for s in found]
    return found[0].code


def _checkpoint(folder: Path) -> Path:
    make_vl_model(folder, qwen2_5_vl_config())
    transformers.Qwen2VLImageProcessor(
        patch_size=14, merge_size=2, min_pixels=56 * 56, max_pixels=160 * 160
    ).save_pretrained(str(folder))
    vl_tokenizer().save_pretrained(str(folder))
    pre = folder / "preprocessor_config.json"
    pre.write_text(json.dumps({**json.loads(pre.read_text()), "processor_class": "Qwen2_5_VLProcessor"}))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return folder


def test_vllm_vision_program_runs_as_written(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "q25vl")
    Image.fromarray(images([(84, 112)])[0]).save(tmp_path / "image.jpg")
    program = _program()
    assert "from pagedrs import LLM, SamplingParams" in program and "vllm" not in program
    namespace: dict[str, object] = {"__name__": "__main__"}
    cwd = os.getcwd()
    printed = io.StringIO()
    try:
        os.chdir(tmp_path)
        with contextlib.redirect_stdout(printed):
            exec(compile(program.replace(HUB_NAME, str(folder)), "vllm_vision_example", "exec"), namespace)
    finally:
        os.chdir(cwd)
        llm = namespace.get("llm")
        if llm is not None:
            llm.shutdown()  # type: ignore[attr-defined]
    generated, chatted = namespace["outputs"], namespace["chat_outputs"]

    engine = make_engine(folder, dtype="float32")
    image = Image.open(tmp_path / "image.jpg")
    prompt = {"prompt": namespace["prompt"], "multi_modal_data": {"image": image}}
    engine.add_request("direct", prompt, SamplingParams(temperature=0.0, max_tokens=16))
    direct = run_all(engine)["direct"]
    for out in (generated[0], chatted[0]):  # type: ignore[index]
        assert out.prompt_token_ids == direct.prompt_token_ids
        assert list(out.outputs[0].token_ids) == list(direct.outputs[0].token_ids)
        assert out.outputs[0].text == direct.outputs[0].text
    assert printed.getvalue() == f"{direct.outputs[0].text}\n" * 2
