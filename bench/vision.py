"""Requests with images: TTFT and output throughput for 1-4 images a request at several resolutions, and
what the encoder cache saves on a repeated image (the same batch run again: every image a hit, no encoder
run, the prompt prefixes from the prefix cache). Prints one JSON line and writes JSON beside it.

`--model` names a checkpoint whose model takes images (Gemma3ForConditionalGeneration) and whose folder
holds its processor; each prompt writes the processor's image token once per image.
"""

from __future__ import annotations

# pagedrs before torch: importing it shortens libgomp's idle spin, which torch's import fixes for good
import pagedrs  # noqa: F401

# isort: split
import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
from _common import add_commit_arg, command_line, git_info, json_safe, machine_info, write_json
from PIL import Image

from pagedrs import EngineArgs, LLMEngine, SamplingParams


def image(height: int, width: int, seed: int) -> Image.Image:
    rs = np.random.RandomState(seed)
    return Image.fromarray((rs.rand(height, width, 3) * 255).astype("uint8"))


def run_batch(engine: LLMEngine, prompts: list[dict[str, Any]], max_tokens: int, tag: str) -> dict[str, Any]:
    """All prompts at once: TTFT per request, output throughput, cached prompt tokens, encoder runs."""
    cache = engine.runner.encoder_cache
    assert cache is not None, "the model takes no images"
    runs0, hits0 = cache.runs, cache.hits
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    ttft: dict[str, float] = {}
    cached = 0
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in ttft and out.outputs and out.outputs[0].token_ids:
                ttft[out.request_id] = time.perf_counter() - start
            if out.finished:
                cached += out.num_cached_tokens or 0
                tokens += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    return {
        "requests": len(prompts),
        "ttft_p50_ms": statistics.median(ttft.values()) * 1e3,
        "ttft_max_ms": max(ttft.values()) * 1e3,
        "output_token_throughput": tokens / elapsed,
        "cached_prompt_tokens": cached,
        "encoder_runs": cache.runs - runs0,
        "encoder_hits": cache.hits - hits0,
        "seconds": elapsed,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=8, help="requests per image count")
    p.add_argument(
        "--sizes", default="224x224,448x320,896x896", help="image resolutions, HxW, comma separated"
    )
    p.add_argument("--quick", action="store_true", help="2 requests, 1 and 2 images, 4 tokens")
    p.add_argument("--json", default="bench/results/vision.json")
    add_commit_arg(p)
    args = p.parse_args()
    counts = [1, 2] if args.quick else [1, 2, 3, 4]
    requests = 2 if args.quick else args.requests
    max_tokens = 4 if args.quick else args.max_tokens
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=args.model, device=args.device, dtype=args.dtype, disable_log_stats=True, seed=0)
    )
    mm = engine.input_processor.mm_processor
    assert mm is not None, f"{args.model} takes no images"
    rows = []
    for n in counts:
        prompts = []
        for r in range(requests):
            imgs = [image(*sizes[(r + k) % len(sizes)], seed=1000 * n + 10 * r + k) for k in range(n)]
            text = f"request {r}: " + " ".join(f"image {k} {mm.image_token}" for k in range(n)) + " describe"
            prompts.append({"prompt": text, "multi_modal_data": {"image": imgs}})
        cold = run_batch(engine, prompts, max_tokens, f"cold{n}")
        warm = run_batch(engine, prompts, max_tokens, f"warm{n}")  # the same images and prompts again
        rows.append({"images_per_request": n, "cold": cold, "repeat": warm})
    result = {
        "bench": "vision",
        "model": args.model,
        "sizes": [f"{h}x{w}" for h, w in sizes],
        "rows": rows,
        "repeat_ttft_saving": statistics.mean(
            1 - r["repeat"]["ttft_p50_ms"] / r["cold"]["ttft_p50_ms"] for r in rows
        ),
        "command": command_line(),
        "machine": machine_info(),
        **git_info(args.commit),
    }
    write_json(args.json, result)
    print(json.dumps(json_safe({k: result[k] for k in ("bench", "repeat_ttft_saving")} | {"rows": rows})))


if __name__ == "__main__":
    main()
