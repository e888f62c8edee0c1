"""KV-cache groups: sliding-window layers keep their blocks in pools of their own, one per window size.

A layer that attends only to the last ``window`` tokens never reads a block once every token in it fell out
of the window; the scheduler (Rust core, ``kv_groups``: one manager per group behind one trait) frees those
blocks mid-request and caps prefix hits to what each group's pool still holds, as vLLM V1's hybrid allocator
and llama.cpp's SWA cache do, and every step plan carries each group's slot mapping, block tables and
copy-on-write pairs, and the swap ops of its blocks (each group has a swap pool of its own, in its layers' part
of the host swap space). Here: which layers form which group, how one KV budget is split between the
full-attention pool and the window pools so that the memory goes where it is used, and each group's
attention metadata from a plan. A model whose every layer is windowed (Mistral with a window shorter than
the context) keeps its full-attention pool as bookkeeping only: no layer stores KV in it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from pagedrs._core import StepPlan
from pagedrs.config import as_bytes
from pagedrs.layers.attention import AttentionMetadata
from pagedrs.runner.kv_cache import layer_block_bytes

__all__ = [
    "WindowGroup",
    "group_metadata",
    "layer_windows",
    "max_live_blocks",
    "plan_window_pools",
    "split_pool",
    "split_pools",
    "step_tokens",
    "window_groups_for",
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


def window_groups_for(windows: list[int | None], max_model_len: int) -> tuple[WindowGroup, ...]:
    """The window groups of a model whose layers have `windows`: one per window size shorter than
    `max_model_len`, smallest window first (layers whose window covers the context are full attention)."""
    short = sorted({w for w in windows if w is not None and w < max_model_len})
    return tuple(WindowGroup(w, tuple(i for i, x in enumerate(windows) if x == w)) for w in short)


def max_live_blocks(window: int, block_size: int, step_tokens: int) -> int:
    """Most window blocks one sequence holds while computing `step_tokens` tokens a step (as the core's
    `sliding_window::max_live_blocks`)."""
    return -(-(window - 1 + step_tokens) // block_size) + 1


def step_tokens(cfg: Any) -> int:
    """The most tokens one sequence computes in a step of engine config `cfg`: the token budget and the
    draft tokens verified beside it."""
    spec = cfg.speculative
    return int(cfg.scheduler.max_num_batched_tokens) + (
        spec.num_speculative_tokens if spec is not None else 0
    )


def split_pool(
    budget_bytes: float,
    *,
    full_block_bytes: int,
    window_block_bytes: int,
    blocks_per_seq: int,
    live_per_seq: int,
    num_full_blocks: int | None = None,
) -> tuple[int, int]:
    """`split_pools` with one window group: (full-attention blocks, window blocks)."""
    full, (window,) = split_pools(
        budget_bytes,
        full_block_bytes=full_block_bytes,
        groups=[(window_block_bytes, live_per_seq)],
        blocks_per_seq=blocks_per_seq,
        num_full_blocks=num_full_blocks,
    )
    return full, window


def split_pools(
    budget_bytes: float,
    *,
    full_block_bytes: int,
    groups: list[tuple[int, int]],
    blocks_per_seq: int,
    num_full_blocks: int | None = None,
) -> tuple[int, list[int]]:
    """(full-attention blocks, each window group's blocks) for `budget_bytes`, `groups` being (bytes of a
    block, live blocks of one sequence) per group: in the ratio a max-length sequence uses them
    (`blocks_per_seq` full blocks), a window pool never smaller than one sequence's live blocks nor larger
    than the full pool (a sequence never holds more window blocks than full ones). `num_full_blocks` fixes
    the full pool's size (an explicit `num_kv_blocks`). With no full-attention layer (`full_block_bytes`
    0) the full count is the number of full-length blocks the window pools serve."""
    ratios = [min(1.0, live / blocks_per_seq) for _, live in groups]
    if num_full_blocks is None:
        per_full = full_block_bytes + sum(b * r for (b, _), r in zip(groups, ratios, strict=True))
        num_full_blocks = int(budget_bytes // per_full)
    sizes = [
        max(min(num_full_blocks, -(-int(num_full_blocks * live) // blocks_per_seq)), live)
        for _, live in groups
    ]
    window_bytes = sum(n * b for n, (b, _) in zip(sizes, groups, strict=True))
    if full_block_bytes and num_full_blocks * full_block_bytes + window_bytes > budget_bytes:
        num_full_blocks = int((budget_bytes - window_bytes) // full_block_bytes)
    return num_full_blocks, sizes


def plan_window_pools(runner: Any, num_blocks: int) -> tuple[int, tuple[WindowGroup, ...]]:
    """The full-attention pool's blocks and the window groups of `runner`'s model, out of the budget of
    `num_blocks` blocks over all layers. No group (every layer keeps all its blocks, as before) for a model
    without a window shorter than the context, and for a budget too small for the pools' minimum (one
    sequence's live window blocks at the largest step). A draft model's own pool (every one of its layers,
    through the full-attention tables) is part of the full-attention pool's block. With every layer windowed and no draft pool the full-attention pool stores
    nothing; it is sized so that it never limits admission."""
    cfg = runner.config
    groups = window_groups_for(layer_windows(runner.model), cfg.scheduler.max_model_len)
    if not groups:
        return num_blocks, ()
    per_block = runner.bytes_per_block
    draft_bytes = runner.drafter.kv_bytes_per_block if runner.drafter is not None else 0
    num_layers = int(runner.model.num_layers)
    # each group's share of a block: its layers' bytes (a layer reading another's KV owns none)
    weights = layer_block_bytes(runner.model, runner.block_size, runner.kv_dtype)
    target_bytes = per_block - draft_bytes
    group_bytes = [target_bytes * sum(weights[i] for i in g.layers) // sum(weights) for g in groups]
    step = step_tokens(cfg)
    lives = [max_live_blocks(g.window, runner.block_size, step) for g in groups]
    all_windowed = sum(len(g.layers) for g in groups) == num_layers
    full_bytes = draft_bytes if all_windowed else per_block - sum(group_bytes)
    # An explicit num_kv_blocks fixes the full-attention pool; with no full-attention layer it is the
    # budget in blocks of every layer (a draft pool's included), as the default's.
    explicit = cfg.cache.num_kv_blocks is not None and not all_windowed
    full, sizes = split_pools(
        float("inf") if explicit else num_blocks * per_block,
        full_block_bytes=full_bytes,
        groups=list(zip(group_bytes, lives, strict=True)),
        blocks_per_seq=runner.max_blocks_per_seq,
        num_full_blocks=num_blocks if explicit else None,
    )
    used = full * full_bytes + sum(n * b for n, b in zip(sizes, group_bytes, strict=True))
    if full < 1 or used > num_blocks * per_block:
        logger.info(
            "sliding-window layers keep all their blocks: %d blocks of KV cannot hold their own pools "
            "(at least one sequence's live window blocks each, %s)",
            num_blocks,
            ", ".join(f"window {g.window}: {n}" for g, n in zip(groups, lives, strict=True)),
        )
        return num_blocks, ()
    if full_bytes == 0:
        full = cfg.scheduler.max_num_seqs * runner.max_blocks_per_seq
    return full, tuple(replace(g, num_blocks=n) for g, n in zip(groups, sizes, strict=True))


def group_metadata(
    meta: AttentionMetadata, plan: StepPlan, index: int, group: WindowGroup, kv_caches: list[torch.Tensor]
) -> AttentionMetadata:
    """`meta` with group `index`'s slot mapping and block tables of `plan` (entries the group no longer holds
    are block 0: the kernels mask those positions by the window), after applying the group's copy-on-write
    pairs (a forked sequence's shared partial block) to its layers' blocks."""
    device = meta.slot_mapping.device
    counts = plan.group_num_copies
    start = int(counts[:index].sum())
    pairs_np = plan.group_copies[start : start + int(counts[index])]
    if len(pairs_np):
        pairs = torch.as_tensor(pairs_np, dtype=torch.int64).to(device)
        for i in group.layers:
            kv = as_bytes(kv_caches[i])  # fp8 caches: copy the bytes
            kv[:, pairs[:, 1]] = kv[:, pairs[:, 0]]
    return replace(
        meta,
        slot_mapping=torch.as_tensor(plan.group_slot_mapping[index], dtype=torch.int64).to(device),
        block_tables=torch.as_tensor(plan.group_block_tables[index], dtype=torch.int32).to(device),
        cache={},
        groups={},
        group_window=group.window,
    )
