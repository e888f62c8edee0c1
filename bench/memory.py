"""The PagedAttention-vs-HF-transformers memory experiment (GPT-2): how much KV memory a max-length cache reserves against paged blocks.

    python bench/memory.py                                  # CPU, the default model, that experiment's 4 prompts
    python bench/memory.py --device cuda --json bench/results/memory-cuda.json --plot memory.png

The same prompts go (1) through HF transformers one request at a time, each with a static KV cache
allocated for max_model_len tokens (the "traditional" allocation the seed describes), and (2) through
pagedrs all at once (continuous batching, KV blocks taken as tokens arrive). Reported, side by side:
memory allocated before and after loading the model and after each request (CUDA: torch's allocator;
CPU: the process's resident set), KV slots reserved against KV slots used, output throughput; the
PNG plots memory over time for both.
"""

from __future__ import annotations

# pagedrs before torch: importing it shortens libgomp's idle spin, which torch's import fixes for good
import pagedrs  # noqa: F401

# isort: split

import argparse
import math
import os
import time
from typing import Any

import torch
import transformers
from _common import add_commit_arg, command_line, resolve_commit, write_json

from pagedrs import EngineArgs, LLMEngine, SamplingParams

PROMPTS = [
    "Hello!",
    "How are you doing today? I hope everything is going well.",
    "Tell me a story about artificial intelligence and the future of humanity. "
    + "Describe how machines and people learn to work together, what they build, what they fear, " * 6,
    "Thanks!",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or GGUF (default: the embedded SmolLM2)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", default=None, metavar="PATH")
    add_commit_arg(p)
    p.add_argument("--plot", default=None, metavar="PNG")
    return p.parse_args(argv)


def memory_gb(device: str) -> float:
    if device == "cuda":
        return torch.cuda.memory_allocated() / 2**30
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


class Timeline:
    def __init__(self, device: str) -> None:
        self.device = device
        self.t0 = time.perf_counter()
        self.points: list[tuple[float, float, str]] = []

    def mark(self, label: str) -> float:
        gb = memory_gb(self.device)
        self.points.append((time.perf_counter() - self.t0, gb, label))
        print(f"  {label}: {gb:.3f} GB")
        return gb


def run_hf(
    a: argparse.Namespace, folder: str, ids_list: list[list[int]], dtype: torch.dtype
) -> dict[str, Any]:
    tl = Timeline(a.device)
    tl.mark("hf start")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(a.device).eval()
    tl.mark("hf model loaded")
    reserved = used = tokens = 0
    start = time.perf_counter()
    for i, ids in enumerate(ids_list):
        cache = transformers.StaticCache(config=hf.config, max_cache_len=a.max_model_len)  # max-length KV
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([ids], device=a.device),
                max_new_tokens=a.max_tokens,
                do_sample=False,
                past_key_values=cache,
                eos_token_id=[],
                pad_token_id=0,
            )
        n = out.shape[1] - len(ids)
        tokens += n
        reserved += a.max_model_len
        used += len(ids) + n
        tl.mark(f"hf request {i + 1} done ({len(ids)} prompt tokens)")
        del cache
    seconds = time.perf_counter() - start
    del hf
    return {
        "tokens": tokens,
        "seconds": seconds,
        "kv_reserved": reserved,
        "kv_used": used,
        "timeline": tl.points,
    }


def run_pagedrs(a: argparse.Namespace, ids_list: list[list[int]], dtype: str) -> dict[str, Any]:
    tl = Timeline(a.device)
    tl.mark("pagedrs start")
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=a.model,
            device=a.device,
            dtype=dtype,
            max_model_len=a.max_model_len,
            cpu_kv_cache_gb=0.25 if a.device == "cpu" else None,
            gpu_memory_utilization=0.5,
            disable_log_stats=True,
        )
    )
    tl.mark("pagedrs engine ready (model + KV pool)")
    block = engine.config.cache.block_size
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    for i, ids in enumerate(ids_list):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    reserved_peak: dict[str, int] = {}
    tokens, start = 0, time.perf_counter()
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
                tl.mark(f"pagedrs request {int(out.request_id) + 1} done")
        step += 1
        for i, ids in enumerate(ids_list):  # blocks each request holds now (whole blocks)
            rid = str(i)
            held = engine.engine_core.has_request(rid)
            if held:
                length = len(ids) + min(step, a.max_tokens)
                reserved_peak[rid] = max(reserved_peak.get(rid, 0), math.ceil(length / block) * block)
    seconds = time.perf_counter() - start
    used = sum(len(ids) + a.max_tokens for ids in ids_list)
    reserved = sum(reserved_peak.values())
    engine.shutdown()
    return {
        "tokens": tokens,
        "seconds": seconds,
        "kv_reserved": reserved,
        "kv_used": used,
        "timeline": tl.points,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    from pagedrs.loader import load_tokenizer, model_folder, resolve_model_path

    folder = model_folder(resolve_model_path(a.model))
    tok = load_tokenizer(a.model)
    ids_list = [tok.encode(p) for p in PROMPTS]
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    print(f"prompts: {[len(p) for p in PROMPTS]} characters, {[len(x) for x in ids_list]} tokens")
    print("HF transformers, one request at a time, KV cache allocated for max_model_len:")
    hf = run_hf(a, folder, ids_list, dtype)
    if a.device == "cuda":
        torch.cuda.empty_cache()
    print("pagedrs, all requests at once, paged KV blocks:")
    pg = run_pagedrs(a, ids_list, str(dtype).removeprefix("torch."))
    for name, r in (("transformers", hf), ("pagedrs", pg)):
        r["tok_s"] = r["tokens"] / r["seconds"]
        r["kv_waste_pct"] = 100.0 * (1 - r["kv_used"] / r["kv_reserved"])
        print(
            f"{name}: {r['tokens']} tokens in {r['seconds']:.2f} s = {r['tok_s']:.1f} tok/s; KV slots reserved "
            f"{r['kv_reserved']} for {r['kv_used']} used (waste {r['kv_waste_pct']:.1f}%)"
        )
    print(
        f"output throughput: {pg['tok_s']:.1f} tok/s (pagedrs) vs {hf['tok_s']:.1f} tok/s (transformers one at a "
        f"time) = {pg['tok_s'] / hf['tok_s']:.2f} x; KV slots reserved: {pg['kv_reserved']} vs {hf['kv_reserved']} "
        f"= {pg['kv_reserved'] / hf['kv_reserved']:.2f} x"
    )
    result = {
        "command": command_line(),
        "commit": resolve_commit(a.commit),
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "max_model_len": a.max_model_len,
        "max_tokens": a.max_tokens,
        "prompt_tokens": [len(x) for x in ids_list],
        "transformers": hf,
        "pagedrs": pg,
    }
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        for name, r in (("transformers (max-length KV)", hf), ("pagedrs (paged KV)", pg)):
            xs = [p[0] for p in r["timeline"]]
            ys = [p[1] for p in r["timeline"]]
            ax.step(xs, ys, where="post", marker="o", label=name)
        ax.set_xlabel("seconds since start")
        ax.set_ylabel("GB allocated" if a.device == "cuda" else "GB resident (process)")
        ax.set_title(f"memory over time ({result['device']})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot)
    if a.json:
        write_json(a.json, result)
    return result


if __name__ == "__main__":
    main()
