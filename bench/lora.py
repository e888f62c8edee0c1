"""Multi-LoRA throughput: the same requests on the base model alone and with N adapters mixed uniformly in
one batch (round robin over the requests), side by side in one run.

    python bench/lora.py                          # default model, 8 adapters of rank 8, 32 requests
    python bench/lora.py --dtype float32 --json bench/results/lora-cpu.json

Adapters: random PEFT folders (adapter_config.json + adapter_model.safetensors, the q/k/v/o and
gate/up/down projections of every layer, lora_A and lora_B random, scaled so the deltas are small), written
to a temporary folder from the model's config. Requests: random token prompts (fixed seed), greedy,
ignore_eos, output lengths uniform in --output-len. Systems, in this order, each in a fresh engine:
"base" (enable_lora off), "base+lora" (enable_lora on, every request on the base model), "N adapters"
(enable_lora on, request i on adapter i mod N, max_loras N), then the same with the CPU deltas forced onto
the batched-matmul form (`pagedrs.lora.layers.CPU_KERNEL_MAX_ROWS = 0`; on a CPU the Rust BGMV kernel
otherwise takes every step). Output throughput counts the requested tokens; the
headline ratio is N adapters / base. The JSON records the commit, the machine and the torch threads.
"""

from __future__ import annotations

# pagedrs before torch: importing it shortens libgomp's idle spin, which torch's import fixes for good
import pagedrs  # noqa: F401

# isort: split

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import add_commit_arg, command_line, git_info, machine_info, write_json
from safetensors.torch import save_file

from pagedrs import LLM, LoRARequest, SamplingParams
from pagedrs.loader import model_folder, resolve_model_path

_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _shapes(cfg: Any) -> dict[str, tuple[int, int]]:
    """(in, out) of each target projection of a Llama-family config."""
    h = cfg.hidden_size
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    kv = getattr(cfg, "num_key_value_heads", heads) * head_dim
    inter = cfg.intermediate_size
    return {
        "q_proj": (h, heads * head_dim),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (heads * head_dim, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def write_adapter(folder: Path, cfg: Any, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter folder for a Llama-family model with config `cfg`."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for name, (fan_in, fan_out) in _shapes(cfg).items():
            part = "self_attn" if name in _MODULES[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(_MODULES),
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], loras: list[Any]) -> float:
    start = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
    )
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == p.max_tokens for o, p in zip(outs, params, strict=True))
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="auto", help="auto (a GGUF stays quantized on CPU) or float32")
    ap.add_argument("--num-adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 64], metavar=("MIN", "MAX"))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, metavar="PATH")
    add_commit_arg(ap)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(model_folder(resolve_model_path(args.model)))
    rng = random.Random(args.seed)
    vocab = int(cfg.vocab_size)
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(*args.input_len))] for _ in range(args.num_prompts)
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(*args.output_len), ignore_eos=True)
        for _ in prompts
    ]
    tokens = sum(p.max_tokens for p in params)
    engine = dict(disable_log_stats=True, dtype=args.dtype, seed=0)
    results: dict[str, dict[str, float]] = {}

    def record(name: str, seconds: float) -> None:
        results[name] = {"seconds": seconds, "output_tok_s": tokens / seconds}
        print(f"{name:>14}: {tokens} tokens in {seconds:6.1f} s = {tokens / seconds:6.1f} tok/s", flush=True)

    base = LLM(args.model, **engine)
    _run(base, prompts[:2], params[:2], [None, None])  # warm-up
    record("base", _run(base, prompts, params, [None] * len(prompts)))
    del base
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [
            LoRARequest(
                f"a{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", cfg, args.rank, args.seed + i))
            )
            for i in range(args.num_adapters)
        ]
        llm = LLM(
            args.model,
            enable_lora=True,
            max_loras=args.num_adapters,
            max_lora_rank=max(16, args.rank),
            **engine,
        )
        _run(llm, prompts[:2], params[:2], [None, None])
        record("base+lora", _run(llm, prompts, params, [None] * len(prompts)))
        loras = [adapters[i % len(adapters)] for i in range(len(prompts))]
        _run(llm, prompts[:2], params[:2], loras[:2])  # loads two adapters; the run loads the rest
        name = f"{args.num_adapters} adapters"
        llm.reset_prefix_cache()  # each timed run computes every prompt (none cached by the one before)
        record(name, _run(llm, prompts, params, loras))
        from pagedrs.lora import layers

        kernel_rows, layers.CPU_KERNEL_MAX_ROWS = layers.CPU_KERNEL_MAX_ROWS, 0
        llm.reset_prefix_cache()
        record(f"{name} (bmm)", _run(llm, prompts, params, loras))
        layers.CPU_KERNEL_MAX_ROWS = kernel_rows
    ratio = results[name]["output_tok_s"] / results["base"]["output_tok_s"]
    print(
        f"output throughput: {results[name]['output_tok_s']:.1f} tok/s ({name}) vs "
        f"{results['base']['output_tok_s']:.1f} tok/s (base) = {ratio:.2f}x"
    )
    if args.json:
        write_json(
            args.json,
            {
                "bench": "lora",
                "command": command_line(),
                "machine": machine_info(),
                "git": git_info(args.commit),
                "torch_threads": torch.get_num_threads(),
                "dtype": args.dtype,
                "num_adapters": args.num_adapters,
                "rank": args.rank,
                "num_prompts": args.num_prompts,
                "output_tokens": tokens,
                "results": results,
                "adapters_vs_base": ratio,
            },
        )


if __name__ == "__main__":
    main()
