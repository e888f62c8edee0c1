"""Liquid scaling events: time and bytes of each move, against restarting the engine at the new degree.

    python bench/liquid.py                                   # CPU, a 4-shard Llama shape, 1->2->4->2->1
    python bench/liquid.py --hidden 1024 --layers 16 --json bench/results/liquid-cpu.json

A random-weight Llama of the given shape (SmolLM2's tokenizer and vocabulary) is written to a temporary
folder; an engine with `liquid_gpu_range` over --ranks ranks serves --requests requests while it moves
1 -> 2 -> ... -> ranks -> ... -> 1, one event every --every steps. For each event: bytes of weights and
KV cache moved, seconds, bandwidth, block pool before/after. The baseline, in the same run: the time to
start a fresh engine at that degree (`tensor_parallel_size=N`, weights read from disk), which is what a
system that cannot move shards pays to change its degree. Greedy outputs are checked against a run with
no events. On GPUs (--device cuda) the ranks are GPUs 0..N-1; the machines this was written on had one.
"""

from __future__ import annotations

# pagedrs before torch: importing it shortens libgomp's idle spin, which torch's import fixes for good
import pagedrs  # noqa: F401

# isort: split

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from _common import add_commit_arg, command_line, resolve_commit, write_json

from pagedrs import EngineArgs, LiquidRequest, LLMEngine, SamplingParams
from pagedrs.loader import load_tokenizer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--ranks", type=int, default=4, help="liquid_gpu_range length (a power of two)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--every", type=int, default=6, help="steps between two events")
    p.add_argument("--kv-gb", type=float, default=0.25, help="KV pool per rank (CPU), GiB")
    p.add_argument("--json", default=None, metavar="PATH")
    add_commit_arg(p)
    return p.parse_args(argv)


def make_model(folder: Path, a: argparse.Namespace) -> Path:
    tok = load_tokenizer(None)  # the default model's tokenizer, saved beside the random weights
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def engine_args(folder: Path, a: argparse.Namespace, **kw: Any) -> EngineArgs:
    return EngineArgs(
        model=str(folder),
        device=a.device,
        dtype="float32" if a.device == "cpu" else "bfloat16",
        cpu_kv_cache_gb=a.kv_gb if a.device == "cpu" else None,
        max_model_len=512,
        disable_log_stats=True,
        **kw,
    )


def run(
    engine: LLMEngine, a: argparse.Namespace, schedule: list[int]
) -> tuple[dict[str, list[int]], list[dict]]:
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    for i in range(a.requests):
        engine.add_request(str(i), [(31 * i + 7 * j) % 20000 + 10 for j in range(24 + i % 7)], params)
    outs: dict[str, list[int]] = {}
    events: list[dict] = []
    step = 0
    todo = list(schedule)
    while engine.has_unfinished_requests() or todo:
        if todo and step % a.every == a.every - 1:
            events += engine.do_liquid(LiquidRequest(target=todo.pop(0)))
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
        step += 1
    return outs, events


def cold_start_seconds(folder: Path, a: argparse.Namespace, tp: int) -> float:
    t0 = time.perf_counter()
    eng = LLMEngine.from_engine_args(engine_args(folder, a, tensor_parallel_size=tp))
    seconds = time.perf_counter() - t0
    eng.shutdown()
    return seconds


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    up = [2**k for k in range(1, a.ranks.bit_length()) if 2**k <= a.ranks]
    schedule = up + up[-2::-1] + [1]  # 2, 4, ..., N, ..., 2, 1
    with tempfile.TemporaryDirectory(prefix="pagedrs-liquid-") as tmp:
        folder = make_model(Path(tmp) / "model", a)
        ref, _ = run(LLMEngine.from_engine_args(engine_args(folder, a)), a, [])
        liquid = LLMEngine.from_engine_args(
            engine_args(folder, a, liquid_gpu_range=list(range(a.ranks)), liquid_total_num_shards=a.ranks)
        )
        got, events = run(liquid, a, schedule)
        liquid.shutdown()
        assert got == ref, "liquid outputs differ from the run with no events"
        restarts = {d: cold_start_seconds(folder, a, d) for d in sorted({e["dst_degree"] for e in events})}
    rows = []
    for e in events:
        restart = restarts[e["dst_degree"]]
        rows.append({**e, "restart_seconds": restart, "speedup_vs_restart": restart / e["total_seconds"]})
        print(
            f"{e['src_degree']} -> {e['dst_degree']} ranks: weights {e['weight_bytes'] / 2**20:.1f} MiB in "
            f"{e['weight_seconds']:.3f} s, KV {e['kv_bytes'] / 2**20:.1f} MiB in {e['kv_seconds']:.3f} s, "
            f"pool {e['num_blocks_before']} -> {e['num_blocks_after']} blocks; "
            f"event {e['total_seconds']:.3f} s vs restart at TP={e['dst_degree']} {restart:.2f} s "
            f"= {restart / e['total_seconds']:.1f} x"
        )
    result = {
        "command": command_line(),
        "commit": resolve_commit(a.commit),
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "shape": {k: getattr(a, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate")},
        "ranks": a.ranks,
        "requests": a.requests,
        "outputs_equal_no_events": True,
        "events": rows,
    }
    if a.json:
        write_json(a.json, result)
    return result


if __name__ == "__main__":
    main()
