"""KV memory of sliding-window layers: how many max-length requests fit in one KV budget when every layer keeps
all its blocks, against the window layers keeping only their window in a pool of their own (`runner.kv_groups`,
the split the engine makes at start-up).

    python bench/window_memory.py                      # Gemma-3-1B shape, 8k-token requests, 4 GiB, bf16
    python bench/window_memory.py --step-tokens 512 --budget-gib 8

The default shape is Gemma 3 1B's: 26 layers (every 6th global, the others local with a 512-token window),
one KV head of 256. A request's window blocks are counted at the most one sequence can hold in a step of
`--step-tokens` tokens (the chunked-prefill budget, `max_num_batched_tokens`), as the engine reserves them.
"""

from __future__ import annotations

import argparse
import math

import torch

from pagedrs.runner.kv_cache import block_bytes
from pagedrs.runner.kv_groups import max_live_blocks, split_pool, window_groups_for


def figures(
    *,
    num_layers: int,
    global_every: int,
    window: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    block_size: int,
    request_len: int,
    step_tokens: int,
    budget_bytes: float,
) -> dict[str, float]:
    windows: list[int | None] = [None if (i + 1) % global_every == 0 else window for i in range(num_layers)]
    (group,) = window_groups_for(windows, request_len)
    per_layer = block_bytes(1, block_size, num_kv_heads, head_size, dtype)
    blocks_per_seq = math.ceil(request_len / block_size)
    # before: one pool, every layer's block of every position
    before = int(budget_bytes // (per_layer * num_layers)) // blocks_per_seq
    live = max_live_blocks(window, block_size, step_tokens)
    full, win = split_pool(
        budget_bytes,
        full_block_bytes=per_layer * (num_layers - len(group.layers)),
        window_block_bytes=per_layer * len(group.layers),
        blocks_per_seq=blocks_per_seq,
        live_per_seq=live,
    )
    after = min(full // blocks_per_seq, win // live)
    return {
        "local_layers": len(group.layers),
        "global_layers": num_layers - len(group.layers),
        "before": before,
        "after": after,
        "full_blocks": full,
        "window_blocks": win,
        "live_window_blocks_per_request": live,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-layers", type=int, default=26)
    ap.add_argument("--global-every", type=int, default=6)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--num-kv-heads", type=int, default=1)
    ap.add_argument("--head-size", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--request-len", type=int, default=8192)
    ap.add_argument("--step-tokens", type=int, default=2048)
    ap.add_argument("--budget-gib", type=float, default=4.0)
    args = ap.parse_args()
    f = figures(
        num_layers=args.num_layers,
        global_every=args.global_every,
        window=args.window,
        num_kv_heads=args.num_kv_heads,
        head_size=args.head_size,
        dtype=torch.bfloat16,
        block_size=args.block_size,
        request_len=args.request_len,
        step_tokens=args.step_tokens,
        budget_bytes=args.budget_gib * (1 << 30),
    )
    print(
        f"{f['local_layers']} local + {f['global_layers']} global layers, window {args.window}, "
        f"{args.request_len}-token requests, {args.budget_gib:g} GiB bf16 KV, step {args.step_tokens} tokens"
    )
    print(f"before (every layer keeps all blocks): {f['before']} concurrent requests")
    print(
        f"after (window layers in their own pool): {f['after']} concurrent requests "
        f"({f['full_blocks']} full blocks, {f['window_blocks']} window blocks, "
        f"{f['live_window_blocks_per_request']} live window blocks a request)"
    )


if __name__ == "__main__":
    main()
