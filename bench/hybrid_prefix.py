"""Prefix caching of a Gated DeltaNet hybrid (Qwen3.5): a cached turn against the same turn cold.

    python bench/hybrid_prefix.py --json bench/results/hybrid-prefix-cpu.json
    python bench/hybrid_prefix.py --quick        # a smoke test, not figures

On a Qwen3.5-shaped random model (three Gated DeltaNet layers to one gated full-attention layer, built here
unless `--model` names one), one session per context length: a first turn of `length - turn_len` tokens,
then the turn that adds `turn_len` new tokens. The second turn's TTFT with the prefix cache (the KV blocks and
the recurrent state snapshot at the last shared block boundary) is set against the same prompt on an engine
without prefix caching (a full re-prefill). Also per length: the decode step time at that context (batch 1)
and the part of it spent in the linear-attention layers, which holds no per-token state and so should not grow
with the context; the bytes a state snapshot costs per 1k cached tokens beside the full-attention KV's.
Prints one JSON line.
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
import transformers
from _common import add_commit_arg, command_line, git_info, json_safe, machine_info, write_json

from pagedrs import EngineArgs, LLMEngine, SamplingParams


def make_model(path: Path, args: argparse.Namespace) -> Path:
    """A random Qwen3.5 text model of the bench's shape, saved in `path`."""
    layers = args.layers
    config = transformers.Qwen3_5TextConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64,
        intermediate_size=args.hidden * 3,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=max(1, args.hidden // 128),
        linear_num_value_heads=max(1, args.hidden // 64),
        linear_conv_kernel_dim=4,
        max_position_embeddings=max(args.lengths) * 2,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(path))
    return path


def make_engine(model: str, args: argparse.Namespace, cache: bool) -> LLMEngine:
    return LLMEngine.from_engine_args(
        EngineArgs(
            model=model,
            device="cpu",
            dtype="float32",
            skip_tokenizer_init=True,
            enable_prefix_caching=cache,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max(args.lengths) * 2,
            cpu_kv_cache_gb=args.kv_gib,
            disable_log_stats=True,
            seed=0,
        )
    )


class LinearTimer:
    """Wall time spent in the model's linear-attention (Gated DeltaNet) layers while `on`."""

    def __init__(self, engine: LLMEngine) -> None:
        self.on, self.total, self._t0 = False, 0.0, 0.0
        self.layers = [m for m in engine.runner.model.modules() if type(m).__name__ == "GatedDeltaNet"]
        for m in self.layers:
            m.register_forward_pre_hook(self._pre)
            m.register_forward_hook(self._post)

    def _pre(self, *_: Any) -> None:
        if self.on:
            self._t0 = time.perf_counter()

    def _post(self, *_: Any) -> None:
        if self.on:
            self.total += time.perf_counter() - self._t0


def run_turn(
    engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int
) -> tuple[float, list[float], Any]:
    """(TTFT s, each later step's seconds, final output) of one request run alone."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(rid, prompt, params)
    ttft, steps, final = None, [], None
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        if ttft is not None:
            steps.append(time.perf_counter() - t0)
        for out in outs:
            if ttft is None and out.outputs and out.outputs[0].token_ids:
                ttft = time.perf_counter() - start
            if out.finished:
                final = out
    assert ttft is not None and final is not None
    return ttft, steps, final


def session(
    cached: LLMEngine, cold: LLMEngine, timer: LinearTimer, length: int, args: argparse.Namespace
) -> dict:
    rng = random.Random(length)
    first = [rng.randrange(args.vocab) for _ in range(length - args.turn_len - args.output_len)]
    _, _, out = run_turn(cached, f"a{length}", first, args.output_len)
    prompt = (
        first + list(out.outputs[0].token_ids) + [rng.randrange(args.vocab) for _ in range(args.turn_len)]
    )
    hit_ttft, _, hit = run_turn(cached, f"b{length}", prompt, 1)
    cold_ttft, _, _ = run_turn(cold, f"c{length}", prompt, 1)
    # decode at this context, batch 1: a third turn that extends the second by one token (a prefix hit)
    timer.on, timer.total = True, 0.0
    _, steps, _ = run_turn(cached, f"d{length}", prompt + [1], args.decode_steps + 1)
    timer.on = False
    return {
        "prompt_tokens": len(prompt),
        "cached_tokens": hit.num_cached_tokens,
        "ttft_cached_s": hit_ttft,
        "ttft_cold_s": cold_ttft,
        "ttft_ratio": hit_ttft / cold_ttft,
        "decode_step_ms": statistics.median(steps) * 1e3,
        "decode_linear_layers_ms": timer.total / (len(steps) + 1) * 1e3,
    }


def memory(engine: LLMEngine) -> dict[str, Any]:
    """A state snapshot's bytes (one per cached block boundary, at most `max_num_seqs` kept) against the
    full-attention layers' KV bytes, per 1k cached tokens."""
    model: Any = engine.runner.model
    block = engine.config.cache.block_size
    seqs = engine.config.scheduler.max_num_seqs
    snap = int(model.recurrent_shape.bytes_per_slot)
    cfg = model.config
    full = sum(t == "full_attention" for t in cfg.layer_types)
    kv_per_token = full * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    return {
        "block_size": block,
        "snapshot_bytes": snap,
        "snapshot_bytes_per_1k_tokens": snap * 1000 / block,
        "snapshot_pool_slots": seqs,
        "snapshot_pool_bytes": snap * seqs,
        "full_attention_kv_bytes_per_1k_tokens": kv_per_token * 1000,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default=None, help="a Qwen3.5 model path (default: a random one of the shape below)"
    )
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--turn-len", type=int, default=64, help="new tokens of the cached turn")
    p.add_argument("--output-len", type=int, default=16, help="tokens the first turn generates")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-gib", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument(
        "--quick", action="store_true", help="tiny model, short sessions (a smoke test, not figures)"
    )
    p.add_argument("--json", default=None, help="write the figures here")
    add_commit_arg(p)
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.vocab, args.lengths = 64, 4, 256, [48, 80]
        args.turn_len, args.output_len, args.decode_steps, args.max_num_batched_tokens = 8, 4, 2, 32
        args.kv_gib = 0.05
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_model(Path(tmp) / "qwen3_5", args))
        cached, cold = make_engine(model, args, True), make_engine(model, args, False)
        for engine in (cached, cold):  # warm-up
            run_turn(engine, "warm", [1, 2, 3, 4, 5, 6, 7, 8], 2)
        timer = LinearTimer(cached)
        sessions = {str(n): session(cached, cold, timer, n, args) for n in args.lengths}
        mem = memory(cached)
        cached.shutdown()
        cold.shutdown()
    result: dict[str, Any] = {
        "bench": "hybrid_prefix",
        "sessions": sessions,
        "memory": mem,
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
