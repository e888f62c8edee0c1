"""The CPU paged decode attention (`pagedrs._core.paged_decode_attention`, what a decode or a speculative
verification step runs per layer on a CPU) against torch on the same cache, side by side in one run.

    python bench/attention_cpu.py                          # the default model's heads, context 800
    python bench/attention_cpu.py --context 256 2048 --queries 1 9 --json bench/results/attention-cpu.json

One sequence with `--context` cached tokens and Q query tokens (1: a decode; more: a verification of Q - 1
drafts, each query causal at its own position, as the kernel takes them: one "sequence" per token over
the same block table). The peer is torch's path for the same work: gather the sequence's blocks into
contiguous K/V, then `F.scaled_dot_product_attention` with the query heads grouped (GQA) and a causal mask
over the last Q positions. Heads: SmolLM2-135M's 9 query / 3 KV heads of 64, blocks of 16, float32. Each
figure is the 10th percentile of --iters calls, the better of two rounds alternating the two.
"""

from __future__ import annotations

# pagedrs before torch: importing it shortens libgomp's idle spin, which torch's import fixes for good
import pagedrs  # noqa: F401

# isort: split

import argparse

import numpy as np
import torch
import torch.nn.functional as F
from _common import add_commit_arg, command_line, git_info, low_time, machine_info, write_json

from pagedrs import _core

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 9, 3, 64, 16


def case(context: int, queries: int, threads: int, iters: int, rng: np.random.Generator) -> dict[str, float]:
    total = context + queries
    nb = -(-total // BLOCK)
    cache = rng.standard_normal((2, 2 * nb, BLOCK, KV_HEADS, HEAD_SIZE), dtype=np.float32)
    blocks = rng.permutation(2 * nb)[:nb].astype(np.int32)
    q = rng.standard_normal((queries, HEADS, HEAD_SIZE), dtype=np.float32)
    tables = np.tile(blocks, (queries, 1))
    lens = (context + 1 + np.arange(queries)).astype(np.int32)
    out = np.empty_like(q)
    scale = HEAD_SIZE**-0.5

    def kernel() -> None:
        _core.paged_decode_attention(q, cache, tables, lens, out, scale, None, threads)

    kv = torch.from_numpy(cache)
    idx = torch.from_numpy(blocks.astype(np.int64))
    qt = torch.from_numpy(q).transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
    # Query i sees positions < context + 1 + i.
    mask = torch.arange(total)[None, :] < torch.from_numpy(lens.astype(np.int64))[:, None]

    def peer() -> torch.Tensor:
        k = kv[0, idx].reshape(-1, KV_HEADS, HEAD_SIZE)[:total].transpose(0, 1).unsqueeze(0)
        v = kv[1, idx].reshape(-1, KV_HEADS, HEAD_SIZE)[:total].transpose(0, 1).unsqueeze(0)
        return F.scaled_dot_product_attention(qt, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    kernel()
    want = peer()[0].transpose(0, 1).numpy()
    err = float(np.abs(out - want).max())
    best = {"kernel_us": float("inf"), "torch_us": float("inf")}
    for _ in range(2):
        best["kernel_us"] = min(best["kernel_us"], low_time(kernel, iters) * 1e6)
        best["torch_us"] = min(best["torch_us"], low_time(peer, iters) * 1e6)
    return {**best, "speedup": best["torch_us"] / best["kernel_us"], "max_abs_diff": err}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, nargs="+", default=[800])
    p.add_argument("--queries", type=int, nargs="+", default=[1, 5, 9])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--json", default=None)
    add_commit_arg(p)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    results = []
    print(
        f"{'context':>7} {'queries':>7} {'kernel us':>10} {'torch us':>9} {'speed-up':>9} {'max |diff|':>10}"
    )
    for context in args.context:
        for queries in args.queries:
            r = {
                "context": context,
                "queries": queries,
                **case(context, queries, args.threads, args.iters, rng),
            }
            results.append(r)
            print(
                f"{context:>7} {queries:>7} {r['kernel_us']:>10.1f} {r['torch_us']:>9.1f} "
                f"{r['speedup']:>8.2f}x {r['max_abs_diff']:>10.2e}",
                flush=True,
            )
    if args.json:
        write_json(
            args.json,
            {
                "bench": "attention_cpu",
                "command": command_line(),
                "machine": machine_info(),
                **git_info(args.commit),
                "threads": args.threads,
                "heads": [HEADS, KV_HEADS, HEAD_SIZE, BLOCK],
                "results": results,
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
