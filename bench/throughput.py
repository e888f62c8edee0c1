"""Offline throughput: the same requests through pagedrs and through HF transformers `generate`.

    python bench/throughput.py                       # default model, CPU, 64 requests
    python bench/throughput.py --num-prompts 8 --json out.json

Requests: random token ids (fixed seed), input lengths uniform in --input-len, output lengths uniform in
--output-len, greedy, ignore_eos (every request produces exactly its output length). Systems, same dtype
and torch thread count: pagedrs (`LLMEngine`, continuous batching, paged KV cache); transformers one request
at a time; transformers statically batched (left padding, each batch runs to its longest output). Output
throughput counts the requested output tokens only. The KV view compares, over every pagedrs step, the KV
slots that step's requests hold (pagedrs: whole blocks; a contiguous cache: max_model_len per request) with
the slots they use (their lengths).

transformers runs in a process of its own (`--hf-only`, started by this script after it has released its
engine, requests and figures exchanged as JSON): on a GPU the engine keeps ~85% of the memory for its KV
pool. With --model-config that process builds its own random weights of the same shape. Baselines it has
not finished within --hf-timeout are missing from the JSON, hf_error says why, and the script exits 1.

Steps and the roofline: every engine step is timed (the wall time of its `step()` call) and classed, from
its plan, as prefill (no decode tokens), decode (decode tokens only) or mixed. Per class and end to end,
the measured time is set against the roofline, the sum over steps of max(bytes / HBM bandwidth, FLOPs /
dense bf16 peak), with bytes = weights + K/V read + K/V written and FLOPs = 2 x params x tokens +
attention (bench/_roofline.py).
The device figures come from torch.cuda.get_device_name() (H100 SXM 3.35 TB/s, H200 4.8 TB/s, 989 TFLOP/s);
--hbm-tbps / --peak-tflops replace them; without both (a CPU) the roofline fields are null. --step-timing
synchronises the device at each step boundary: exact per-step times, at the cost of the overlap an
unsynchronised run has (its end-to-end time is then not the headline one).

--passes N runs the workload N times, each pass with the same lengths and new prompt tokens (the same
prompts would hit the prefix cache): first_pass_vs_steady = time of pass 1 / mean time of the later passes.
The headline figures (throughput, steps, roofline) are pass 1's; every pass's are under "passes".

Tensor parallelism: --tensor-parallel-size N runs pagedrs over N ranks (worker processes; gloo on CPU,
NCCL on GPUs) and, in the same run, pagedrs on one rank, and prints the ratio. It needs --model (or the
default model): --model-config builds its weights in this process only.

GPU modes: --device cuda, --model-config llama-3.2-1b|llama-3-8b (random bf16 weights built on the device
from the config dicts below), --hf-cb (transformers' continuous batching manager besides static batching;
--hf-cb-attn "paged|sdpa" for transformers 5.17). The JSON records the commit: --commit, else
$PAGEDRS_COMMIT, else `git rev-parse HEAD`, else "unknown".
"""

from __future__ import annotations

# pagedrs before torch: importing it shortens libgomp's idle spin, which torch's import fixes for good
import pagedrs  # noqa: F401

# isort: split

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import add_commit_arg, command_line, git_info, machine_info, write_json
from _hf_baseline import hf_only, run_in_child
from _roofline import StepLoad, device_spec, headline, model_shape, pass_figures, report_lines, step_load

from pagedrs import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams

Requests = list[tuple[list[int], int]]

MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=128001,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    "llama-3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
        rope_parameters=dict(rope_type="default", rope_theta=500000.0),
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or GGUF file (default: the embedded SmolLM2)")
    p.add_argument(
        "--model-config",
        choices=sorted(MODEL_CONFIGS),
        default=None,
        help="random weights of this shape instead of --model",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--dtype",
        default=None,
        help="float32 (CPU default) | bfloat16 (CUDA default) | float16 | auto (pagedrs' own choice: the default "
        "GGUF kept quantized on a CPU; transformers then runs float32 / bfloat16)",
    )
    p.add_argument(
        "--quantization",
        default=None,
        help="pagedrs' quantization= (q8_0: a float checkpoint's weights quantized at load to Q8_0 for the CPU "
        "kernels; transformers keeps the float weights)",
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads for both systems (default: torch's)"
    )
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cpu-kv-cache-gb", type=float, default=2.0, help="KV pool on CPU, GiB")
    p.add_argument(
        "--passes",
        type=int,
        default=1,
        help="run the workload this many times, new prompt tokens each pass (first_pass_vs_steady)",
    )
    p.add_argument(
        "--step-timing",
        action="store_true",
        help="synchronise the device at every step boundary (exact per-step times; changes the run)",
    )
    p.add_argument("--hbm-tbps", type=float, default=None, help="HBM bandwidth, TB/s (default: by device)")
    p.add_argument(
        "--peak-tflops", type=float, default=None, help="dense bf16 peak, TFLOP/s (default: by device)"
    )
    p.add_argument(
        "--hf-batch-size", type=int, default=None, help="static batch size (default: all requests)"
    )
    p.add_argument(
        "--hf-sequential-limit",
        type=int,
        default=None,
        help="time transformers one-at-a-time on the first N requests only (a rate estimate)",
    )
    p.add_argument("--skip-hf", action="store_true", help="pagedrs only")
    p.add_argument("--hf-cb", action="store_true", help="also transformers' continuous batching")
    p.add_argument(
        "--hf-cb-attn", default=None, help='attention implementation for --hf-cb (e.g. "paged|sdpa")'
    )
    p.add_argument(
        "--hf-timeout", type=float, default=7200.0, help="seconds the transformers process may take"
    )
    p.add_argument("--hf-only", nargs=2, default=None, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    p.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks for pagedrs; > 1 also runs one rank on the same requests for the ratio",
    )
    p.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default=None)
    p.add_argument(
        "--structured",
        choices=["json"],
        default=None,
        help="also run every request with a JSON schema (structured outputs) and report the ratio",
    )
    p.add_argument(
        "--task",
        choices=["generate", "embed"],
        default="generate",
        help="embed: prompts/s of embeddings (last-token pooling) vs HF AutoModel batched forward",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["fp8", "fp8_e4m3", "fp8_e5m2"],
        default=None,
        help="also run pagedrs with this KV cache dtype (same weights, same memory budget) and print "
        "its KV blocks, throughput and greedy-token agreement against the model-dtype cache",
    )
    p.add_argument("--json", default=None, metavar="PATH")
    add_commit_arg(p)
    args = p.parse_args(argv)
    if args.passes < 1:
        p.error("--passes must be >= 1")
    return args


def _allowed_tokens(vocab_size: int, special: set[int]) -> np.ndarray:
    return np.array([t for t in range(min(vocab_size, 32000)) if t not in special], dtype=np.int64)


def make_requests(args: argparse.Namespace, vocab_size: int, special: set[int]) -> Requests:
    rng = np.random.default_rng(args.seed)
    allowed = _allowed_tokens(vocab_size, special)
    reqs = []
    for _ in range(args.num_prompts):
        n_in = int(rng.integers(args.input_len[0], args.input_len[1] + 1))
        n_out = int(rng.integers(args.output_len[0], args.output_len[1] + 1))
        reqs.append((rng.choice(allowed, size=n_in).tolist(), n_out))
    return reqs


def new_prompts(reqs: Requests, vocab_size: int, special: set[int], seed: int, k: int) -> Requests:
    """reqs with the same input and output lengths and new prompt tokens (pass k of --passes)."""
    rng = np.random.default_rng([seed, k])
    allowed = _allowed_tokens(vocab_size, special)
    return [(rng.choice(allowed, size=len(ids)).tolist(), n) for ids, n in reqs]


def engine_args(args: argparse.Namespace, dtype: torch.dtype, max_len: int, **extra: Any) -> EngineArgs:
    """The pagedrs settings every run of this benchmark shares (`--dtype auto`: the engine's own default,
    e.g. a GGUF kept quantized on a CPU, while transformers runs `dtype`)."""
    return EngineArgs(
        model=args.model,
        dtype="auto" if args.dtype == "auto" else str(dtype).removeprefix("torch."),
        device=args.device,
        max_model_len=max_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        disable_log_stats=True,
        cpu_kv_cache_gb=None if args.device == "cuda" else args.cpu_kv_cache_gb,
        gpu_memory_utilization=0.85,
        quantization=args.quantization,
        **extra,
    )


def save_json(path: str, result: dict[str, Any], commit: str | None) -> None:
    """The figures, with the command, the commit and the machine that gave them."""
    git = git_info(commit)
    write_json(
        path,
        {**result, "commit": git["commit"], "command": command_line(), "git": git, "machine": machine_info()},
    )


def load_engine(args: argparse.Namespace, dtype: torch.dtype, max_len: int) -> tuple[LLMEngine, Any]:
    """The pagedrs engine and its loaded model (for a second engine over the same weights)."""
    import transformers

    from pagedrs.loader import LoadedModel, load_model

    device = torch.device(args.device)
    eng_args = engine_args(args, dtype, max_len)
    if args.model_config:  # random weights: HF's initialisation, copied into pagedrs' model, then freed
        from pagedrs.models.registry import get_model_class

        cfg = transformers.LlamaConfig(**MODEL_CONFIGS[args.model_config], architectures=["LlamaForCausalLM"])
        torch.manual_seed(args.seed)
        with torch.device(device):
            hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
            net = get_model_class(cfg)(cfg, dtype=dtype, device=device)
        net.load_weights((k, v) for k, v in hf.state_dict().items())
        del hf
        release_memory()
        loaded = LoadedModel(model=net.eval(), hf_config=cfg, tokenizer=None, model_path=args.model_config)
        eng_args.model = args.model_config
    else:
        loaded = load_model(
            args.model,
            dtype="auto" if args.dtype == "auto" else dtype,
            device=device,
            opts=eng_args.load_options(),
        )
    config = eng_args.create_engine_config(max_len)
    return LLMEngine(config, loaded, max_logprobs=0), loaded


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def tp_engine(args: argparse.Namespace, dtype: torch.dtype, max_len: int) -> LLMEngine:
    """pagedrs over --tensor-parallel-size ranks (each rank loads its own shard)."""
    if args.model_config:
        raise SystemExit(
            "--tensor-parallel-size > 1 needs --model (--model-config weights live in this process)"
        )
    return LLMEngine.from_engine_args(
        engine_args(
            args,
            dtype,
            max_len,
            tensor_parallel_size=args.tensor_parallel_size,
            distributed_executor_backend=args.distributed_executor_backend,
        )
    )


def run_pagedrs(engine: LLMEngine, reqs: Requests, *, step_timing: bool = False) -> dict[str, Any]:
    """All of reqs through the engine. Besides throughput: the KV slots used and reserved over the steps,
    and every step's load (from its plan) with its wall time. step_timing: synchronise the device at each
    step boundary; otherwise a step's time ends when step() returns (a step that samples has waited for
    the device to copy its tokens; one that only prefills a chunk may return before the device is done)."""
    kv = {"used": 0, "paged": 0, "contiguous": 0}
    block_size = engine.config.cache.block_size
    executor = engine.engine_core.executor
    inner = executor.execute
    loads: list[StepLoad] = []

    def execute(plan: Any, *a: Any, **kw: Any) -> Any:
        out = inner(plan, *a, **kw)
        kv["used"] += int(plan.seq_lens.sum())
        kv["contiguous"] += len(plan.req_ids) * engine.max_model_len
        loads.append(
            step_load(
                plan.num_computed_tokens.tolist(),
                plan.num_scheduled_tokens.tolist(),
                len(plan.sampled_seq_ids),
                int(plan.num_prefill_tokens),
                int(plan.num_decode_tokens),
            )
        )
        return out

    executor.execute = execute  # type: ignore[method-assign]
    for i, (ids, n) in enumerate(reqs):
        engine.add_request(
            str(i),
            ids,
            SamplingParams(
                temperature=0.0, max_tokens=n, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
            ),
        )
    sync = step_timing and engine.device.type == "cuda"
    total = 0
    ids: dict[int, list[int]] = {}
    steps: list[tuple[StepLoad, float]] = []
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            outs = engine.step()
            if sync:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            steps.extend((load, seconds) for load in loads)  # one plan per step; none if nothing ran
            loads.clear()
            for out in outs:
                total += len(out.outputs[0].token_ids)
                ids[int(out.request_id)] = list(out.outputs[0].token_ids)
            s = engine.scheduler.stats()
            kv["paged"] += (int(s.num_blocks) - int(s.num_free_blocks)) * block_size
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    finally:
        executor.execute = inner  # type: ignore[method-assign]
    out_ids = [ids[i] for i in sorted(ids)]
    stats = engine.get_stats()
    return {
        "tokens": total,
        "seconds": elapsed,
        "tok_s": total / elapsed,
        "stats": stats,
        "ids": out_ids,
        "steps": steps,
        **kv,
    }


BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                },
                "required": ["name", "qty"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 40,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


def run_generate(engine: LLMEngine, reqs: list[tuple[list[int], int]], structured: bool) -> dict[str, Any]:
    """Greedy. Structured: a JSON schema on every request, each stops where its grammar ends (or at its
    length). Plain: exactly the lengths given, ignore_eos, so both runs have the same batches."""
    from pagedrs.structured_outputs import StructuredOutputsParams

    so = StructuredOutputsParams(json=BENCH_SCHEMA) if structured else None
    for i, (ids, n) in enumerate(reqs):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=n,
            ignore_eos=not structured,
            structured_outputs=so,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        engine.add_request(f"{'s' if structured else 'p'}{i}", {"prompt_token_ids": ids}, params)
    lengths: dict[int, int] = {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            lengths[int(out.request_id[1:])] = len(out.outputs[0].token_ids)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    total = sum(lengths.values())
    return {"tokens": total, "seconds": elapsed, "tok_s": total / elapsed, "lengths": lengths}


def run_embed_pagedrs(engine: LLMEngine, reqs: list[tuple[list[int], int]]) -> dict[str, float]:
    from pagedrs import PoolingParams

    for i, (ids, _) in enumerate(reqs):
        engine.add_request(f"e{i}", {"prompt_token_ids": ids}, PoolingParams())
    done, t0 = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        done += len(engine.step())
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return {"prompts": done, "seconds": elapsed, "prompts_s": done / elapsed}


def line(a: float, b: float, what: str) -> str:
    return (
        f"output throughput: {a:.1f} tok/s (pagedrs) vs {b:.1f} tok/s (transformers {what}) = {a / b:.2f} x"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.hf_only:  # the child process of run_in_child
        hf_only(args, MODEL_CONFIGS[args.model_config] if args.model_config else None, *args.hf_only)
        return {}
    dtype_name = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    # auto: pagedrs picks (a GGUF stays quantized on a CPU); transformers gets the float dtype it would
    dtype = getattr(
        torch, ("bfloat16" if args.device == "cuda" else "float32") if dtype_name == "auto" else dtype_name
    )
    max_len = args.input_len[1] + args.output_len[1]
    engine, loaded = load_engine(args, dtype, max_len)
    special = set(engine.eos_token_ids)
    tok = engine.get_tokenizer()
    if tok is not None:
        special |= set(getattr(tok, "all_special_ids", []))
    reqs = make_requests(args, engine.vocab_size, special)
    pad_id = min((t for t in special if t < engine.vocab_size), default=0)
    n_in = sum(len(r[0]) for r in reqs)
    n_out = sum(r[1] for r in reqs)
    print(
        f"model={engine.model_name} device={args.device} dtype={dtype_name} threads={torch.get_num_threads()} "
        f"requests={len(reqs)} input tokens={n_in} output tokens={n_out} max_model_len={max_len}"
    )
    if args.task == "embed":
        del loaded  # embed_main releases the engine, and with it the weights, before transformers runs
        return embed_main(args, argv, engine, reqs, pad_id, dtype_name)
    run_pagedrs(engine, [(reqs[0][0][:16][::-1], 4)])  # warm-up (one-time kernel and allocator setup)
    result: dict[str, Any] = {
        "model": engine.model_name,
        "device": args.device,
        "dtype": dtype_name,
        "threads": torch.get_num_threads(),
        "num_prompts": len(reqs),
        "input_tokens": n_in,
        "output_tokens": n_out,
    }
    runs = [run_pagedrs(engine, reqs, step_timing=args.step_timing)]
    for k in range(1, args.passes):
        runs.append(
            run_pagedrs(
                engine,
                new_prompts(reqs, engine.vocab_size, special, args.seed, k),
                step_timing=args.step_timing,
            )
        )
    pg = runs[0]
    assert all(r["tokens"] == n_out for r in runs), ([r["tokens"] for r in runs], n_out)
    result["pagedrs_tok_s"] = pg["tok_s"]
    result["pagedrs_seconds"] = pg["seconds"]
    result["num_preemptions"] = pg["stats"].num_preemptions
    print(
        f"pagedrs: {pg['tokens']} tokens in {pg['seconds']:.1f} s = {pg['tok_s']:.1f} tok/s "
        f"({pg['stats'].num_steps} steps, {pg['stats'].num_preemptions} preemptions)"
    )
    result["kv_waste_pct_paged"] = 100.0 * (1 - pg["used"] / pg["paged"])
    result["kv_waste_pct_contiguous"] = 100.0 * (1 - pg["used"] / pg["contiguous"])
    print(
        f"KV slots over all steps: used {pg['used']}, reserved by pagedrs blocks {pg['paged']} "
        f"(waste {result['kv_waste_pct_paged']:.1f}%), by a contiguous max_model_len cache "
        f"{pg['contiguous']} (waste {result['kv_waste_pct_contiguous']:.1f}%)"
    )
    result.update(roofline_report(args, engine, runs))
    if args.structured:
        run_generate(engine, reqs[:2], structured=True)  # warm-up: the grammar compiler and its cache
        constrained = run_generate(engine, reqs, structured=True)
        same = [(ids, constrained["lengths"][i]) for i, (ids, _) in enumerate(reqs)]
        plain = run_generate(engine, same, structured=False)
        ratio = constrained["tok_s"] / plain["tok_s"]
        result.update(
            structured=args.structured,
            plain_eos_tok_s=plain["tok_s"],
            structured_tok_s=constrained["tok_s"],
            structured_vs_plain=ratio,
        )
        print(
            f"output throughput: {constrained['tok_s']:.1f} tok/s (pagedrs, JSON schema on every request) vs "
            f"{plain['tok_s']:.1f} tok/s (pagedrs, no constraint) = {ratio:.2f} x "
            f"({constrained['tokens']} tokens each: the plain run has the structured run's lengths)"
        )
    if args.kv_cache_dtype:
        result.update(kv_cache_vs_model_dtype(args, engine, loaded, reqs, pg, dtype, max_len))
    engine.shutdown()  # the weights and the KV pool go before the other engines and transformers start
    del engine, loaded, runs, pg
    release_memory()
    if args.tensor_parallel_size > 1:
        result.update(tensor_parallel(args, dtype, max_len, reqs, result["pagedrs_tok_s"]))
    if not args.skip_hf:
        result.update(hf_baselines(args, argv, reqs, pad_id, result["pagedrs_tok_s"]))
    if args.json:
        save_json(args.json, result, args.commit)
    if "hf_error" in result:
        raise SystemExit(f"transformers baseline failed: {result['hf_error']}")
    return result


def roofline_report(
    args: argparse.Namespace, engine: LLMEngine, runs: list[dict[str, Any]]
) -> dict[str, Any]:
    """Per step class and end to end, measured against the roofline (pass 1), and every pass's times."""
    name = torch.cuda.get_device_name() if engine.device.type == "cuda" else str(engine.device)
    spec = device_spec(name, args.hbm_tbps, args.peak_tflops)
    shape = model_shape(engine.model, engine.hf_config, engine.runner.bytes_per_block // args.block_size)
    synced = args.step_timing and engine.device.type == "cuda"
    passes = [pass_figures(r["tokens"], r["seconds"], r["steps"], shape, spec) for r in runs]
    for text in report_lines(passes, spec, synced):
        print(text)
    return {
        "device_name": name,
        "hbm_tbps": spec.hbm_tbps,
        "peak_tflops": spec.peak_tflops,
        "step_timing_synchronized": synced,
        "model_shape": shape.as_dict(),
        **headline(passes),
    }


def tensor_parallel(
    args: argparse.Namespace, dtype: torch.dtype, max_len: int, reqs: Requests, one_rank_tok_s: float
) -> dict[str, Any]:
    tp = tp_engine(args, dtype, max_len)
    try:
        run_pagedrs(tp, [(reqs[0][0][:16][::-1], 4)])
        res = run_pagedrs(tp, reqs)
    finally:
        tp.shutdown()
    n_out = sum(r[1] for r in reqs)
    assert res["tokens"] == n_out, (res["tokens"], n_out)
    n = args.tensor_parallel_size
    print(
        f"output throughput: {res['tok_s']:.1f} tok/s (pagedrs TP={n}) vs {one_rank_tok_s:.1f} tok/s "
        f"(pagedrs TP=1) = {res['tok_s'] / one_rank_tok_s:.2f} x"
    )
    return {
        "tensor_parallel_size": n,
        "pagedrs_tp_tok_s": res["tok_s"],
        "tp_vs_one_rank": res["tok_s"] / one_rank_tok_s,
    }


def hf_baselines(
    args: argparse.Namespace, argv: list[str], reqs: Requests, pad_id: int, pagedrs_tok_s: float
) -> dict[str, Any]:
    """transformers' figures from a process of its own (after this one released its engine); those that
    finished, and hf_error if it failed."""
    if torch.cuda.is_available() and args.device == "cuda":
        held = torch.cuda.memory_reserved() / 2**30
        print(f"device memory this process still holds while transformers runs: {held:.2f} GiB")
    hf = run_in_child(Path(__file__).resolve(), argv, reqs, pad_id, args.hf_timeout)
    out: dict[str, Any] = {}
    if "error" in hf:
        print(f"transformers: {hf['error']}", file=sys.stderr)
        out["hf_error"] = hf["error"]
    if "cb" in hf:
        out["hf_cb_tok_s"] = hf["cb"]["tok_s"]
        out["throughput_vs_hf_cb"] = pagedrs_tok_s / hf["cb"]["tok_s"]
        print(line(pagedrs_tok_s, hf["cb"]["tok_s"], "continuous batching"))
    if "static" in hf:
        st = hf["static"]
        out |= {
            "hf_static_tok_s": st["tok_s"],
            "hf_static_batch_size": st["batch_size"],
            "speedup_vs_static": pagedrs_tok_s / st["tok_s"],
        }
        print(
            f"transformers static batch of {st['batch_size']}: {st['tokens']} tokens in {st['seconds']:.1f} s"
        )
        print(line(pagedrs_tok_s, st["tok_s"], f"static batch {st['batch_size']}"))
    if "sequential" in hf:
        sq = hf["sequential"]
        out |= {
            "hf_sequential_tok_s": sq["tok_s"],
            "hf_sequential_requests": sq["requests"],
            "speedup_vs_sequential": pagedrs_tok_s / sq["tok_s"],
        }
        print(
            f"transformers one-at-a-time: {sq['tokens']} tokens in {sq['seconds']:.1f} s "
            f"({sq['requests']} requests)"
        )
        print(line(pagedrs_tok_s, sq["tok_s"], "one-at-a-time"))
    return out


def kv_cache_vs_model_dtype(
    args: argparse.Namespace,
    engine: LLMEngine,
    loaded: Any,
    reqs: list[tuple[list[int], int]],
    pg: dict[str, Any],
    dtype: torch.dtype,
    max_len: int,
) -> dict[str, Any]:
    """The same requests through a second engine over the same weights whose KV cache is
    --kv-cache-dtype, in the same memory budget: blocks, throughput, greedy tokens equal to the first run."""
    cfg = engine_args(args, dtype, max_len, kv_cache_dtype=args.kv_cache_dtype).create_engine_config(max_len)
    other = LLMEngine(cfg, loaded, max_logprobs=0)
    try:
        run_pagedrs(other, [(reqs[0][0][:16][::-1], 4)])
        res = run_pagedrs(other, reqs)
        blocks = (engine.get_stats().num_blocks, other.get_stats().num_blocks)
    finally:
        other.shutdown()
    same = sum(a == b for x, y in zip(pg["ids"], res["ids"], strict=True) for a, b in zip(x, y, strict=True))
    # tokens up to each request's first difference: after it the contexts differ, so later ones are moot
    prefix = 0
    for x, y in zip(pg["ids"], res["ids"], strict=True):
        k = next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
        prefix += k
    n = sum(len(x) for x in pg["ids"])
    print(
        f"KV cache {args.kv_cache_dtype}: {blocks[1]} blocks vs {blocks[0]} ({blocks[1] / blocks[0]:.2f} x) in the "
        f"same memory; {res['tok_s']:.1f} tok/s vs {pg['tok_s']:.1f} tok/s = {res['tok_s'] / pg['tok_s']:.2f} x; "
        f"greedy tokens equal to the {dtype} cache's: {same}/{n} ({100 * same / n:.1f}%), "
        f"before each request's first difference: {prefix}/{n} ({100 * prefix / n:.1f}%)"
    )
    return {
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_blocks_model_dtype": blocks[0],
        "kv_blocks_cache_dtype": blocks[1],
        "kv_cache_tok_s": res["tok_s"],
        "kv_cache_vs_model_dtype_tok_s": res["tok_s"] / pg["tok_s"],
        "kv_cache_equal_tokens_pct": 100 * same / n,
        "kv_cache_prefix_tokens_pct": 100 * prefix / n,
    }


def embed_main(
    args: argparse.Namespace,
    argv: list[str],
    engine: LLMEngine,
    reqs: Requests,
    pad_id: int,
    dtype: str,
) -> dict[str, Any]:
    run_embed_pagedrs(engine, reqs[:2])  # warm-up
    pg = run_embed_pagedrs(engine, reqs)
    engine.shutdown()
    release_memory()
    hf = run_in_child(Path(__file__).resolve(), argv, reqs, pad_id, args.hf_timeout)
    if "error" in hf:
        raise SystemExit(f"transformers baseline failed: {hf['error']}")
    st = hf["embed"]
    bs = st["batch_size"]
    ratio = pg["prompts_s"] / st["prompts_s"]
    print(
        f"embedding throughput: {pg['prompts_s']:.1f} prompts/s (pagedrs) vs {st['prompts_s']:.1f} prompts/s "
        f"(transformers AutoModel, batches of {bs}) = {ratio:.2f} x"
    )
    result: dict[str, Any] = {
        "task": "embed",
        "model": engine.model_name,
        "device": args.device,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "num_prompts": len(reqs),
        "input_tokens": sum(len(r[0]) for r in reqs),
        "pagedrs_prompts_s": pg["prompts_s"],
        "hf_prompts_s": st["prompts_s"],
        "hf_batch_size": bs,
        "speedup_vs_hf": ratio,
    }
    if args.json:
        save_json(args.json, result, args.commit)
    return result


if __name__ == "__main__":
    main()
