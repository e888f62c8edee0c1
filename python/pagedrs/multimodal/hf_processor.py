"""A checkpoint's HF processor for images, with or without torchvision.

transformers' `AutoProcessor` builds every sub-processor a checkpoint names; for Qwen2-VL, Qwen2.5-VL,
Qwen3-VL and Qwen3.5 that includes a video processor, which imports torchvision (and torch's compiler stack
with it: seconds at every process start). pagedrs serves images, not video, so torchvision is not a
dependency: when `AutoProcessor` stops at the missing video processor, the processor is put together from
what images need — `AutoImageProcessor` (transformers' PIL backend), the tokenizer, the image token (the
token of the config's `image_token_id`) and the processor class's own `replace_image_token`, which reads
only those.
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
    return proc
