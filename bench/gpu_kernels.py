"""Kernel benchmark: paged decode attention against the device's HBM bandwidth, varlen prefill against
torch's scaled_dot_product_attention.

    python bench/gpu_kernels.py --out bench/results/kernels.json [--hbm-tbps 3.35] [--commit SHA]

Decode: K/V bytes read per step / kernel time, for batch 1..256 and context 512..32k, in TB/s and as a
fraction of the device's HBM bandwidth from its data sheet (H100 SXM 3.35 TB/s, H200 4.8 TB/s; see
bench/_roofline.py; --hbm-tbps replaces it). A large device-to-device copy is timed too and reported for
context only: it reaches less than the data sheet (~2.4-3.0 TB/s on an H100), so it is not the 100% mark.
Headline: decode_tbps, the best decode bandwidth at context >= 4k, and decode_bw_fraction = decode_tbps /
HBM. Prefill: causal attention FLOP/s of the paged kernel (K/V read through block tables) against SDPA on
the same shapes laid out contiguously; reported as time ours / SDPA. Kernel times come from CUDA-graph
replays timed with CUDA events, so Python launch overhead is not counted. Shapes default to Llama-3-8B
attention (32 query heads, 8 KV heads, head size 128, bf16, block size 16; run again with --block-size 32
to compare page sizes). Prefill times both tensor-core tiles (64 and 128 query rows per CTA) and counts
the faster. Layer ops: the fused kernels of cuda/layer_ops.cu against the torch ops they replace. bench/gpu_summary.py folds the
JSON into bench/results/gpu-summary.json.
"""

from __future__ import annotations

# pagedrs before torch: importing it shortens libgomp's idle spin, which torch's import fixes for good
import pagedrs  # noqa: F401

# isort: split

import argparse
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import add_commit_arg, command_line, resolve_commit, write_json
from _roofline import device_spec

DECODE_BATCHES = (1, 4, 16, 64, 256)
DECODE_CONTEXTS = (512, 2048, 4096, 8192, 16384, 32768)
PREFILL_LENGTHS = (512, 1024, 2048, 4096, 8192)
PREFILL_TOKENS = 16384


def time_graph(fn: Callable[[], object], iters: int = 20) -> float:
    """Median seconds per call of fn, replayed from a CUDA graph (captured after a warm-up)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes // 2, dtype=torch.float16, device="cuda").fill_(1.0)
    dst = torch.empty_like(src)
    seconds = time_graph(lambda s=src, d=dst: d.copy_(s), iters=10)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes / seconds


def _paged_inputs(batch: int, q_len: int, ctx: int, args: argparse.Namespace) -> dict:
    """A paged batch of `batch` requests, `ctx` context each, last `q_len` tokens queried; blocks in
    random order (what a long-running pool looks like)."""
    bs, kvh, d = args.block_size, args.num_kv_heads, args.head_size
    blocks_per = -(-ctx // bs)
    num_blocks = batch * blocks_per
    dtype = getattr(torch, args.dtype)
    cache = torch.randn(2, num_blocks, bs, kvh, d, device="cuda", dtype=dtype)
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, blocks_per)
    q = torch.randn(batch * q_len, args.num_heads, d, device="cuda", dtype=dtype)
    return {
        "q": q,
        "out": torch.empty_like(q),
        "cache": cache,
        "block_tables": tables,
        "seq_lens": torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
        "query_start_loc": torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device="cuda"),
    }


def _run_paged(x: dict, q_len: int, ctx: int, head_size: int, impl: str = "auto") -> None:
    from pagedrs.kernels import paged_attention

    paged_attention(
        x["out"],
        x["q"],
        x["cache"][0],
        x["cache"][1],
        x["block_tables"],
        x["seq_lens"],
        x["query_start_loc"],
        scale=head_size**-0.5,
        sliding_window=None,
        max_query_len=q_len,
        max_seq_len=ctx,
        prefill_impl=impl,  # type: ignore[arg-type]
    )


def bench_decode(args: argparse.Namespace, hbm_tbps: float | None) -> list[dict]:
    rows = []
    esize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    for batch in args.decode_batches:
        for ctx in args.decode_contexts:
            kv_bytes = 2 * batch * ctx * args.num_kv_heads * args.head_size * esize
            if kv_bytes > args.max_cache_gb * (1 << 30):
                continue
            x = _paged_inputs(batch, 1, ctx, args)
            seconds = time_graph(lambda x=x, c=ctx: _run_paged(x, 1, c, args.head_size))
            rows.append(
                {
                    "batch": batch,
                    "context": ctx,
                    "time_us": seconds * 1e6,
                    "kv_bytes": kv_bytes,
                    "GBps": kv_bytes / seconds / 1e9,
                    "TBps": kv_bytes / seconds / 1e12,
                    "fraction_of_hbm": kv_bytes / seconds / 1e12 / hbm_tbps if hbm_tbps else None,
                }
            )
            print(
                f"decode batch {batch:4d} context {ctx:6d}: {seconds * 1e6:9.1f} us  "
                f"{kv_bytes / seconds / 1e12:6.3f} TB/s"
                + (f"  {kv_bytes / seconds / 1e12 / hbm_tbps:6.1%} of HBM" if hbm_tbps else ""),
                file=sys.stderr,
            )
            del x
            torch.cuda.empty_cache()
    return rows


def bench_prefill(args: argparse.Namespace) -> list[dict]:
    rows = []
    h, kvh, d = args.num_heads, args.num_kv_heads, args.head_size
    for length in args.prefill_lengths:
        batch = max(1, args.prefill_tokens // length)
        x = _paged_inputs(batch, length, length, args)
        # Both tensor-core tiles (64 and 128 query rows per CTA); "auto" picks 128 at these lengths.
        tiles = {
            impl: time_graph(lambda x=x, n=length, i=impl: _run_paged(x, n, n, d, i))
            for impl in args.prefill_impls
        }
        best_impl = min(tiles, key=lambda i: tiles[i])
        ours = tiles[best_impl]
        # The same K/V, contiguous [B, H, L, D] for SDPA.
        k = (
            x["cache"][0][x["block_tables"].long()]
            .reshape(batch, length, kvh, d)
            .transpose(1, 2)
            .contiguous()
        )
        v = (
            x["cache"][1][x["block_tables"].long()]
            .reshape(batch, length, kvh, d)
            .transpose(1, 2)
            .contiguous()
        )
        q = x["q"].view(batch, length, h, d).transpose(1, 2).contiguous()
        sdpa = time_graph(
            lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=d**-0.5, enable_gqa=True
            )
        )
        flops = 4 * batch * h * d * length * (length + 1) / 2  # causal: QK^T and PV over half the matrix
        rows.append(
            {
                "batch": batch,
                "seq_len": length,
                "ours_ms": ours * 1e3,
                "impl": best_impl,
                "impl_ms": {i: t * 1e3 for i, t in tiles.items()},
                "sdpa_ms": sdpa * 1e3,
                "ours_tflops": flops / ours / 1e12,
                "sdpa_tflops": flops / sdpa / 1e12,
                "time_vs_sdpa": ours / sdpa,
            }
        )
        print(
            f"prefill batch {batch:3d} length {length:5d}: {flops / ours / 1e12:6.1f} TFLOP/s (pagedrs) vs "
            f"{flops / sdpa / 1e12:6.1f} (SDPA), time ratio {ours / sdpa:.2f}x "
            f"({best_impl}; " + ", ".join(f"{i} {t * 1e3:.3f} ms" for i, t in tiles.items()) + ")",
            file=sys.stderr,
        )
        del x, k, v, q
        torch.cuda.empty_cache()
    return rows


def bench_layer_ops(args: argparse.Namespace) -> list[dict]:
    """The fused kernels of cuda/layer_ops.cu against the torch path of the same layer (several kernels and
    passes): fused residual add + RMSNorm, RoPE on q and k, SiLU-and-mul; Llama-3-8B widths."""
    from pagedrs.layers.activation import SiluAndMul
    from pagedrs.layers.norm import RMSNorm
    from pagedrs.layers.rotary import RotaryEmbedding

    dtype = getattr(torch, args.dtype)
    hidden, inter = args.hidden_size, args.intermediate_size
    h, kvh, d = args.num_heads, args.num_kv_heads, args.head_size
    norm = RMSNorm(hidden, 1e-5, dtype=dtype, device="cuda")
    rope = RotaryEmbedding(d, d, 8192, {"rope_type": "default", "rope_theta": 500000.0}, device="cuda")
    act = SiluAndMul()
    rows = []
    for tokens in args.layer_tokens:
        x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
        res = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
        qkv = torch.randn(tokens, (h + 2 * kvh) * d, device="cuda", dtype=dtype)
        q, k, _ = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        pos = torch.randint(0, 8192, (tokens,), device="cuda")
        gate_up = torch.randn(tokens, 2 * inter, device="cuda", dtype=dtype)
        cases = {
            "fused_add_rms_norm": (norm, lambda x=x, r=res: norm(x, r)),
            "rotary_embedding": (rope, lambda p=pos, q=q, k=k: rope(p, q, k)),
            "silu_and_mul": (act, lambda g=gate_up: act(g)),
        }
        for name, (layer, fn) in cases.items():
            times = {}
            for fused in (False, True):
                layer.use_kernels = fused
                times[fused] = time_graph(fn)
            layer.use_kernels = False
            rows.append(
                {
                    "op": name,
                    "tokens": tokens,
                    "torch_us": times[False] * 1e6,
                    "fused_us": times[True] * 1e6,
                    "speedup": times[False] / times[True],
                }
            )
            print(
                f"{name:20s} tokens {tokens:4d}: {times[True] * 1e6:7.1f} us (fused) vs "
                f"{times[False] * 1e6:7.1f} us (torch ops) = {times[False] / times[True]:.2f}x",
                file=sys.stderr,
            )
    return rows


def headline(decode: list[dict], prefill: list[dict], hbm_tbps: float | None) -> dict:
    """decode_tbps: the best decode bandwidth at context >= 4k (TB/s); decode_bw_fraction: it over the
    HBM bandwidth (None where that is unknown); prefill_time_vs_sdpa: the median over lengths."""
    long = [r for r in decode if r["context"] >= 4096]
    best = max(long, key=lambda r: r["TBps"]) if long else None
    ratios = sorted(r["time_vs_sdpa"] for r in prefill)
    return {
        "decode_tbps": best["TBps"] if best else None,
        "decode_bw_fraction": best["TBps"] / hbm_tbps if best and hbm_tbps else None,
        "decode_best": {"batch": best["batch"], "context": best["context"]} if best else None,
        "prefill_time_vs_sdpa": ratios[len(ratios) // 2] if ratios else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="write the JSON results here")
    p.add_argument(
        "--hbm-tbps", type=float, default=None, help="HBM bandwidth, TB/s (default: the device's data sheet)"
    )
    add_commit_arg(p)
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--decode-batches", type=int, nargs="+", default=list(DECODE_BATCHES))
    p.add_argument("--decode-contexts", type=int, nargs="+", default=list(DECODE_CONTEXTS))
    p.add_argument("--prefill-lengths", type=int, nargs="+", default=list(PREFILL_LENGTHS))
    p.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS, help="tokens per prefill batch")
    p.add_argument("--max-cache-gb", type=float, default=16.0, help="skip decode shapes with more K/V")
    p.add_argument(
        "--prefill-impls",
        nargs="+",
        default=["mma64", "mma128"],
        help="prefill kernels to time (best counts)",
    )
    p.add_argument("--hidden-size", type=int, default=4096, help="layer-ops width (Llama-3-8B)")
    p.add_argument("--intermediate-size", type=int, default=14336)
    p.add_argument("--layer-tokens", type=int, nargs="+", default=[64, 256, 2048])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2

    name = torch.cuda.get_device_name()
    hbm = device_spec(name, args.hbm_tbps).hbm_tbps
    if hbm is None:
        print(f"no HBM bandwidth known for {name!r}: give --hbm-tbps for the fractions", file=sys.stderr)
    copy_bw = copy_bandwidth()
    print(f"device copy bandwidth: {copy_bw / 1e12:.2f} TB/s (read + write; for context)", file=sys.stderr)
    decode = bench_decode(args, hbm)
    prefill = bench_prefill(args)
    layer_ops = bench_layer_ops(args)
    head = headline(decode, prefill, hbm)
    result = {
        "device": name,
        "commit": resolve_commit(args.commit),
        "command": command_line(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "shape": {
            k: getattr(args, k) for k in ("dtype", "num_heads", "num_kv_heads", "head_size", "block_size")
        },
        "hbm_tbps": hbm,
        "copy_bandwidth_GBps": copy_bw / 1e9,
        "decode": decode,
        "prefill": prefill,
        "layer_ops": layer_ops,
        **head,
    }
    if head["decode_tbps"] is not None and head["prefill_time_vs_sdpa"] is not None:
        best_pf = min(prefill, key=lambda r: abs(r["time_vs_sdpa"] - head["prefill_time_vs_sdpa"]))
        vs = f"{hbm:.2f} TB/s (HBM) = {head['decode_bw_fraction']:.2f} x" if hbm else "? TB/s (HBM unknown)"
        print(
            f"decode attention: {head['decode_tbps']:.2f} TB/s (pagedrs) vs {vs} at batch "
            f"{head['decode_best']['batch']}, context {head['decode_best']['context']}; "
            f"prefill: {best_pf['ours_tflops']:.0f} TFLOP/s (pagedrs) vs {best_pf['sdpa_tflops']:.0f} TFLOP/s "
            f"(torch SDPA) = {head['prefill_time_vs_sdpa']:.2f} x the time (median over lengths)"
        )
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
