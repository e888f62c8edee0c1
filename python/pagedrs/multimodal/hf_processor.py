"""A checkpoint's HF processor for images, with or without torchvision.

transformers' `AutoProcessor` builds every sub-processor a checkpoint names; for Qwen2-VL, Qwen2.5-VL,
Qwen3-VL and Qwen3.5 that includes a video processor, which imports torchvision (and torch's compiler stack
with it: seconds at every process start). pagedrs serves images, not video, so torchvision is not a
dependency: when `AutoProcessor` stops at the missing video processor, the processor is put together from
what images need — `AutoImageProcessor` (transformers' PIL backend), the tokenizer, the image token (the
token of the config's `image_token_id`) and the processor class's own `replace_image_token`, which reads
only those, and a chat template read as the processor would read it (the folder's `chat_template.jinja` or
`chat_template.json`, else the tokenizer's), rendered by the tokenizer.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

__all__ = ["load_hf_processor"]

_CONFIG_FILES = ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json")


def _processor_class(folder: str) -> str | None:
    for name in _CONFIG_FILES:
        path = Path(folder) / name
        if path.is_file():
            cls = json.loads(path.read_text()).get("processor_class")
            if cls:
                return str(cls)
    return None


def load_hf_processor(folder: str, hf_config: Any) -> Any:
    """`AutoProcessor.from_pretrained(folder)`, or its image half where only the video half needs
    torchvision (see the module docstring); ImportError when neither can be built."""
    import transformers

    try:
        return transformers.AutoProcessor.from_pretrained(folder)
    except ImportError as exc:
        if "torchvision" not in str(exc).lower():
            raise
        cls = getattr(transformers, _processor_class(folder) or "", None)
        replace = getattr(cls, "replace_image_token", None)
        token_id = getattr(hf_config, "image_token_id", None)
        if replace is None or token_id is None:
            raise
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    proc = SimpleNamespace(
        image_processor=transformers.AutoImageProcessor.from_pretrained(folder),
        tokenizer=tokenizer,
        image_token=tokenizer.convert_ids_to_tokens(int(token_id)),
    )
    proc.replace_image_token = functools.partial(replace, proc)
    proc.apply_chat_template = functools.partial(_apply_chat_template, tokenizer, _chat_template(folder))
    return proc


def _chat_template(folder: str) -> str | None:
    """The processor's own chat template in `folder` (None: the tokenizer's is used)."""
    jinja, as_json = Path(folder) / "chat_template.jinja", Path(folder) / "chat_template.json"
    if jinja.is_file():
        return jinja.read_text()
    if as_json.is_file():
        template = json.loads(as_json.read_text()).get("chat_template")
        return str(template) if template else None
    return None


def _apply_chat_template(tokenizer: Any, template: str | None, conversation: Any, **kwargs: Any) -> Any:
    """`ProcessorMixin.apply_chat_template` for the image half: the conversation's parts as they are
    (`{"type": "image"}`, `{"type": "text", ...}`), the processor's template where it has one."""
    if template is not None:
        kwargs.setdefault("chat_template", template)
    return tokenizer.apply_chat_template(conversation, **kwargs)
