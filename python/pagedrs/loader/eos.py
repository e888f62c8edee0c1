"""The end-of-sequence token ids of a loaded model."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["eos_token_ids"]


def eos_token_ids(tokenizer: Any, hf_config: Any, model_path: str) -> list[int]:
    """The tokenizer's eos plus the config's and generation_config.json's (e.g. Llama 3's <|eot_id|>)."""
    ids: set[int] = set()
    gen_eos = None
    if os.path.isfile(os.path.join(model_path, "generation_config.json")):
        try:
            import transformers

            gen_eos = transformers.GenerationConfig.from_pretrained(model_path).eos_token_id
        except (OSError, ValueError):
            gen_eos = None
    for src in (getattr(tokenizer, "eos_token_id", None), getattr(hf_config, "eos_token_id", None), gen_eos):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(x) for x in src)
    return sorted(ids)
