"""The output head and greedy sampler of a large vocabulary on the CPU, and decode steps, in one run.

    python bench/cpu_large_vocab.py --threads 1 --json bench/results/cpu-large-vocab.json
    python bench/cpu_large_vocab.py --threads 1 --engine default --engine /path/to/model.gguf

Head part: a tied GGUF table of random blocks (Q8_0 150k x 64, Q6_K 150k x 256, and Gemma 3 270M's
Q8_0 262144 x 640) held as the engine holds it (`QuantizedWeight`, which the tied lookup and the head
share): the bytes one token's head reads; the low time (`_common.low_time`) of the head at 1 and 16 rows
against torch's float32 GEMM over the dequantized table (what a dequantize-at-load head would run), and
of the greedy sampler without logprobs (`Sampler.greedy`: one fused argmax + logsumexp pass) against a
full log-softmax and a bare argmax; the largest logit difference to the float32 head, and the largest
logit. Engine part (`--engine`, repeatable; "default" is the default model): mean wall time of one greedy
`LLMEngine.step` of decodes at batch 1 and 16.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
from _common import add_commit_arg, command_line, git_info, low_time, machine_info, write_json

from pagedrs import EngineArgs, LLMEngine, SamplingParams
from pagedrs.layers import sampler as sampler_mod
from pagedrs.layers.quantized import QuantizedWeight
from pagedrs.layers.sampler import Sampler, apply_top_k_top_p
from pagedrs.quantization.gguf_blocks import GGUFWeight

if TYPE_CHECKING:
    import torch

# (type name, ggml type, vocab, hidden, block elements, block bytes, byte offset of its f16 scale); Gemma 3
# 270M's table is the last (hidden 640 is no multiple of a K-quant's 256, so llama.cpp stores it as Q8_0)
HEADS = [
    ("Q8_0", 8, 150_000, 64, 32, 34, 0),
    ("Q6_K", 14, 150_000, 256, 256, 210, 208),
    ("Q8_0", 8, 262_144, 640, 32, 34, 0),
]


def random_table(ggml_type: int, rows: int, cols: int, block: int, size: int, scale_at: int) -> GGUFWeight:
    """Random blocks with finite, moderate f16 scales (every weight dequantizes to a finite float)."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    scales = rng.uniform(0.002, 0.05, len(data)).astype(np.float16)
    data[:, scale_at : scale_at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return GGUFWeight(ggml_type, (rows, cols), data.reshape(rows, -1))


@contextlib.contextmanager
def sorting(on: bool) -> Iterator[None]:
    """Top-k with top-p through a sort of the whole vocabulary (the path before the windowed one)."""
    real = sampler_mod._top_k_then_top_p
    if on:
        sampler_mod._top_k_then_top_p = lambda *a: None
    try:
        yield
    finally:
        sampler_mod._top_k_then_top_p = real


def batch_figures(w: QuantizedWeight, dense: torch.Tensor, b: int, iters: int) -> dict[str, float]:
    """The head and the greedy sampler at `b` rows (suffix `_b{b}`)."""
    import torch  # after pagedrs, which sets the OpenMP spin count torch's libgomp reads when it loads

    x = torch.from_numpy(np.random.default_rng(b).standard_normal((b, w.in_features), dtype=np.float32))
    logits = w.matmul(x)
    ref = torch.nn.functional.linear(x, dense)
    figures = {
        "max_abs_diff": float((logits - ref).abs().max()),
        "max_abs_logit": float(ref.abs().max()),
        "head_ms": low_time(lambda: w.matmul(x), iters) * 1e3,
        "float32_head_ms": low_time(lambda: torch.nn.functional.linear(x, dense), iters) * 1e3,
        "greedy_sampler_ms": low_time(lambda: Sampler.greedy(logits, None), iters) * 1e3,
        "log_softmax_ms": low_time(lambda: logits.log_softmax(-1), iters) * 1e3,
        "argmax_ms": low_time(lambda: logits.argmax(-1), iters) * 1e3,
    }
    k, p = torch.full((b,), 40), torch.full((b,), 0.95)
    for name in ("window", "sorted"):
        with sorting(name == "sorted"):
            figures[f"top_k_top_p_{name}_ms"] = (
                low_time(lambda: apply_top_k_top_p(logits.clone(), k, p), iters) * 1e3
            )
    return {f"{k}_b{b}": v for k, v in figures.items()}


def head_figures(iters: int) -> list[dict[str, object]]:
    out = []
    for name, qt, vocab, hidden, block, size, scale_at in HEADS:
        w = QuantizedWeight([random_table(qt, vocab, hidden, block, size, scale_at)])
        dense = w.dequantized()
        row: dict[str, object] = {
            "type": name,
            "vocab": vocab,
            "hidden": hidden,
            "head_bytes_per_token": w.nbytes,
            "float32_bytes": dense.numel() * 4,
        }
        for b in (1, 16):
            row.update(batch_figures(w, dense, b, iters))
        print(row, flush=True)
        out.append(row)
    return out


def timed_steps(engine: LLMEngine, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps * 1e3


def engine_figures(model: str, steps: int) -> dict[str, float]:
    """Greedy decode steps at batch 1 and 16; sampled ones (temperature 0.8, top-k 40, top-p 0.95), the
    windowed top-p and the sorted one taking turns in blocks of steps / 4."""
    args = EngineArgs(disable_log_stats=True, cpu_kv_cache_gb=0.25)
    if model != "default":
        args = EngineArgs(model=model, disable_log_stats=True, cpu_kv_cache_gb=0.25)
    engine = LLMEngine.from_engine_args(args)
    figures: dict[str, float] = {}
    sampled = SamplingParams(
        temperature=0.8, top_k=40, top_p=0.95, seed=0, max_tokens=2 * steps + 10, ignore_eos=True
    )
    for batch in (1, 16):
        for kind, params in (
            ("greedy", SamplingParams(temperature=0, max_tokens=steps + 10, ignore_eos=True)),
            ("sampled", sampled),
        ):
            ids = [f"{kind}-{batch}-{i}" for i in range(batch)]
            for i, rid in enumerate(ids):
                engine.add_request(rid, [1, 2, 3, 4 + i, 5, 6, 7, 8], params.clone())
            for _ in range(5):  # prefill, warm-up
                engine.step()
            if kind == "greedy":
                figures[f"greedy_ms_per_step_b{batch}"] = timed_steps(engine, steps)
            else:
                times: dict[str, float] = {"window": 0.0, "sorted": 0.0}
                for _ in range(4):
                    for name in times:
                        with sorting(name == "sorted"):
                            times[name] += timed_steps(engine, steps // 4) / 4
                for name, ms in times.items():
                    figures[f"top_k_top_p_{name}_ms_per_step_b{batch}"] = ms
            engine.abort_request(ids)
            while engine.has_unfinished_requests():
                engine.step()
    print(model, figures, flush=True)
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--iters", type=int, default=15, help="timed calls per figure (head part)")
    p.add_argument("--engine", action="append", default=[], help='"default" or a model path; repeatable')
    p.add_argument("--steps", type=int, default=40, help="decode steps timed per batch (engine part)")
    p.add_argument("--json", default=None)
    add_commit_arg(p)
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    result = {
        "command": command_line(),
        "machine": machine_info(),
        **git_info(args.commit),
        "threads": args.threads,
        "heads": head_figures(args.iters),
        "engines": {m: engine_figures(m, args.steps) for m in args.engine},
    }
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
