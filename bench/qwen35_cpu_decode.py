"""The CPU decode step of a quantized Qwen3.5-shaped model: the fast step (the layer description replayed on the
Rust ops, `models.cpu_decode`) against the torch modules, side by side on one engine.

    python bench/qwen35_cpu_decode.py --json bench/results/qwen35-cpu-decode.json
    python bench/qwen35_cpu_decode.py --quick        # a smoke test, not figures

A random Qwen3.5 text model (three Gated DeltaNet layers to one gated full-attention layer, `hybrid_prefix`'s
shape) quantized to Q8_0 at load. Per context length: one request with a prompt of that length (batch 1), then
15 more sharing it (prefix hits: batch 16); at each batch, decode steps alternate between the fast step and the
modules (`cpu_decode` unset) over the same sequences, and each side's median step time is reported with the
part spent in the linear-attention layers, which keep no per-token state and so should not grow with the
context. Prints one JSON line and a summary line per point.
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
from pathlib import Path
from typing import Any

import torch
from _common import add_commit_arg, command_line, git_info, json_safe, machine_info, write_json
from hybrid_prefix import make_model

from pagedrs import EngineArgs, LLMEngine, SamplingParams
from pagedrs.models.layer_desc import LinearAttention
from pagedrs.models.qwen3_5 import GatedDeltaNet


class LinearTimer:
    """Wall time spent in the linear-attention layers while `on`: their modules' forward (the module path) and
    the fast step's compiled steps of their `LinearAttention` ops, wrapped (no hooks: a hook would send the
    fast step through the module)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.on, self.total, self._inside = False, 0.0, False
        model: Any = engine.runner.model
        for m in model.modules():
            if isinstance(m, GatedDeltaNet):
                m.forward = self._timed(m.forward)  # type: ignore[method-assign]
        fast = model.model.cpu_decode
        for ops, steps in zip(fast.desc.layers, fast.layers, strict=True):
            for j, op in enumerate(ops):
                if isinstance(op, LinearAttention):
                    steps[j] = self._timed(steps[j])

    def _timed(self, fn: Any) -> Any:
        def run(*args: Any) -> Any:
            if not self.on or self._inside:
                return fn(*args)
            self._inside, t0 = True, time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.total += time.perf_counter() - t0
                self._inside = False

        return run


def make_engine(model: str, args: argparse.Namespace) -> LLMEngine:
    return LLMEngine.from_engine_args(
        EngineArgs(
            model=model,
            device="cpu",
            dtype="float32",
            quantization="q8_0",
            skip_tokenizer_init=True,
            enable_prefix_caching=True,
            max_num_seqs=max(args.batches),
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max(args.lengths) + 4 * args.decode_steps + 64,
            cpu_kv_cache_gb=args.kv_gib,
            disable_log_stats=True,
            seed=0,
        )
    )


def until_decoding(engine: LLMEngine, n: int) -> None:
    """Steps until every one of the `n` running requests has its first token (their prompts done)."""
    done: set[str] = set()
    while len(done) < n:
        for out in engine.step():
            if isinstance(out.outputs, list) and out.outputs and out.outputs[0].token_ids:
                done.add(out.request_id)


def timed_steps(engine: LLMEngine, timer: LinearTimer, steps: int) -> dict[str, float]:
    """Decode steps alternating the fast step and the modules: each side's median step and its median time in
    the linear-attention layers, in ms."""
    inner: Any = engine.runner.model.model
    fast = inner.cpu_decode
    times: dict[str, list[float]] = {"fast": [], "modules": [], "fast_linear": [], "modules_linear": []}
    for i in range(2 * steps):
        side = "fast" if i % 2 == 0 else "modules"
        inner.cpu_decode = fast if side == "fast" else None
        timer.on, timer.total = True, 0.0
        t0 = time.perf_counter()
        engine.step()
        times[side].append((time.perf_counter() - t0) * 1e3)
        timer.on = False
        times[side + "_linear"].append(timer.total * 1e3)
    inner.cpu_decode = fast
    out = {f"{k}_ms": statistics.median(v) for k, v in times.items()}
    out["speedup"] = out["modules_ms"] / out["fast_ms"]
    return out


def context(model: str, length: int, args: argparse.Namespace) -> dict[str, Any]:
    engine = make_engine(model, args)
    loaded: Any = engine.runner.model
    assert loaded.model.cpu_decode is not None, "the quantized model was meant to take the fast step"
    timer = LinearTimer(engine)
    rng = random.Random(length)
    prompt = [rng.randrange(args.vocab) for _ in range(length)]
    params = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
    points: dict[str, Any] = {}
    added = 0
    for batch in sorted(args.batches):
        for i in range(added, batch):  # the same prompt but its last token: prefix hits
            engine.add_request(f"r{i}", prompt[:-1] + [i % args.vocab], params)
        added = batch
        until_decoding(engine, batch)
        points[str(batch)] = timed_steps(engine, timer, args.decode_steps)
        p = points[str(batch)]
        print(
            f"context {length}, batch {batch}: decode step {p['fast_ms']:.2f} ms (fast step) vs "
            f"{p['modules_ms']:.2f} ms (modules) = {p['speedup']:.2f}x; linear-attention layers "
            f"{p['fast_linear_ms']:.2f} ms / {p['modules_linear_ms']:.2f} ms"
        )
    engine.shutdown()
    return points


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--decode-steps", type=int, default=10, help="timed steps per side and point")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-gib", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument(
        "--quick", action="store_true", help="tiny model, short contexts (a smoke test, not figures)"
    )
    p.add_argument("--json", default=None, help="write the figures here")
    add_commit_arg(p)
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.vocab, args.lengths = 64, 4, 256, [40, 80]
        args.batches, args.decode_steps, args.max_num_batched_tokens, args.kv_gib = [1, 3], 2, 64, 0.05
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_model(Path(tmp) / "qwen3_5", args))
        contexts = {str(n): context(model, n, args) for n in args.lengths}
    result: dict[str, Any] = {
        "bench": "qwen35_cpu_decode",
        "contexts": contexts,
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "commit")},
        "command": command_line(),
        "git": git_info(args.commit),
        "machine": machine_info(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    result["commit"] = result["git"]["commit"]
    print(json.dumps(json_safe(result)))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
