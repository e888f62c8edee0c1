"""Agentic multi-turn sessions with and without the host KV tier (`kv_offloading_size`).

Sessions take turns in round robin: each turn's prompt is the session's whole history (its earlier prompts
and answers) plus new tokens, so contexts grow, and the device pool (`--num-kv-blocks`) holds only a few
sessions: by the time a session comes back, other sessions have evicted its blocks. Reported per
configuration: TTFT p50/p90 of returning turns (turn >= 2) and the fraction of their prompt tokens served
from a cache (`num_cached_tokens`); then the cost of the tier with nothing to hit (every prompt new):
output throughput with the tier over without it, the engines held side by side and measured in
alternating rounds on the same prompts (the median of the per-round ratios). With `--disk-gib`, a third configuration adds the disk tier
behind the host tier (`kv_offloading_disk_path`, a fresh temporary folder per engine): its no-hit ratio is
the cost of writing every stored block to disk. Prints one JSON line.
"""

from __future__ import annotations

# pagedrs before torch: importing it shortens libgomp's idle spin, which torch's import fixes for good
import pagedrs  # noqa: F401

# isort: split
import argparse
import json
import random
import statistics
import tempfile
import time
from typing import Any

import torch
from _common import add_commit_arg, command_line, git_info, json_safe, machine_info, write_json

from pagedrs import EngineArgs, LLMEngine, SamplingParams


def make_engine(args: argparse.Namespace, tier_gib: float, disk: str | None = None) -> LLMEngine:
    return LLMEngine.from_engine_args(
        EngineArgs(
            model=args.model,
            device="cpu",
            dtype="float32",
            num_kv_blocks=args.num_kv_blocks,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_offloading_size=tier_gib,
            kv_offloading_disk_path=disk,
            kv_offloading_disk_size=args.disk_gib if disk else None,
            disable_log_stats=True,
            seed=0,
        )
    )


def run_request(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int) -> tuple[float, Any]:
    """(seconds to the first token, final output) of one request run alone."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(rid, prompt, params)
    ttft = None
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and out.outputs and out.outputs[0].token_ids:
                ttft = time.perf_counter() - start
            if out.finished:
                final = out
    assert ttft is not None and final is not None
    return ttft, final


def sessions_run(args: argparse.Namespace, tier_gib: float, vocab: int, disk: str | None) -> dict[str, Any]:
    rng = random.Random(0)
    engine = make_engine(args, tier_gib, disk)
    history = [[rng.randrange(vocab) for _ in range(args.first_len)] for _ in range(args.sessions)]
    ttfts: list[float] = []
    cached: list[float] = []
    for turn in range(args.turns):
        for s in range(args.sessions):
            prompt = history[s]
            ttft, out = run_request(engine, f"s{s}t{turn}", prompt, args.output_len)
            if turn > 0:
                ttfts.append(ttft)
                cached.append((out.num_cached_tokens or 0) / len(prompt))
            history[s] = prompt + list(out.outputs[0].token_ids)
            history[s] += [rng.randrange(vocab) for _ in range(args.turn_len)]
    stats = engine.get_stats()
    engine.shutdown()
    q = statistics.quantiles(ttfts, n=10) if len(ttfts) > 1 else ttfts * 9
    return {
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": q[8],
        "cached_fraction": statistics.fmean(cached),
        "returning_turns": len(ttfts),
        "tier_hit_tokens": stats.external_prefix_cache_hits,
        "tier_bytes_loaded": stats.kv_offload_bytes_loaded,
    }


def no_hit_round(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str) -> float:
    """Output tokens per second over prompts this engine has never seen (nothing to hit)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompts) * output_len / (time.perf_counter() - start)


def no_hit_runs(
    args: argparse.Namespace, configs: list[tuple[str, float, bool]], vocab: int, folder: str
) -> dict[str, list[float]]:
    """Every configuration's engine held side by side, measured in `--no-hit-rounds` rounds on the same new
    prompts, the order of the engines alternating from round to round, so a change of the machine's load
    falls on all of them."""
    rng = random.Random(1)
    engines = {
        name: make_engine(args, gib, f"{folder}/n-{name}" if disk else None) for name, gib, disk in configs
    }
    for name, engine in engines.items():
        run_request(engine, f"warm-{name}", [rng.randrange(vocab) for _ in range(16)], 2)
    tput: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.no_hit_rounds):
        prompts = [[rng.randrange(vocab) for _ in range(args.first_len)] for _ in range(args.no_hit_prompts)]
        for name in list(engines)[:: 1 if r % 2 == 0 else -1]:
            tput[name].append(no_hit_round(engines[name], prompts, args.output_len, f"r{r}"))
    for engine in engines.values():
        engine.shutdown()
    return tput


def _paired_ratio(tput: dict[str, list[float]], name: str) -> float | None:
    """Median over rounds of this configuration's throughput over the no-tier engine's in the same round."""
    if name not in tput:
        return None
    return statistics.median(a / b for a, b in zip(tput[name], tput["no_tier"], strict=True))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path or name (default: the embedded default model)")
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--first-len", type=int, default=384, help="tokens of a session's first prompt")
    p.add_argument("--turn-len", type=int, default=32, help="new tokens a later turn adds")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=96, help="the device pool: a few sessions' worth")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--tier-gib", type=float, default=0.5, help="kv_offloading_size of the tier runs")
    p.add_argument("--disk-gib", type=float, default=0.0, help="> 0: also runs with a disk tier this big")
    p.add_argument("--no-hit-prompts", type=int, default=8, help="new prompts per no-hit round")
    p.add_argument("--no-hit-rounds", type=int, default=5, help="rounds of the engines held side by side")
    p.add_argument("--vocab", type=int, default=1000, help="prompt ids are drawn below this")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--quick", action="store_true", help="a few short turns (a smoke test, not figures)")
    p.add_argument("--json", default=None, help="write the figures here")
    add_commit_arg(p)
    args = p.parse_args(argv)
    if args.quick:
        args.sessions, args.turns, args.first_len, args.turn_len = 3, 2, 48, 8
        args.output_len, args.num_kv_blocks, args.no_hit_prompts, args.no_hit_rounds = 2, 8, 2, 2
    torch.set_num_threads(args.threads)
    vocab = args.vocab
    configs = [("no_tier", 0.0, False), ("host_tier", args.tier_gib, False)]
    if args.disk_gib > 0:
        configs.append(("disk_tier", args.tier_gib, True))
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pagedrs-kv-") as folder:
        for name, gib, disk in configs:
            runs[name] = sessions_run(args, gib, vocab, f"{folder}/s-{name}" if disk else None)
        tput = no_hit_runs(args, configs, vocab, folder)
    result = {
        "bench": "agentic",
        "runs": runs,
        "ttft_p50_ratio": runs["host_tier"]["ttft_p50_s"] / runs["no_tier"]["ttft_p50_s"],
        "no_hit_tok_s": tput,
        # per round: tier over no tier in the same round; the median of those
        "no_hit_throughput_ratio": _paired_ratio(tput, "host_tier"),
        "no_hit_disk_throughput_ratio": _paired_ratio(tput, "disk_tier"),
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "commit")},
        "command": command_line(),
        "git": git_info(args.commit),
        "machine": machine_info(),
    }
    result["commit"] = result["git"]["commit"]
    print(json.dumps(json_safe(result)))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
