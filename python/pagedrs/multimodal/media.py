"""Images named by chat messages (OpenAI's `image_url` parts, as vLLM reads them): `data:` URLs always;
http(s) URLs fetched with a size and a time limit; local files (`file://` URLs) only under an allowed
folder (`--allowed-local-media-path`). Every failure is a ValueError naming the problem."""

from __future__ import annotations

import base64
import binascii
import os
from typing import Any

from pagedrs.multimodal.processing import load_image

__all__ = ["MAX_IMAGE_BYTES", "chat_images", "fetch_image"]

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # an encoded image larger than this is refused
FETCH_TIMEOUT_S = 10.0


def _data_url(url: str) -> bytes:
    head, _, payload = url.partition(",")
    if not head.endswith(";base64"):
        raise ValueError("a data URL image must be base64 encoded (data:image/...;base64,...)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the data URL's base64 payload cannot be decoded") from None
    return data


def _local(url: str, allowed: str | None) -> bytes:
    if not allowed:
        raise ValueError(
            "local image files are not allowed (start the server with --allowed-local-media-path)"
        )
    path = os.path.realpath(url[len("file://") :])
    root = os.path.realpath(allowed)
    if os.path.commonpath([path, root]) != root:
        raise ValueError(f"the image file is outside the allowed local media path {allowed!r}")
    if not os.path.isfile(path):
        raise ValueError("the image file does not exist")
    with open(path, "rb") as f:
        return f.read(MAX_IMAGE_BYTES + 1)


def _http(url: str) -> bytes:
    import httpx

    try:
        with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_S, follow_redirects=True) as resp:
            if resp.status_code != 200:
                raise ValueError(f"fetching the image URL gave HTTP {resp.status_code}")
            data = bytearray()
            for chunk in resp.iter_bytes():
                data += chunk
                if len(data) > MAX_IMAGE_BYTES:
                    break
            return bytes(data)
    except httpx.HTTPError as exc:
        raise ValueError(f"the image URL cannot be fetched: {type(exc).__name__}") from None


def fetch_image(url: Any, *, allowed_local_media_path: str | None = None) -> Any:
    """A PIL image from a data:, http(s):// or file:// URL."""
    if not isinstance(url, str) or not url:
        raise ValueError("image_url.url must be a non-empty string")
    if url.startswith("data:"):
        data = _data_url(url)
    elif url.startswith(("http://", "https://")):
        data = _http(url)
    elif url.startswith("file://"):
        data = _local(url, allowed_local_media_path)
    else:
        raise ValueError("image_url.url must be a data:, http(s):// or file:// URL")
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"the image is larger than {MAX_IMAGE_BYTES} bytes")
    return load_image(data)


def chat_images(
    messages: list[dict[str, Any]], *, allowed_local_media_path: str | None = None
) -> tuple[list[dict[str, Any]], list[Any]]:
    """(messages with each image part as {"type": "image"}, for the processor's chat template; the
    images in order). Parts: {"type": "image_url", "image_url": {"url": ...} or str},
    {"type": "image_pil", "image_pil": PIL image}, {"type": "input_image", "image_url": str}."""
    images: list[Any] = []
    out: list[dict[str, Any]] = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image_url", "input_image"):
                ref = part.get("image_url")
                url = ref.get("url") if isinstance(ref, dict) else ref
                images.append(fetch_image(url, allowed_local_media_path=allowed_local_media_path))
                parts.append({"type": "image"})
            elif kind == "image_pil":
                images.append(load_image(part.get("image_pil")))
                parts.append({"type": "image"})
            elif kind in ("text", "input_text"):
                parts.append({"type": "text", "text": part.get("text", "")})
            else:
                raise ValueError(f"unsupported content part type {kind!r}")
        out.append({**m, "content": parts})
    return out, images
