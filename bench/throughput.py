"""Offline throughput: the same requests through pagedrs and through HF transformers `generate`, one run.

    python bench/throughput.py                       # default model, CPU, 64 requests
    python bench/throughput.py --num-prompts 8 --json out.json

Requests: random token ids (fixed seed), input lengths uniform in --input-len, output lengths uniform in
--output-len, greedy, ignore_eos (every request produces exactly its output length). Systems, same dtype
and torch thread count: pagedrs (`LLMEngine`, continuous batching, paged KV cache); transformers one request
at a time; transformers statically batched (left padding, each batch runs to its longest output). Output
throughput counts the requested output tokens only. The KV view compares, over every pagedrs step, the KV
slots that step's requests hold (pagedrs: whole blocks; a contiguous cache: max_model_len per request) with
the slots they use (their lengths).

Tensor parallelism: --tensor-parallel-size N runs pagedrs over N ranks (worker processes; gloo on CPU,
NCCL on GPUs) and, in the same run, pagedrs on one rank, and prints the ratio. It needs --model (or the
default model): --model-config builds its weights in this process only.

GPU modes (UNTESTED here: no GPU on the machine this was written on): --device cuda, --model-config
llama-3.2-1b|llama-3-8b (random bf16 weights built on the device from the config dicts below, shared by both
systems), --hf-cb (transformers' continuous batching manager instead of static batching).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from pagedrs import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams  # noqa: E402

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
        help="random weights of this shape instead of --model (GPU issue; untested)",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="float32 (CPU default) | bfloat16 (CUDA default) | float16")
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
    p.add_argument("--hf-cb", action="store_true", help="transformers continuous batching (untested)")
    p.add_argument(
        "--kv-cache-dtype",
        choices=["fp8", "fp8_e4m3", "fp8_e5m2"],
        default=None,
        help="also run pagedrs with this KV cache dtype (same weights, same memory budget) and print "
        "its KV blocks, throughput and greedy-token agreement against the model-dtype cache",
    )
    p.add_argument("--json", default=None, metavar="PATH")
    return p.parse_args(argv)


def make_requests(
    args: argparse.Namespace, vocab_size: int, special: set[int]
) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(args.seed)
    allowed = np.array([t for t in range(min(vocab_size, 32000)) if t not in special], dtype=np.int64)
    reqs = []
    for _ in range(args.num_prompts):
        n_in = int(rng.integers(args.input_len[0], args.input_len[1] + 1))
        n_out = int(rng.integers(args.output_len[0], args.output_len[1] + 1))
        reqs.append((rng.choice(allowed, size=n_in).tolist(), n_out))
    return reqs


def engine_args(args: argparse.Namespace, dtype: torch.dtype, max_len: int, **extra: Any) -> EngineArgs:
    """The pagedrs settings every run of this benchmark shares."""
    return EngineArgs(
        model=args.model,
        dtype=str(dtype).removeprefix("torch."),
        device=args.device,
        max_model_len=max_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        disable_log_stats=True,
        cpu_kv_cache_gb=None if args.device == "cuda" else 2.0,
        gpu_memory_utilization=0.85,
        **extra,
    )


def write_json(path: str, result: dict[str, Any]) -> None:
    """The figures, with the command, the commit and the machine that gave them."""
    from serving import git_info, machine_info  # bench/serving.py: provenance helpers

    out = {k: v for k, v in result.items() if _jsonable(v)}
    out["command"] = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    out["git"] = git_info()
    out["machine"] = machine_info()
    Path(path).write_text(json.dumps(out, indent=2))


def load_models(args: argparse.Namespace, dtype: torch.dtype, max_len: int) -> tuple[LLMEngine, Any, Any]:
    """The pagedrs engine and the HF model, holding the same weights, and the loaded model (for a second
    engine over the same weights)."""
    import transformers

    from pagedrs.loader import LoadedModel, load_model, model_folder, resolve_model_path

    device = torch.device(args.device)
    eng_args = engine_args(args, dtype, max_len)
    if args.model_config:  # random weights, built once on the device and copied into pagedrs' model
        from pagedrs.models.registry import get_model_class

        cfg = transformers.LlamaConfig(**MODEL_CONFIGS[args.model_config], architectures=["LlamaForCausalLM"])
        with torch.device(device):
            hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
            net = get_model_class(cfg)(cfg, dtype=dtype, device=device)
        net.load_weights((k, v) for k, v in hf.state_dict().items())
        loaded = LoadedModel(model=net.eval(), hf_config=cfg, tokenizer=None, model_path=args.model_config)
        eng_args.model = args.model_config
    else:
        loaded = load_model(args.model, dtype=dtype, device=device)
        folder = model_folder(resolve_model_path(args.model))  # the GGUF default: its converted HF folder
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    config = eng_args.create_engine_config(max_len)
    return LLMEngine(config, loaded, max_logprobs=0), hf, loaded


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


def run_pagedrs(engine: LLMEngine, reqs: list[tuple[list[int], int]]) -> dict[str, float]:
    kv = {"used": 0, "paged": 0, "contiguous": 0}
    block_size = engine.config.cache.block_size
    executor = engine.engine_core.executor
    inner = executor.execute

    def execute(plan: Any, *a: Any, **kw: Any) -> Any:
        out = inner(plan, *a, **kw)
        kv["used"] += int(plan.seq_lens.sum())
        kv["contiguous"] += len(plan.req_ids) * engine.max_model_len
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
    total = 0
    ids: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            total += len(out.outputs[0].token_ids)
            ids[int(out.request_id)] = list(out.outputs[0].token_ids)
        s = engine.scheduler.stats()
        kv["paged"] += (int(s.num_blocks) - int(s.num_free_blocks)) * block_size
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    executor.execute = inner  # type: ignore[method-assign]
    out_ids = [ids[i] for i in sorted(ids)]
    stats = engine.get_stats()
    return {
        "tokens": total,
        "seconds": elapsed,
        "tok_s": total / elapsed,
        "stats": stats,
        "ids": out_ids,
        **kv,
    }


def hf_generate(hf: Any, batch: list[list[int]], max_new: int, pad_id: int) -> torch.Tensor:
    width = max(len(x) for x in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(batch):  # left padding
        ids[i, width - len(x) :] = torch.tensor(x)
        mask[i, width - len(x) :] = 1
    dev = next(hf.parameters()).device
    with torch.inference_mode():
        return hf.generate(
            ids.to(dev),
            attention_mask=mask.to(dev),
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=[],
            pad_token_id=pad_id,
        )


def run_hf_sequential(hf: Any, reqs: list[tuple[list[int], int]], pad_id: int) -> dict[str, float]:
    total, t0 = 0, time.perf_counter()
    for ids, n in reqs:
        out = hf_generate(hf, [ids], n, pad_id)
        total += out.shape[1] - len(ids)
    elapsed = time.perf_counter() - t0
    return {"tokens": total, "seconds": elapsed, "tok_s": total / elapsed}


def run_hf_static(
    hf: Any, reqs: list[tuple[list[int], int]], pad_id: int, batch_size: int
) -> dict[str, float]:
    total, t0 = 0, time.perf_counter()
    for start in range(0, len(reqs), batch_size):
        chunk = reqs[start : start + batch_size]
        hf_generate(hf, [r[0] for r in chunk], max(r[1] for r in chunk), pad_id)
        total += sum(r[1] for r in chunk)  # the tokens asked for; the rest of each row is padding work
    elapsed = time.perf_counter() - t0
    return {"tokens": total, "seconds": elapsed, "tok_s": total / elapsed}


def run_hf_cb(hf: Any, reqs: list[tuple[list[int], int]]) -> dict[str, float]:
    """transformers' continuous batching manager, one request per prompt with its own max_new_tokens.
    UNTESTED (written for the GPU issue; the API is transformers >= 4.56's ContinuousBatchingManager)."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in reqs), eos_token_id=[])
    mgr = hf.init_continuous_batching(generation_config=cfg)
    mgr.start()
    t0 = time.perf_counter()
    for i, (ids, n) in enumerate(reqs):
        mgr.add_request(ids, request_id=str(i), max_new_tokens=n)
    total = 0
    for _ in reqs:
        res = mgr.get_result(timeout=600)
        total += len(res.generated_tokens)
    elapsed = time.perf_counter() - t0
    mgr.stop(block=True)
    return {"tokens": total, "seconds": elapsed, "tok_s": total / elapsed}


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


def run_embed_hf(
    hf: Any, reqs: list[tuple[list[int], int]], pad_id: int, batch_size: int
) -> dict[str, float]:
    """HF's base model (AutoModel's layers) on right-padded batches, the last real token pooled."""
    base = hf.base_model
    dev = next(hf.parameters()).device
    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(reqs), batch_size):
            chunk = [r[0] for r in reqs[start : start + batch_size]]
            width = max(len(x) for x in chunk)
            ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, x in enumerate(chunk):
                ids[i, : len(x)] = torch.tensor(x)
                mask[i, : len(x)] = 1
            h = base(input_ids=ids.to(dev), attention_mask=mask.to(dev)).last_hidden_state
            last = mask.sum(1).to(dev) - 1
            torch.nn.functional.normalize(h[torch.arange(len(chunk), device=dev), last].float(), dim=-1)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return {"prompts": len(reqs), "seconds": elapsed, "prompts_s": len(reqs) / elapsed}


def line(a: float, b: float, what: str) -> str:
    return (
        f"output throughput: {a:.1f} tok/s (pagedrs) vs {b:.1f} tok/s (transformers {what}) = {a / b:.2f} x"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype_name = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    max_len = args.input_len[1] + args.output_len[1]
    engine, hf, loaded = load_models(args, dtype, max_len)
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
        return embed_main(args, engine, hf, reqs, pad_id, dtype_name)
    run_pagedrs(engine, [(reqs[0][0][:16][::-1], 4)])  # warm-up (one-time kernel and allocator setup)
    hf_generate(hf, [reqs[0][0][:16]], 4, pad_id)
    result: dict[str, Any] = {
        "model": engine.model_name,
        "device": args.device,
        "dtype": dtype_name,
        "threads": torch.get_num_threads(),
        "num_prompts": len(reqs),
        "input_tokens": n_in,
        "output_tokens": n_out,
    }
    pg = run_pagedrs(engine, reqs)
    assert pg["tokens"] == n_out, (pg["tokens"], n_out)
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
    if args.tensor_parallel_size > 1:
        tp = tp_engine(args, dtype, max_len)
        try:
            run_pagedrs(tp, [(reqs[0][0][:16][::-1], 4)])
            res = run_pagedrs(tp, reqs)
        finally:
            tp.shutdown()
        assert res["tokens"] == n_out, (res["tokens"], n_out)
        n = args.tensor_parallel_size
        result["tensor_parallel_size"] = n
        result["pagedrs_tp_tok_s"] = res["tok_s"]
        result["tp_vs_one_rank"] = res["tok_s"] / pg["tok_s"]
        print(
            f"output throughput: {res['tok_s']:.1f} tok/s (pagedrs TP={n}) vs {pg['tok_s']:.1f} tok/s "
            f"(pagedrs TP=1) = {res['tok_s'] / pg['tok_s']:.2f} x"
        )
    if args.kv_cache_dtype:
        result.update(kv_cache_vs_model_dtype(args, engine, loaded, reqs, pg, dtype, max_len))
    if not args.skip_hf:
        if args.hf_cb:
            cb = run_hf_cb(hf, reqs)
            result["hf_cb_tok_s"] = cb["tok_s"]
            print(line(pg["tok_s"], cb["tok_s"], "continuous batching"))
        bs = args.hf_batch_size or len(reqs)
        st = run_hf_static(hf, reqs, pad_id, bs)
        result["hf_static_tok_s"] = st["tok_s"]
        result["hf_static_batch_size"] = bs
        seq_reqs = reqs[: args.hf_sequential_limit] if args.hf_sequential_limit else reqs
        sq = run_hf_sequential(hf, seq_reqs, pad_id)
        result["hf_sequential_tok_s"] = sq["tok_s"]
        result["hf_sequential_requests"] = len(seq_reqs)
        print(
            f"transformers one-at-a-time: {sq['tokens']} tokens in {sq['seconds']:.1f} s "
            f"({len(seq_reqs)} requests); static batch of {bs}: {st['tokens']} tokens in {st['seconds']:.1f} s"
        )
        print(line(pg["tok_s"], sq["tok_s"], "one-at-a-time"))
        print(line(pg["tok_s"], st["tok_s"], f"static batch {bs}"))
        result["speedup_vs_sequential"] = pg["tok_s"] / sq["tok_s"]
        result["speedup_vs_static"] = pg["tok_s"] / st["tok_s"]
    if args.json:
        write_json(args.json, result)
    return result


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
    engine: LLMEngine,
    hf: Any,
    reqs: list[tuple[list[int], int]],
    pad_id: int,
    dtype: str,
) -> dict[str, Any]:
    run_embed_pagedrs(engine, reqs[:2])  # warm-up
    pg = run_embed_pagedrs(engine, reqs)
    bs = args.hf_batch_size or len(reqs)
    run_embed_hf(hf, reqs[:2], pad_id, bs)
    st = run_embed_hf(hf, reqs, pad_id, bs)
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
        write_json(args.json, result)
    return result


def _jsonable(v: Any) -> bool:
    return isinstance(v, (int, float, str)) and not (isinstance(v, float) and math.isnan(v))


if __name__ == "__main__":
    main()
