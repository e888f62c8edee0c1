"""KV-cache groups: sliding-window layers keep their blocks in a second pool of their own.

A layer that attends only to the last ``window`` tokens never reads a block once every token in it fell out
of the window; the scheduler (Rust core, ``kv_groups``) frees those blocks mid-request and caps prefix hits to
what the window pool still holds, as vLLM V1's hybrid allocator and llama.cpp's SWA cache do. Here: which
layers form the window group, and how one KV budget is split between the full-attention pool and the window
pool so that the memory goes where it is used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from pagedrs.config import as_bytes
from pagedrs.layers.attention import AttentionMetadata

__all__ = [
    "WindowGroup",
    "install_window_pool",
    "layer_windows",
    "max_live_blocks",
    "plan_window_pool",
    "split_pool",
    "swap_yields_to_window_pool",
    "window_group_for",
    "window_metadata",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WindowGroup:
    """The layers attending to the last `window` tokens, and the blocks of their pool."""

    window: int
    layers: tuple[int, ...]
    num_blocks: int = 0


def layer_windows(model: Any) -> list[int | None]:
    """Per layer (by `layer_idx`), the sliding window of its attention (None: full attention)."""
    from pagedrs.layers.attention import Attention

    found = {m.layer_idx: m.sliding_window for m in model.modules() if isinstance(m, Attention)}
    return [found.get(i) for i in range(int(model.num_layers))]


def window_group_for(windows: list[int | None], max_model_len: int) -> WindowGroup | None:
    """The window group of a model whose layers have `windows`: the layers with one window shorter than
    `max_model_len`, next to at least one full-attention layer. None (every layer keeps all its blocks,
    masked by its window) when no window is shorter than the context, with several window sizes, or with no
    full-attention layer."""
    short = {w for w in windows if w is not None and w < max_model_len}
    if len(short) != 1 or all(w in short for w in windows):
        # several window sizes, or no full-attention layer (Mistral): every layer keeps its blocks
        return None
    (window,) = short
    return WindowGroup(window, tuple(i for i, w in enumerate(windows) if w == window))


def max_live_blocks(window: int, block_size: int, step_tokens: int) -> int:
    """Most window blocks one sequence holds while computing `step_tokens` tokens a step (as the core's
    `sliding_window::max_live_blocks`)."""
    return -(-(window - 1 + step_tokens) // block_size) + 1


def split_pool(
    budget_bytes: float,
    *,
    full_block_bytes: int,
    window_block_bytes: int,
    blocks_per_seq: int,
    live_per_seq: int,
    num_full_blocks: int | None = None,
) -> tuple[int, int]:
    """(full-attention blocks, window blocks) for `budget_bytes`: in the ratio a max-length sequence uses
    them (`blocks_per_seq` full blocks, `live_per_seq` window blocks), the window pool never smaller than
    one sequence's live blocks nor larger than the full pool (a sequence never holds more window blocks
    than full ones). `num_full_blocks` fixes the full pool's size (an explicit `num_kv_blocks`)."""
    ratio = min(1.0, live_per_seq / blocks_per_seq)
    if num_full_blocks is None:
        num_full_blocks = int(budget_bytes // (full_block_bytes + window_block_bytes * ratio))
    window = min(num_full_blocks, -(-int(num_full_blocks * live_per_seq) // blocks_per_seq))
    window = max(window, live_per_seq)
    if num_full_blocks * full_block_bytes + window * window_block_bytes > budget_bytes:
        num_full_blocks = int((budget_bytes - window * window_block_bytes) // full_block_bytes)
    return num_full_blocks, window


def _unsupported(runner: Any) -> str | None:
    """Why `runner` cannot keep its window group in a pool of its own, swap space aside (None: it can)."""
    cfg = runner.config
    spec = cfg.speculative
    if cfg.parallel.liquid_gpu_range is not None:
        return "a liquid device range"
    if spec is not None and spec.method != "ngram":
        return "a drafter model"
    return None


def swap_yields_to_window_pool(runner: Any) -> bool:
    """True when `runner`'s swap space is the device's default (not given) and its model has a window group
    that can have its own pool: the window pool takes the place of the swap pool (no swap blocks)."""
    cfg = runner.config
    if not cfg.cache.swap_space_is_default or cfg.cache.swap_space <= 0:
        return False
    group = window_group_for(layer_windows(runner.model), cfg.scheduler.max_model_len)
    if group is None or _unsupported(runner) is not None:
        return False
    logger.info(
        "no swap space by default: sliding-window layers keep their blocks in a pool of their own, which "
        "swap does not support (an explicit swap_space > 0 keeps swap, and every layer keeps its blocks)"
    )
    return True


def plan_window_pool(runner: Any, num_blocks: int, num_swap: int) -> tuple[int, WindowGroup | None]:
    """The full-attention pool's blocks and the window group of `runner`'s model, out of the budget of
    `num_blocks` blocks over all layers. No group (every layer keeps all its blocks, as before) for a model
    without a window shorter than the context, and where the group is not supported: swap space, a liquid
    device range, a drafter that runs sub-steps of its own (speculation other than n-gram)."""
    cfg = runner.config
    group = window_group_for(layer_windows(runner.model), cfg.scheduler.max_model_len)
    if group is None:
        return num_blocks, None
    spec = cfg.speculative
    reason = _unsupported(runner)
    if reason is None and num_swap > 0:
        reason = (
            f"swap space (swap_space={cfg.cache.swap_space} GiB; 0 gives the window layers their own pool)"
        )
    if reason is not None:
        logger.info(
            "sliding-window layers keep all their blocks: their own pool is not supported with %s", reason
        )
        return num_blocks, None
    per_block = runner.bytes_per_block
    window_bytes = per_block * len(group.layers) // int(runner.model.num_layers)
    step = cfg.scheduler.max_num_batched_tokens + (spec.num_speculative_tokens if spec is not None else 0)
    live = max_live_blocks(group.window, runner.block_size, step)
    explicit = cfg.cache.num_kv_blocks is not None
    full, window = split_pool(
        float("inf") if explicit else num_blocks * per_block,
        full_block_bytes=per_block - window_bytes,
        window_block_bytes=window_bytes,
        blocks_per_seq=runner.max_blocks_per_seq,
        live_per_seq=live,
        num_full_blocks=num_blocks if explicit else None,
    )
    return full, WindowGroup(group.window, group.layers, window)


def window_metadata(
    meta: AttentionMetadata,
    plan: Any,
    tables: Callable[[Any], tuple[np.ndarray, np.ndarray, np.ndarray]],
    group: WindowGroup,
    kv_caches: list[torch.Tensor],
) -> AttentionMetadata:
    """`meta` with the window group's slot mapping and block tables of `plan` (dead entries are block 0:
    the kernels mask those positions by the window), after applying the group's copy-on-write pairs (a
    forked sequence's shared partial block) to its layers' blocks (the scheduler hands them over once)."""
    slots, block_tables, copies = tables(plan)
    device = meta.slot_mapping.device
    if len(copies):
        pairs = torch.as_tensor(copies, dtype=torch.int64).view(-1, 2).to(device)
        for i in group.layers:
            kv = as_bytes(kv_caches[i])  # fp8 caches: copy the bytes
            kv[:, pairs[:, 1]] = kv[:, pairs[:, 0]]
    return replace(
        meta,
        slot_mapping=torch.as_tensor(slots, dtype=torch.int64).to(device),
        block_tables=torch.as_tensor(block_tables, dtype=torch.int32).to(device),
        cache={},
        group_window=group.window,
    )


def install_window_pool(pool: Any, group: WindowGroup) -> None:
    """Gives the window group's layers tensors of the group's own block count in `pool`."""
    pool.full_layer = next(i for i in range(len(pool.kv_caches)) if i not in group.layers)
    pool.window_layers = frozenset(group.layers)
    for i in group.layers:
        pool.kv_caches[i] = pool._alloc(group.num_blocks, pool.device)
