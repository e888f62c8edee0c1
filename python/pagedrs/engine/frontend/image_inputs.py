"""The image processor the frontend checks and processes image prompts with: from a loaded model's
checkpoint (the offline engine), or from the checkpoint folder's config alone (a server process, which
loads no weights)."""

from __future__ import annotations

from typing import Any

from pagedrs.multimodal.processing import MultiModalProcessor

__all__ = ["frontend_mm_processor", "image_settings", "image_settings_of", "mm_processor_for"]


def mm_processor_for(loaded: Any) -> MultiModalProcessor | None:
    """The image processor of a loaded multimodal model (`LoadedModel`), from its checkpoint folder; None
    for a model that takes no images, or a checkpoint folder without a processor config (text prompts
    only: a request with images is refused)."""
    if not getattr(loaded.model, "supports_multimodal", False):
        return None
    from pagedrs.loader.paths import model_folder

    return _from_folder(model_folder(loaded.model_path), loaded.hf_config, type(loaded.model))


def _from_folder(folder: str, hf_config: Any, model_cls: Any) -> MultiModalProcessor | None:
    from pathlib import Path

    if not any(
        (Path(folder) / name).exists() for name in ("preprocessor_config.json", "processor_config.json")
    ):
        return None
    return MultiModalProcessor.from_pretrained(folder, hf_config, model_cls=model_cls)


def frontend_mm_processor(
    model_path: str | None, trust_remote_code: bool = False
) -> MultiModalProcessor | None:
    """The image processor a server process (which loads no weights) checks and processes image requests
    with, for the local checkpoint `model_path`: None for a GGUF file, a text-only architecture or a folder
    without a processor config. Reads only the config, never the weights."""
    import json
    from pathlib import Path

    if model_path is None or not (Path(model_path) / "config.json").is_file():
        return None
    archs = json.loads((Path(model_path) / "config.json").read_text()).get("architectures") or []
    from pagedrs.models.registry import VISION_PARTS, get_model_class, text_part

    if not any(a in VISION_PARTS for a in archs):
        return None
    import transformers

    config = text_part(
        transformers.AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    )
    model_cls = get_model_class(config)
    if not getattr(model_cls, "supports_multimodal", False):
        return None
    return _from_folder(model_path, config, model_cls)


def image_settings(config: Any) -> dict[str, Any]:
    """The image settings of a server process's InputProcessor for launch config `config`: the
    checkpoint's image processor (None for a model that takes no images), the per-prompt limits and the
    local media folder."""
    model = config.model
    return {
        "mm_processor": frontend_mm_processor(model.model, config.load.trust_remote_code),
        "limit_mm_per_prompt": model.limit_mm_per_prompt,
        "allowed_local_media_path": model.allowed_local_media_path,
        "max_num_encoder_input_tokens": config.max_num_encoder_input_tokens,
    }


def image_settings_of(engine: Any) -> dict[str, Any]:
    """The image settings of an engine run in the server's own process (an `LLMEngine` has its own
    InputProcessor; a core object has none)."""
    proc = getattr(engine, "input_processor", None)
    return {
        "mm_processor": getattr(proc, "mm_processor", None),
        "limit_mm_per_prompt": getattr(proc, "limit_mm_per_prompt", None),
        "allowed_local_media_path": getattr(proc, "allowed_local_media_path", None),
        "max_num_encoder_input_tokens": getattr(proc, "max_num_encoder_input_tokens", None),
    }
