r"""Cost of the data-parallel router (`pagedrs.engine.dp.router.DPRouter`) per request, per policy.

    python bench/dp_router_micro.py --json bench/results/dp_router_micro.json

The router is filled as a big deployment would have it: --replicas replicas (8), each reported by its
core's events to hold --cached-blocks block hashes (100k): a --shared-blocks-block system prompt (cached
on every replica, as happens once it is popular), one tenant prefix per replica, and the rest random. Then
--requests prompts of --prompt-blocks blocks (64) are routed, in three shapes:

  * `tenant`: a tenant's prefix (3/4 of the prompt) cached on one replica, then new blocks;
  * `all_hit`: the whole prompt cached on every replica (the longest walk);
  * `miss`: no block cached anywhere.

`route` is timed over the requests in a row (each stays in flight, so loads and optimistic entries grow as
in a burst), then `finish` of all of them; the best of --repeats runs is reported as µs per request, with
`apply_events` per step (16 blocks stored, 16 removed). Prints one line per policy and shape:

    route cost: A µs/request (cache, tenant, 8 replicas x 100000 cached blocks, 64-block prompts)
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

from _common import add_commit_arg, command_line, git_info, machine_info, write_json

from pagedrs.engine.core.messages import KVCacheEvents
from pagedrs.engine.dp.router import ROUTING_POLICIES, DPRouter

SHAPES = ("tenant", "all_hit", "miss")


def rand_hashes(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(n)]


def build_router(
    policy: str, args: argparse.Namespace, rng: random.Random
) -> tuple[DPRouter, dict[str, Any]]:
    """A router whose replicas hold --cached-blocks hashes each, and the prefixes the prompts use."""
    router = DPRouter(args.replicas, policy, block_size=16)
    shared = rand_hashes(rng, args.prompt_blocks)
    tenants = [rand_hashes(rng, args.prompt_blocks * 3 // 4) for _ in range(args.replicas)]
    for r in range(args.replicas):
        rest = args.cached_blocks - len(shared) - len(tenants[r])
        stored = shared + tenants[r] + rand_hashes(rng, rest)
        router.apply_events(r, KVCacheEvents(stored=stored))
    return router, {"shared": shared, "tenants": tenants}


def prompts(
    shape: str, prefixes: dict[str, Any], args: argparse.Namespace, rng: random.Random
) -> list[list[int]]:
    out = []
    for i in range(args.requests):
        if shape == "all_hit":
            out.append(list(prefixes["shared"]))
        elif shape == "tenant":
            prefix = prefixes["tenants"][i % args.replicas]
            out.append(prefix + rand_hashes(rng, args.prompt_blocks - len(prefix)))
        else:
            out.append(rand_hashes(rng, args.prompt_blocks))
    return out


def time_shape(router: DPRouter, batch: list[list[int]], tag: str, repeats: int) -> dict[str, float]:
    """Best of `repeats`: µs per route and per finish over the batch."""
    best_route = best_finish = float("inf")
    num_tokens = len(batch[0]) * router.block_size
    for rep in range(repeats):
        ids = [f"{tag}-{rep}-{i}" for i in range(len(batch))]
        t0 = time.perf_counter()
        for rid, hashes in zip(ids, batch, strict=True):
            router.route(rid, hashes, num_tokens)
        t1 = time.perf_counter()
        for rid in ids:
            router.finish(rid, 16)
        t2 = time.perf_counter()
        best_route = min(best_route, (t1 - t0) / len(batch) * 1e6)
        best_finish = min(best_finish, (t2 - t1) / len(batch) * 1e6)
    return {"route_us": best_route, "finish_us": best_finish}


def time_events(router: DPRouter, rng: random.Random, steps: int) -> float:
    """µs per apply_events of one step: 16 new blocks stored, 16 of the previous step's removed."""
    prev = rand_hashes(rng, 16)
    router.apply_events(0, KVCacheEvents(stored=prev))
    batches = [rand_hashes(rng, 16) for _ in range(steps)]
    t0 = time.perf_counter()
    for new in batches:
        router.apply_events(0, KVCacheEvents(stored=new, removed=prev))
        prev = new
    return (time.perf_counter() - t0) / steps * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--cached-blocks", type=int, default=100_000, help="block hashes cached per replica")
    p.add_argument("--prompt-blocks", type=int, default=64)
    p.add_argument("--requests", type=int, default=2000, help="prompts routed per timed run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures here")
    add_commit_arg(p)
    args = p.parse_args(argv)
    if args.cached_blocks < 2 * args.prompt_blocks:
        raise SystemExit("--cached-blocks must be at least 2 x --prompt-blocks")

    rows = []
    for policy in ROUTING_POLICIES:
        rng = random.Random(args.seed)
        t0 = time.perf_counter()
        router, prefixes = build_router(policy, args, rng)
        fill_s = time.perf_counter() - t0
        for shape in SHAPES:
            batch = prompts(shape, prefixes, args, rng)
            row = {"policy": policy, "shape": shape, **time_shape(router, batch, shape, args.repeats)}
            rows.append(row)
            print(
                f"route cost: {row['route_us']:.1f} µs/request ({policy}, {shape}, {args.replicas} replicas x "
                f"{args.cached_blocks} cached blocks, {args.prompt_blocks}-block prompts); "
                f"finish {row['finish_us']:.1f} µs"
            )
        events_us = time_events(router, rng, 2000)
        print(
            f"apply_events: {events_us:.1f} µs/step (16 stored + 16 removed; {policy}; fill {fill_s:.1f} s)"
        )
        rows.append({"policy": policy, "shape": "events", "apply_events_us": events_us, "fill_s": fill_s})
    worst = max(r["route_us"] for r in rows if "route_us" in r)
    print(f"worst route cost: {worst:.1f} µs/request (goal < 50)")
    if args.json:
        write_json(
            args.json,
            {
                "bench": "dp_router_micro",
                "command": command_line(),
                "git": git_info(args.commit),
                "machine": machine_info(),
                "config": vars(args),
                "rows": rows,
                "worst_route_us": worst,
            },
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
