"""A prompt dict with `multi_modal_data` (vLLM's offline form: `{"prompt": str, "multi_modal_data":
{"image": image | [images]}, "mm_processor_kwargs": {...}}`) checked and processed into token ids and
items. Every bad input is an `InputError` naming the problem (the server's 400)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagedrs.errors import InputError
from pagedrs.multimodal import MultiModalItem
from pagedrs.multimodal.processing import MultiModalProcessor

__all__ = ["multimodal_prompt"]

DEFAULT_IMAGE_LIMIT = 16  # images a prompt may carry unless --limit-mm-per-prompt says otherwise


def multimodal_prompt(
    processor: MultiModalProcessor | None, prompt: Mapping[str, Any], limits: Mapping[str, int]
) -> tuple[str, list[int], list[MultiModalItem]]:
    """(prompt text, token ids, items); InputError on a model without images, an unknown modality, more
    images than the limit, or an image that cannot be decoded or processed."""

    if processor is None:
        raise InputError("this model takes no images (multi_modal_data given)", "multi_modal_data")
    data = prompt["multi_modal_data"]
    if not isinstance(data, Mapping):
        raise InputError("multi_modal_data must be a dict such as {'image': image}", "multi_modal_data")
    unknown = sorted(set(data) - {"image"})
    if unknown:
        raise InputError(f"unsupported modalities {unknown}: this model takes 'image'", "multi_modal_data")
    images = data.get("image")
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    limit = int(limits.get("image", DEFAULT_IMAGE_LIMIT))
    if len(images) > limit:
        raise InputError(
            f"the prompt has {len(images)} images; at most {limit} are allowed (--limit-mm-per-prompt)",
            "multi_modal_data",
        )
    text = prompt.get("prompt")
    if not isinstance(text, str):
        raise InputError("a prompt with multi_modal_data needs 'prompt' as a str", "prompt")
    kwargs = prompt.get("mm_processor_kwargs") or {}
    try:
        ids, items = processor.process(
            text, images, kwargs, add_special_tokens=bool(prompt.get("add_special_tokens", True))
        )
    except ValueError as exc:
        raise InputError(str(exc), "multi_modal_data") from None
    return text, ids, items


def has_images(messages: list[dict[str, Any]]) -> bool:
    """Whether a conversation has an image part."""
    return any(
        isinstance(p, dict) and p.get("type") in ("image_url", "image_pil", "input_image")
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
    )


def chat_prompt(
    processor: MultiModalProcessor | None,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    allowed_local_media_path: str | None = None,
    **template_kwargs: Any,
) -> dict[str, Any]:
    """A conversation with image parts as a `multi_modal_data` prompt, rendered by the processor's chat
    template (its text already carries the special tokens)."""
    from pagedrs.multimodal.media import chat_images

    if processor is None:
        raise InputError("this model takes no images (an image part was given)", "messages")
    try:
        rendered, images = chat_images(messages, allowed_local_media_path=allowed_local_media_path)
    except ValueError as exc:
        raise InputError(str(exc), "messages") from None
    text = processor.processor.apply_chat_template(
        rendered, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    return {"prompt": text, "multi_modal_data": {"image": images}, "add_special_tokens": False}
