"""Launch wrappers for cuda/cache_kernels.cu: write a step's K/V into the cache, copy blocks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from pagedrs.config import FP8_MAX
from pagedrs.kernels._launch import Launch, launch, ptr
from pagedrs.kernels._loader import WORD_TYPES, cache_names
from pagedrs.kernels.attention_ops import launch_fp8_write

__all__ = ["copy_blocks", "reshape_and_cache"]

_SOURCE = "cache_kernels"
# Device arrays of per-layer cache addresses, keyed by those addresses (stable until the pool is resized).
_ptr_tables: dict[tuple[int, ...], Tensor] = {}


def _word_bytes(*sizes: int) -> int:
    """Widest copy word (16, 8, 4 or 2 bytes) dividing every byte size and address given."""
    for w in (16, 8, 4, 2):
        if all(s % w == 0 for s in sizes):
            return w
    raise ValueError(f"kernel arguments are not 2-byte aligned: {sizes}")


def _check_cache(cache: Tensor, what: str) -> None:
    if cache.dim() != 4 or not cache.is_contiguous():
        raise ValueError(
            f"{what} must be contiguous [num_blocks, block_size, num_kv_heads, head_size], "
            f"got shape {tuple(cache.shape)} strides {cache.stride()}"
        )


def reshape_and_cache(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Write key/value [T, KVH, D] into key_cache/value_cache [num_blocks, block_size, KVH, D] at
    slot_mapping [T] (int64; a negative slot skips its token). The token stride of key/value may be
    padded (a view of a fused qkv tensor); the inner two dims must be contiguous. An fp8 cache holds
    fp16/bf16/fp32 K/V converted as they are written (round to nearest even, saturating, scale 1.0).
    Long because of its argument checks, one rule each, before one launch."""
    _check_cache(key_cache, "key_cache")
    _check_cache(value_cache, "value_cache")
    _, _, kvh, d = key_cache.shape
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache shape {tuple(value_cache.shape)} != key_cache {tuple(key_cache.shape)}"
        )
    num_tokens = key.shape[0]
    for name, t in (("key", key), ("value", value)):
        if t.shape != (num_tokens, kvh, d):
            raise ValueError(f"{name} must be [{num_tokens}, {kvh}, {d}], got {tuple(t.shape)}")
        if t.stride(2) != 1 or t.stride(1) != d:
            raise ValueError(f"{name}'s head and dim axes must be contiguous, strides {t.stride()}")
        if t.dtype != (key.dtype if key_cache.dtype in FP8_MAX else key_cache.dtype):
            raise ValueError(f"{name} dtype {t.dtype} does not go into a {key_cache.dtype} cache")
        if t.device != key_cache.device:
            raise ValueError(f"{name} is on {t.device}, the cache on {key_cache.device}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"slot_mapping must be int64 [{num_tokens}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.device != key_cache.device or not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous and on the cache's device")
    if num_tokens == 0:
        return
    if key_cache.dtype in FP8_MAX:
        launch_fp8_write(key, value, key_cache, value_cache, slot_mapping)
        return
    esize = key.element_size()
    row_bytes = kvh * d * esize
    word = _word_bytes(
        row_bytes,
        key.stride(0) * esize,
        value.stride(0) * esize,
        key.data_ptr(),
        value.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
    )
    row_words = row_bytes // word
    threads = min(256, -(-row_words // 32) * 32)
    spec = Launch(
        _SOURCE,
        cache_names(),
        f"pagedrs::reshape_and_cache<{WORD_TYPES[word]}>",
        (num_tokens, 1, 1),
        (threads, 1, 1),
        0,
        (
            ptr(key),
            ptr(value),
            ptr(key_cache),
            ptr(value_cache),
            ptr(slot_mapping),
            np.int64(key.stride(0) * esize // word),
            np.int64(value.stride(0) * esize // word),
            np.int32(row_words),
        ),
    )
    launch(spec, key_cache.device)


def _pointer_table(kv_caches: Sequence[Tensor]) -> Tensor:
    key = tuple(c.data_ptr() for c in kv_caches)
    table = _ptr_tables.get(key)
    if table is None:
        if len(_ptr_tables) > 8:  # old pools (resized away) are not kept alive forever
            _ptr_tables.clear()
        host = torch.tensor(np.array(key, dtype=np.uint64).view(np.int64))
        table = host.to(kv_caches[0].device)
        _ptr_tables[key] = table
    return table


def copy_blocks(kv_caches: Sequence[Tensor], pairs: Tensor | np.ndarray) -> None:
    """For every (src, dst) row of pairs [k, 2], copy block src to block dst, K and V, in every layer's
    cache [2, num_blocks, block_size, KVH, D], in one launch. No dst may also be a src (copy-on-write and
    pool-compaction targets are free blocks). Indices in a numpy array are range-checked; in a device
    tensor they are trusted (checking them would synchronize)."""
    if len(kv_caches) == 0 or len(pairs) == 0:
        return
    first = kv_caches[0]
    for c in kv_caches:
        if c.dim() != 5 or c.shape[0] != 2 or not c.is_contiguous():
            raise ValueError(
                f"each kv cache must be contiguous [2, num_blocks, block_size, KVH, D], got {tuple(c.shape)}"
            )
        if c.shape != first.shape or c.dtype != first.dtype or c.device != first.device:
            raise ValueError("all layers' kv caches must share shape, dtype and device")
    num_blocks = first.shape[1]
    if isinstance(pairs, np.ndarray):
        arr = np.ascontiguousarray(pairs, dtype=np.int64)
        if arr.ndim != 2 or arr.shape[1] != 2:
            raise ValueError(f"pairs must be [k, 2], got {arr.shape}")
        if arr.min() < 0 or arr.max() >= num_blocks:
            raise ValueError(f"block index out of range [0, {num_blocks}): {arr.min()}..{arr.max()}")
        pairs_t = torch.from_numpy(arr).to(first.device)
    else:
        if pairs.dim() != 2 or pairs.shape[1] != 2:
            raise ValueError(f"pairs must be [k, 2], got {tuple(pairs.shape)}")
        pairs_t = pairs.to(device=first.device, dtype=torch.int64).contiguous()
    table = _pointer_table(kv_caches)
    block_bytes = first[0, 0].numel() * first.element_size()
    word = _word_bytes(block_bytes, *(c.data_ptr() for c in kv_caches))
    spec = Launch(
        _SOURCE,
        cache_names(),
        f"pagedrs::copy_blocks<{WORD_TYPES[word]}>",
        (pairs_t.shape[0], len(kv_caches), 1),
        (256, 1, 1),
        0,
        (ptr(table), ptr(pairs_t), np.int64(block_bytes // word), np.int64(num_blocks)),
    )
    launch(spec, first.device)
