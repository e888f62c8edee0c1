"""float32 matmuls on a CPU: torch's `F.linear` (MKL's sgemm, which packs the weight on every call) against
the same weight packed once for oneDNN (`pagedrs.layers.onednn.PackedDense`, what the engine runs for a
dense float32 model on a CPU), side by side in one run, at the default model's layer shapes.

    python bench/cpu_gemm.py                                  # rows 1, 16, 64; 2 threads
    python bench/cpu_gemm.py --rows 1 64 --json bench/results/cpu-gemm.json

Shapes (out x in): SmolLM2-135M's qkv 960 x 576, o_proj 576 x 576, gate|up 3072 x 576, down 576 x 1536 and
the output head 49152 x 576. Each figure is the 10th percentile of --iters timed calls (after two warm-up
calls), the better of two rounds that alternate the two methods; "per step" adds 30 layers' four matmuls
and the head once, as one decode step of that many rows runs them.
"""

from __future__ import annotations

# pagedrs before torch: importing it shortens libgomp's idle spin, which torch's import fixes for good
import pagedrs  # noqa: F401

# isort: split

import argparse

import torch
import torch.nn.functional as F
from _common import add_commit_arg, command_line, git_info, low_time, machine_info, write_json

from pagedrs.layers.onednn import PackedDense, available

SHAPES = {
    "qkv": (960, 576),
    "o_proj": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "head": (49152, 576),
}
LAYERS = 30


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", default=None)
    add_commit_arg(p)
    args = p.parse_args(argv)
    if not available():
        print(
            "oneDNN's packed linear is not available in this torch build (or PAGEDRS_ONEDNN=0): nothing to compare"
        )
        return 1
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(*shape, generator=g) for name, shape in SHAPES.items()}
    packed = {name: PackedDense(w) for name, w in weights.items()}
    results = []
    for rows in args.rows:
        step = {"f_linear": 0.0, "packed": 0.0}
        for name, w in weights.items():
            x = torch.randn(rows, w.shape[1], generator=g)
            ms = {"f_linear": float("inf"), "packed": float("inf")}
            pk = packed[name]
            calls = {
                "f_linear": lambda x=x, w=w: F.linear(x, w),
                "packed": lambda x=x, pk=pk: pk.matmul(x),
            }
            for _ in range(2):
                for k, fn in calls.items():
                    ms[k] = min(ms[k], low_time(fn, args.iters) * 1e3)
            times = 1 if name == "head" else LAYERS
            for k in step:
                step[k] += ms[k] * times
            results.append({"rows": rows, "matmul": name, **ms, "speedup": ms["f_linear"] / ms["packed"]})
            print(
                f"rows {rows:3d} {name:8s} {w.shape[0]:5d} x {w.shape[1]:4d}: F.linear {ms['f_linear']:8.3f} ms, "
                f"packed {ms['packed']:8.3f} ms = {ms['f_linear'] / ms['packed']:.2f} x"
            )
        print(
            f"rows {rows:3d} per step: F.linear {step['f_linear']:.1f} ms vs packed {step['packed']:.1f} ms "
            f"= {step['f_linear'] / step['packed']:.2f} x"
        )
        results.append({"rows": rows, "matmul": "step", **step, "speedup": step["f_linear"] / step["packed"]})
    if args.json:
        write_json(
            args.json,
            {
                "bench": "cpu_gemm",
                "command": command_line(),
                "threads": args.threads,
                "torch": torch.__version__,
                "results": results,
                **git_info(args.commit),
                **machine_info(),
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
