"""Requests with images: TTFT and output throughput for 1-4 images a request at each of several
resolutions, and what the encoder cache saves on a repeated image (the same batch run again: every image a
hit, no encoder run, the prompt prefixes from the prefix cache). Prints one JSON line and writes JSON
beside it.

`--model` names a checkpoint whose model takes images and whose folder holds its processor; each prompt
writes `--image-placeholder` (the processor's image token by default) once per image. `--random-qwen2-5-vl`
builds a random-weight Qwen2.5-VL of a real shape instead (`_vision_model.py`). A third run sends the same
images behind new prompt text: the encoder cache still serves them, the prefix cache serves nothing, so its
TTFT against the first run's is the encoder cache's saving alone.
"""

from __future__ import annotations

# pagedrs before torch: importing it shortens libgomp's idle spin, which torch's import fixes for good
import pagedrs  # noqa: F401

# isort: split
import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
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
    p.add_argument("--model", help="a checkpoint folder or Hub name whose model takes images")
    p.add_argument(
        "--random-qwen2-5-vl",
        type=int,
        metavar="DEPTH",
        help="instead of --model: a random Qwen2.5-VL, its vision tower cut to DEPTH blocks (_vision_model.py)",
    )
    p.add_argument(
        "--image-placeholder",
        help="what the prompt writes per image (default: the processor's image token; Qwen2.5-VL: "
        "'<|vision_start|><|image_pad|><|vision_end|>')",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=8, help="requests per image count")
    p.add_argument(
        "--sizes", default="224x224,448x320,896x896", help="image resolutions, HxW, comma separated"
    )
    p.add_argument(
        "--quick", action="store_true", help="2 requests, 1 and 2 images, 4 tokens, the first size only"
    )
    p.add_argument("--json", default="bench/results/vision.json")
    add_commit_arg(p)
    args = p.parse_args()
    counts = [1, 2] if args.quick else [1, 2, 3, 4]
    requests = 2 if args.quick else args.requests
    max_tokens = 4 if args.quick else args.max_tokens
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    sizes = sizes[:1] if args.quick else sizes
    model = args.model
    if args.random_qwen2_5_vl is not None:
        from _vision_model import make_qwen2_5_vl

        model = str(make_qwen2_5_vl(Path(tempfile.mkdtemp()) / "qwen2_5_vl", args.random_qwen2_5_vl))
        if args.image_placeholder is None:
            args.image_placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    if model is None:
        p.error("--model or --random-qwen2-5-vl is required")
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=model, device=args.device, dtype=args.dtype, disable_log_stats=True, seed=0)
    )
    mm = engine.input_processor.mm_processor
    assert mm is not None, f"{model} takes no images"
    placeholder = args.image_placeholder or mm.image_token
    rows = []
    for h, w in sizes:
        for n in counts:
            prompts = []
            for r in range(requests):
                imgs = [image(h, w, seed=1000 * n + 10 * r + k + h) for k in range(n)]
                text = f"request {r}: " + " ".join(f"image {k} {placeholder}" for k in range(n)) + " describe"
                prompts.append({"prompt": text, "multi_modal_data": {"image": imgs}})
            tag = f"{h}x{w}-{n}"
            cold = run_batch(engine, prompts, max_tokens, f"cold{tag}")
            warm = run_batch(engine, prompts, max_tokens, f"warm{tag}")  # the same images and prompts again
            # the same images behind new text: encoder-cache hits, no prefix-cache hit
            fresh = [{**q, "prompt": f"again, {tag}: " + q["prompt"]} for q in prompts]
            images_only = run_batch(engine, fresh, max_tokens, f"images{tag}")
            rows.append(
                {
                    "size": f"{h}x{w}",
                    "images_per_request": n,
                    "cold": cold,
                    "repeat": warm,
                    "repeat_images": images_only,
                }
            )
    result = {
        "bench": "vision",
        "model": model
        if args.random_qwen2_5_vl is None
        else f"random Qwen2.5-VL, vision depth {args.random_qwen2_5_vl}",
        "sizes": [f"{h}x{w}" for h, w in sizes],
        "rows": rows,
        "repeat_ttft_saving": statistics.mean(
            1 - r["repeat"]["ttft_p50_ms"] / r["cold"]["ttft_p50_ms"] for r in rows
        ),
        "encoder_cache_ttft_saving": statistics.mean(
            1 - r["repeat_images"]["ttft_p50_ms"] / r["cold"]["ttft_p50_ms"] for r in rows
        ),
        "command": command_line(),
        "machine": machine_info(),
        **git_info(args.commit),
    }
    write_json(args.json, result)
    print(
        json.dumps(
            json_safe(
                {k: result[k] for k in ("bench", "repeat_ttft_saving", "encoder_cache_ttft_saving")}
                | {"rows": rows}
            )
        )
    )


if __name__ == "__main__":
    main()
