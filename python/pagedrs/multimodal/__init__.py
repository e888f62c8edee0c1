"""Images in, text out: what a multimodal request carries from the frontend to the model runner.

The contract every vision family builds to:

- `MultiModalItem` (msgspec, carried in `EngineCoreRequest.mm_items`): one image of a request. `hash` is
  the hex digest of the decoded image bytes plus the processor kwargs (the encoder cache and prefix-cache
  key); `offset`/`length` give its placeholder tokens in the prompt; `data` holds the processor's tensors
  for this item (pixel_values, image_grid_thw, num_crops, ...) as name -> `TensorBytes` (dtype, shape, raw
  bytes), never pickle. `item_tensors(item)` gives them back as torch tensors.
- A model with `supports_multimodal = True` implements `embed_multimodal(items) -> [length, D]` per item
  (D = hidden, or a multiple of hidden where a model carries extra per-layer features) and takes
  `forward(input_ids, positions, ctx, mm=MultiModalBatch(...))`: `mm.embeds` [N, D] are the encoder rows of
  this step's scheduled placeholder tokens in batch order (sliced where chunked prefill splits an item) and
  `mm.mask` [T] marks the rows of the flattened batch that take them. The model scatters
  `embeds[:, :hidden]` into its token embeddings itself (Gemma: into the scaled embeddings, as HF's
  masked_scatter).
- A model whose image tokens attend to each other both ways (Gemma 3, HF's `token_type_ids` mask) sets
  `mm_bidirectional = True`; the runner then gives the attention each query's key limit
  (`AttentionMetadata.key_limits`, the end of the query's image) and the scheduler never ends a prefill
  chunk inside such an image (`atomic_spans`), as vLLM keeps a bidirectional item in one chunk.
- M-RoPE: a model with `uses_mrope = True` provides a static
  `get_mrope_input_positions(prompt_token_ids, mm_items, hf_config) -> (Tensor [3, L], delta)`; the frontend
  computes it once per request (`EngineCoreRequest.mrope_positions`, `mrope_delta`) and the runner passes
  `positions` as [3, T] (prompt rows from the table, decode rows `pos + delta` in all three).
- Where the pieces live: `multimodal.processing` (the HF processor: each image processed alone through
  `processor.image_processor(images=[img])`, cached by hash; the prompt expanded by
  `processor.replace_image_token(merged image inputs, i)`; one item per placeholder run, holding that
  image's tensors whole, or one crop's pixel_values per run for Gemma 3's pan-and-scan),
  `multimodal.inputs` (the `multi_modal_data` prompt and chat image parts), `multimodal.media` (URLs),
  `multimodal.admission` (the core), `multimodal.encoder_cache` + `runner.mm_step` (the runner),
  `multimodal.mrope` (the [3, T] step positions). A vision checkpoint's architecture goes in
  `models.registry.VISION_PARTS` with the top-level config fields its model reads: the model is built
  from the text config with those fields copied onto it (that config is also the `hf_config` given to
  `get_mrope_input_positions`).
- Beyond the first draft of this contract: `mm_bidirectional`, `AttentionMetadata.key_limits` /
  `key_limit_reqs`, the Rust `Scheduler.set_atomic_spans` (rebuild the extension: `cargo build --release
  -p pagedrs-py`), and `EngineCoreRequest.mrope_positions` (flattened row-major [3, L]) / `mrope_delta`.
- Prefix caching (SGLang's way, no change to the Rust hashing): the scheduler sees each item's placeholder
  ids replaced by ids derived from its hash (`scheduler_token_ids`), so the same image hits, another image
  never does, and text before the image still shares. The runner never embeds those ids (the placeholder
  rows take encoder rows); everything that reads prompt ids as vocabulary (detokenizer, prompt logprobs,
  penalties, stop checks) keeps the real ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch
from torch import Tensor

__all__ = [
    "MultiModalBatch",
    "MultiModalItem",
    "TensorBytes",
    "atomic_spans",
    "image_hash",
    "item_tensors",
    "scheduler_token_ids",
    "tensor_bytes",
]


class TensorBytes(msgspec.Struct, array_like=True):
    """One tensor as (numpy dtype name, shape, raw little-endian bytes)."""

    dtype: str
    shape: list[int]
    data: bytes


class MultiModalItem(msgspec.Struct, array_like=True):
    """One image of a request (see the module docstring)."""

    modality: str
    hash: str
    offset: int
    length: int
    data: dict[str, TensorBytes] = {}


@dataclass
class MultiModalBatch:
    """The encoder rows of one step: `embeds` [N, D] go to the rows of the flattened batch where `mask` [T]
    is True, in order."""

    embeds: Tensor
    mask: Tensor


def tensor_bytes(t: Tensor | np.ndarray | Sequence[Any]) -> TensorBytes:
    """A tensor (torch, numpy or nested lists of numbers) as `TensorBytes`."""
    if isinstance(t, Tensor):
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            t = t.float()
        arr = t.numpy()
    else:
        arr = np.asarray(t)
    arr = np.ascontiguousarray(arr)
    return TensorBytes(arr.dtype.str, list(arr.shape), arr.tobytes())


def item_tensors(item: MultiModalItem, device: torch.device | str = "cpu") -> dict[str, Tensor]:
    """The item's processor tensors as torch tensors on `device`."""
    out: dict[str, Tensor] = {}
    for name, tb in item.data.items():
        arr = np.frombuffer(tb.data, dtype=np.dtype(tb.dtype)).reshape(tb.shape)
        out[name] = torch.from_numpy(arr.copy()).to(device)
    return out


def image_hash(image_bytes: bytes, processor_kwargs: dict[str, Any] | None = None) -> str:
    """Hex digest of the decoded image's bytes (mode, size, pixels) plus the processor kwargs."""
    h = hashlib.blake2b(digest_size=16)
    h.update(image_bytes)
    h.update(repr(sorted((processor_kwargs or {}).items())).encode())
    return h.hexdigest()


def scheduler_token_ids(prompt: Sequence[int], items: Sequence[MultiModalItem], vocab_size: int) -> list[int]:
    """The prompt as the scheduler (and so the prefix cache) sees it: each item's placeholder ids replaced by
    four ids derived from the item's hash, repeated over its length (all inside the vocabulary)."""
    ids = list(prompt)
    vocab = max(int(vocab_size), 1)
    for it in items:
        digest = hashlib.blake2b(it.hash.encode(), digest_size=16).digest()
        keys = [int.from_bytes(digest[i : i + 4], "little") % vocab for i in range(0, 16, 4)]
        for j in range(it.length):
            ids[it.offset + j] = keys[j % len(keys)]
    return ids


def atomic_spans(items: Sequence[MultiModalItem]) -> list[tuple[int, int]]:
    """(start, end) of every item's placeholder tokens, for a scheduler that must not end a chunk inside."""
    return [(it.offset, it.offset + it.length) for it in items]
