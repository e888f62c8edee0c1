"""The engine's decode throughput on a tiny-but-wide gpt-oss (random weights, `quantization="q8_0"`: Q8_0
attention, router and head, float32 experts on the fused experts kernel) with the CPU decode step
(`models.cpu_decode`) and without it (PAGEDRS_CPU_DECODE=0: the torch modules), runs interleaved so that
the machine's load falls on both alike.

    python bench/cpu_decode_gpt_oss.py [--threads 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers
from _common import add_commit_arg, command_line, decode_tok_s, git_info, machine_info, write_json


def _config(window: int) -> transformers.GptOssConfig:
    """hidden 512, 4 layers (sliding and full alternating), 8 heads of 64 (4 KV heads), 16 experts of 512,
    top 4, YaRN."""
    return transformers.GptOssConfig(
        vocab_size=512,
        hidden_size=512,
        intermediate_size=512,
        head_dim=64,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=4,
        num_local_experts=16,
        num_experts_per_tok=4,
        sliding_window=window,
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "rope_theta": 10000.0,
        },
        tie_word_embeddings=False,
        architectures=["GptOssForCausalLM"],
    )


def _tok_s(folder: str, fast: bool, batch: int, tokens: int, threads: int) -> float:
    """Decode tok/s: `batch` requests of 24-token prompts (longer than the window), `tokens` greedy tokens
    each, timed from the step after every prompt is in."""
    from pagedrs import EngineArgs

    os.environ["PAGEDRS_CPU_DECODE"] = "1" if fast else "0"
    torch.set_num_threads(threads)
    args = EngineArgs(
        model=folder,
        load_format="dummy",
        quantization="q8_0",
        skip_tokenizer_init=True,
        device="cpu",
        dtype="float32",
        disable_log_stats=True,
    )
    prompts = [[(7 * i + j) % 500 + 3 for j in range(24)] for i in range(batch)]

    def check(engine: Any) -> None:
        assert (engine.runner.model.model.cpu_decode is not None) == fast

    return decode_tok_s(args, prompts, tokens, check)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--json", default=str(Path(__file__).parent / "results" / "cpu_decode_gpt_oss.json"))
    add_commit_arg(p)
    args = p.parse_args(argv)
    results: dict[str, object] = {"threads": args.threads, "load_avg_1m": os.getloadavg()[0]}
    results.update(git_info(args.commit), machine=machine_info(), command=command_line())
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(Path(tmp) / "gpt_oss")
        _config(args.window).save_pretrained(folder)
        for batch in args.batch:
            runs: dict[str, list[float]] = {"fast": [], "modules": []}
            for _ in range(args.rounds):
                for name in runs:
                    runs[name].append(_tok_s(folder, name == "fast", batch, args.tokens, args.threads))
            fast, mods = statistics.median(runs["fast"]), statistics.median(runs["modules"])
            results[f"batch_{batch}"] = {**runs, "median_fast": fast, "median_modules": mods}
            print(
                f"batch {batch}: decode throughput: {fast:.1f} tok/s (CPU decode step) vs {mods:.1f} tok/s "
                f"(modules) = {fast / mods:.2f}x"
            )
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
