"""The frontend's image side: a prompt and its images -> token ids with each image's placeholders expanded,
and one `MultiModalItem` per placeholder run, with the model's own HF processor (its image processor and
processor config from the checkpoint: resize, rescale, normalize, patchify, Gemma 3's pan-and-scan).

Each image is processed alone and its tensors kept in an LRU cache keyed by the image's hash (the decoded
pixels plus the processor kwargs), so a repeated image costs no processor run; the prompt text is expanded
by the processor's own `replace_image_token` and tokenized as the processor would. An image that gives
several placeholder runs (Gemma 3's pan-and-scan crops) gives one item per run, in order.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from pagedrs.multimodal import MultiModalItem, image_hash, tensor_bytes

__all__ = [
    "MultiModalProcessor",
    "load_image",
    "mrope_of",
]


def load_image(data: Any) -> Any:
    """A PIL image from a PIL image, bytes of an encoded image, or a path; ValueError when undecodable."""
    from PIL import Image

    if isinstance(data, Image.Image):
        return data
    try:
        if isinstance(data, (bytes, bytearray)):
            img = Image.open(io.BytesIO(data))
        else:
            img = Image.open(str(data))
        img.load()
    except Exception as exc:
        raise ValueError(f"the image cannot be decoded: {exc}") from None
    return img


class MultiModalProcessor:
    """The model's HF processor plus the per-image cache (`cache_size` images)."""

    def __init__(
        self,
        processor: Any,
        image_token_id: int,
        *,
        cache_size: int = 256,
        model_cls: Any = None,
        hf_config: Any = None,
    ) -> None:
        # An M-RoPE model's class (its static `get_mrope_input_positions`) and config; None otherwise.
        self.mrope_cls = model_cls if getattr(model_cls, "uses_mrope", False) else None
        self.hf_config = hf_config
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_token_id = int(image_token_id)
        self.image_token: str = processor.image_token  # what a prompt writes for one image
        self.cache: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self.cache_size = cache_size
        self.cache_hits = 0
        self.cache_misses = 0

    @classmethod
    def from_pretrained(cls, folder: str, hf_config: Any, **kwargs: Any) -> MultiModalProcessor:
        from pagedrs.multimodal.hf_processor import load_hf_processor

        processor = load_hf_processor(folder, hf_config)
        return cls(processor, int(hf_config.image_token_id), hf_config=hf_config, **kwargs)

    def _image_inputs(self, img: Any, kwargs: dict[str, Any]) -> tuple[str, dict[str, torch.Tensor]]:
        rgb = img.convert("RGB") if img.mode != "RGB" else img
        key = image_hash(f"{rgb.mode}:{rgb.size}:".encode() + rgb.tobytes(), kwargs)
        hit = self.cache.get(key)
        if hit is not None:
            self.cache.move_to_end(key)
            self.cache_hits += 1
            return key, hit
        self.cache_misses += 1
        out = self.processor.image_processor(images=[img], return_tensors="pt", **kwargs)
        tensors = {k: v if isinstance(v, torch.Tensor) else torch.as_tensor(v) for k, v in out.items()}
        self.cache[key] = tensors
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return key, tensors

    def process(
        self,
        text: str,
        images: Sequence[Any],
        kwargs: dict[str, Any] | None = None,
        *,
        add_special_tokens: bool = True,
    ) -> tuple[list[int], list[MultiModalItem]]:
        """(token ids, items) for `text` with one `image_token` per image; ValueError on a count mismatch
        or an image that cannot be processed."""
        kwargs = dict(kwargs or {})
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise ValueError(
                f"the prompt has {len(pieces) - 1} image placeholders ({self.image_token!r}) for "
                f"{len(images)} images"
            )
        per_image: list[tuple[str, dict[str, torch.Tensor]]] = []
        for img in images:
            try:
                per_image.append(self._image_inputs(load_image(img), kwargs))
            except ValueError:
                raise
            except Exception as exc:
                raise ValueError(f"the image cannot be processed: {exc}") from None
        merged = {k: torch.cat([t[k] for _, t in per_image]) for k in (per_image[0][1] if per_image else {})}
        expanded = pieces[0]
        for i, piece in enumerate(pieces[1:]):
            expanded += self.processor.replace_image_token(merged, i) + piece
        ids = list(self.tokenizer(expanded, add_special_tokens=add_special_tokens)["input_ids"])
        return ids, self._items(ids, per_image)

    def _items(
        self, ids: list[int], per_image: list[tuple[str, dict[str, torch.Tensor]]]
    ) -> list[MultiModalItem]:
        runs: list[tuple[int, int]] = []
        i = 0
        while i < len(ids):
            if ids[i] == self.image_token_id:
                j = i
                while j < len(ids) and ids[j] == self.image_token_id:
                    j += 1
                runs.append((i, j - i))
                i = j
            else:
                i += 1
        if len(runs) == len(per_image):  # one run per image: the image's tensors whole
            return [
                MultiModalItem("image", key, off, n, {k: tensor_bytes(v) for k, v in tensors.items()})
                for (off, n), (key, tensors) in zip(runs, per_image, strict=True)
            ]
        items: list[MultiModalItem] = []  # pan-and-scan: one run per crop, in pixel_values order
        r = 0
        for key, tensors in per_image:
            pixels = tensors["pixel_values"]
            for crop in range(pixels.shape[0]):
                if r >= len(runs):
                    raise ValueError("the processed prompt has fewer image placeholder runs than crops")
                offset, length = runs[r]
                r += 1
                data = {"pixel_values": tensor_bytes(pixels[crop : crop + 1])}
                items.append(MultiModalItem("image", f"{key}{crop:02x}", offset, length, data))
        if r != len(runs):
            raise ValueError(f"the processed prompt has {len(runs)} image placeholder runs for {r} crops")
        return items


def mrope_of(
    processor: MultiModalProcessor, ids: list[int], items: list[MultiModalItem]
) -> tuple[list[int], int] | None:
    """An M-RoPE model's prompt positions (flattened [3, L]) and decode delta, computed once per request."""
    if processor.mrope_cls is None:
        return None
    table, delta = processor.mrope_cls.get_mrope_input_positions(ids, items, processor.hf_config)
    return [int(v) for v in table.reshape(-1).tolist()], int(delta)
