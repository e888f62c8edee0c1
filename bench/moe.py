"""The fused experts step of a mixture-of-experts layer on a CPU (`pagedrs._core.moe_experts`, one Rust
call: pairs sorted by expert once, each active expert's weights read once for all its rows) against

- a Python loop over the experts (HF transformers' eager MixtralExperts: for each expert some token
  chose, gather its tokens, two torch matmuls, scatter-add), same float32 weights and routing;
- dense torch matmuls of the same active parameter count (one SiLU-gated MLP of top_k x the experts'
  intermediate size: what a dense model with the MoE's active parameters costs);

per batch size (rows), and at batch 1 how the step's time follows the active experts (top_k) and not the
total (num_experts). Float32 by default; --quant Q8_0 runs the fused step on GGUF-quantized experts too.
--engine adds the engine's decode tok/s on a tiny-but-wide Mixtral (random weights) against the dense
Llama of the same shape with the MoE's active parameters.

    python bench/moe.py                                   # rows 1, 16, 256; 2 threads
    python bench/moe.py --rows 1 16 --json bench/results/moe.json

Each figure is the 10th percentile of --iters timed calls after two warm-up calls (`_common.low_time`).
The fused step and the loop are also timed interleaved (one call of each in turn, --rounds rounds of
--iters pairs): `loop_over_fused` is each round's ratio of the two 10th percentiles, median and spread,
so that load from other processes falls on both alike.
"""

# ruff: noqa: B023  (each timed lambda runs within its own loop iteration, on that iteration's values)

from __future__ import annotations

# pagedrs before torch: importing it shortens libgomp's idle spin, which torch's import fixes for good
import pagedrs  # noqa: F401

# isort: split

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from _common import add_commit_arg, command_line, decode_tok_s, git_info, low_time, machine_info, write_json

from pagedrs import _core
from pagedrs.layers.moe import RoutingConfig, route


def _loop(x, gate_up, down, w, ids):
    """HF's eager experts forward: a Python loop over the experts some token chose."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        g, u = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        out.index_add_(0, tok, F.linear(F.silu(g) * u, down[e]) * w[tok, slot, None])
    return out


def _fused(x, gate_up, down, w, ids, threads, types=(None, None), packed=False):
    out = np.empty(tuple(x.shape), dtype=np.float32)
    gu, dn = gate_up, down
    _core.moe_experts(
        x.numpy(),
        gu,
        dn,
        ids.numpy(),
        w.numpy(),
        out,
        gate_up_type=types[0],
        down_type=types[1],
        num_threads=threads,
        gate_up_packed=packed,
        down_packed=packed,
    )
    return out


def _interleaved(fused, loop, iters: int, rounds: int) -> dict[str, float]:
    """loop / fused time, one call of each in turn: per round the ratio of the 10th percentiles."""
    ratios = []
    for _ in range(rounds):
        tf, tl = [], []
        fused(), loop()
        for _ in range(iters):
            t0 = time.perf_counter()
            fused()
            t1 = time.perf_counter()
            loop()
            tf.append(t1 - t0)
            tl.append(time.perf_counter() - t1)
        tf.sort(), tl.sort()
        ratios.append(tl[len(tl) // 10] / tf[len(tf) // 10])
    ratios.sort()
    return {"median": ratios[len(ratios) // 2], "min": ratios[0], "max": ratios[-1], "rounds": rounds}


def _weights(experts: int, hidden: int, inter: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.05
    down = torch.randn(experts, hidden, inter, generator=gen) * 0.05
    return gate_up, down


def _routing(rows: int, experts: int, top_k: int, hidden: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen)
    w, ids = route(torch.randn(rows, experts, generator=gen), RoutingConfig(experts, top_k))
    return x, w, ids


def _engine_tok_s(folder: str, batch: int, tokens: int, threads: int) -> float:
    """Decode throughput of the engine over `folder` (random weights): `batch` requests of 8-token prompts,
    `tokens` greedy tokens each, timed from the step after every prompt is in."""
    from pagedrs import EngineArgs

    torch.set_num_threads(threads)
    args = EngineArgs(
        model=folder,
        load_format="dummy",
        skip_tokenizer_init=True,
        device="cpu",
        dtype="float32",
        disable_log_stats=True,
    )
    return decode_tok_s(args, [[(7 * i + j) % 200 + 3 for j in range(8)] for i in range(batch)], tokens)


def _engine_comparison(args: argparse.Namespace) -> dict[str, float]:
    """A tiny-but-wide Mixtral (hidden 512, 16 experts of 512, top 2, 4 layers) against the dense Llama of
    the same shape whose MLP has the MoE's active parameters (intermediate 2 x 512)."""
    import tempfile

    import transformers

    common = dict(
        vocab_size=256,
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    configs = {
        "moe": transformers.MixtralConfig(
            **common,
            intermediate_size=512,
            num_local_experts=16,
            num_experts_per_tok=2,
            architectures=["MixtralForCausalLM"],
        ),
        "dense": transformers.LlamaConfig(
            **common, intermediate_size=1024, architectures=["LlamaForCausalLM"]
        ),
    }
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in configs.items():
            folder = Path(tmp) / name
            cfg.save_pretrained(str(folder))
            out[name] = _engine_tok_s(str(folder), args.engine_batch, args.engine_tokens, args.threads)
    print(
        f"decode throughput: {out['moe']:.1f} tok/s (MoE, 2 of 16 experts) vs {out['dense']:.1f} tok/s "
        f"(dense, same active parameters) = {out['moe'] / out['dense']:.2f}x"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--inter", type=int, default=384, help="each expert's intermediate size")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="interleaved fused/loop rounds")
    p.add_argument(
        "--quant", default=None, help="also the fused step on experts in this GGUF type (Q8_0, Q4_0, MXFP4)"
    )
    p.add_argument("--engine", action="store_true", help="also the engine's decode tok/s, MoE vs dense")
    p.add_argument("--engine-batch", type=int, default=4)
    p.add_argument("--engine-tokens", type=int, default=32)
    p.add_argument("--json", default=str(Path(__file__).parent / "results" / "moe.json"))
    add_commit_arg(p)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    E, k, H, inter = args.experts, args.top_k, args.hidden, args.inter
    gate_up, down = _weights(E, H, inter)
    gu_np, dn_np = gate_up.numpy(), down.numpy()
    dense_gu, dense_dn = (
        gate_up[0].new_empty(2 * k * inter, H).normal_(0, 0.05),
        down[0].new_empty(H, k * inter).normal_(0, 0.05),
    )
    qdata = None
    if args.quant:
        import gguf

        from pagedrs.layers.moe.stacked_quant import StackedQuantWeight

        # as the MoE layer keeps them: Q4_0 / Q4_1 / Q8_0 repacked 8 rows at a time at load
        qt = getattr(gguf.GGMLQuantizationType, args.quant)
        qg = StackedQuantWeight(
            int(qt), gguf.quants.quantize(gu_np.reshape(-1, H), qt).reshape(E, 2 * inter, -1), H
        )
        qd = StackedQuantWeight(
            int(qt), gguf.quants.quantize(dn_np.reshape(-1, inter), qt).reshape(E, H, -1), inter
        )
        qdata = (qg.data, qd.data, int(qt), qg.packed)
    results: dict[str, object] = {
        "shape": {"experts": E, "top_k": k, "hidden": H, "inter": inter},
        "rows": {},
    }
    for rows in args.rows:
        x, w, ids = _routing(rows, E, k, H)
        got = _fused(x, gu_np, dn_np, w, ids, args.threads)
        np.testing.assert_allclose(got, _loop(x, gate_up, down, w, ids).numpy(), atol=1e-4, rtol=1e-3)
        t_fused = low_time(lambda: _fused(x, gu_np, dn_np, w, ids, args.threads), args.iters)
        t_loop = low_time(lambda: _loop(x, gate_up, down, w, ids), args.iters)
        t_dense = low_time(
            lambda: F.linear(F.silu(F.linear(x, dense_gu)[:, : k * inter]), dense_dn), args.iters
        )
        ratio = _interleaved(
            lambda: _fused(x, gu_np, dn_np, w, ids, args.threads),
            lambda: _loop(x, gate_up, down, w, ids),
            args.iters,
            args.rounds,
        )
        entry = {
            "fused_ms": t_fused * 1e3,
            "loop_ms": t_loop * 1e3,
            "dense_same_active_ms": t_dense * 1e3,
            "active_experts": len(torch.unique(ids)),
            "loop_over_fused": ratio,
        }
        print(
            f"fused experts at {rows} rows, interleaved: loop / fused = {ratio['median']:.2f}x "
            f"(median of {args.rounds} rounds, {ratio['min']:.2f}..{ratio['max']:.2f})"
        )
        print(
            f"fused experts at {rows} rows: {t_fused * 1e3:.3f} ms (fused) vs {t_loop * 1e3:.3f} ms (loop over experts) = {t_loop / t_fused:.2f}x"
        )
        print(
            f"fused experts at {rows} rows: {t_fused * 1e3:.3f} ms (fused) vs {t_dense * 1e3:.3f} ms (dense, same active parameters) = {t_dense / t_fused:.2f}x"
        )
        if qdata is not None:
            qg, qd, qt_id, packed = qdata
            t_q = low_time(
                lambda: _fused(x, qg, qd, w, ids, args.threads, (qt_id, qt_id), packed), args.iters
            )
            entry[f"fused_{args.quant}_ms"] = t_q * 1e3
            print(
                f"fused experts at {rows} rows: {t_q * 1e3:.3f} ms ({args.quant}) vs {t_fused * 1e3:.3f} ms (float32) = {t_fused / t_q:.2f}x"
            )
        results["rows"][str(rows)] = entry  # type: ignore[index]
    scaling = {}
    for experts, top_k in [(E, 1), (E, k), (E, 2 * k), (E // 4, k)]:
        gu2, dn2 = (gate_up, down) if experts == E else _weights(experts, H, inter)
        x, w, ids = _routing(1, experts, top_k, H)
        t = low_time(lambda: _fused(x, gu2.numpy(), dn2.numpy(), w, ids, args.threads), args.iters)
        scaling[f"{top_k}_of_{experts}"] = t * 1e3
        print(f"batch 1, {top_k} active of {experts} experts: {t * 1e3:.3f} ms")
    results["batch1_active_vs_total_ms"] = scaling
    if args.engine:
        results["engine_decode_tok_s"] = _engine_comparison(args)
    results.update(
        git_info(args.commit),
        machine=machine_info(),
        command=command_line(),
        threads=args.threads,
        load_average_1m=os.getloadavg()[0],  # other processes on the machine while it ran
    )
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
