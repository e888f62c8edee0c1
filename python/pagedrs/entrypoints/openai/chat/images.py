"""Chat messages with image parts (OpenAI's `image_url`, the Responses API's `input_image`) rendered by the
model's processor chat template and processed into token ids and image items, as vLLM's chat path does
for a multimodal model. Every problem with an image (undecodable, too large, too many, a URL that fails,
a model that takes none) is a 400 naming `messages`."""

from __future__ import annotations

from typing import Any

from pagedrs.engine.frontend.input_processor import InputError, InputProcessor
from pagedrs.entrypoints.openai.errors import bad_request
from pagedrs.multimodal.inputs import chat_prompt, multimodal_prompt

__all__ = ["render_with_images"]


def render_with_images(
    inputs: InputProcessor,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, list[int], dict[str, Any]]:
    """(prompt text, token ids, the engine prompt carrying the processed images) of a conversation with
    image parts; runs off the event loop (it decodes, fetches and processes the images)."""
    try:
        prompt = chat_prompt(
            inputs.mm_processor,
            messages,
            add_generation_prompt=add_generation_prompt,
            allowed_local_media_path=inputs.allowed_local_media_path,
            **({"tools": tools} if tools else {}),
        )
        text, ids, items = multimodal_prompt(inputs.mm_processor, prompt, inputs.limit_mm_per_prompt)
    except InputError as exc:
        raise bad_request(str(exc), param="messages") from None
    except Exception as exc:  # the processor's template rejecting the messages is the caller's input
        raise bad_request(
            f"messages cannot be rendered with the processor's chat template: {exc}", param="messages"
        ) from None
    return text, ids, {"prompt_token_ids": ids, "multi_modal_items": items}
