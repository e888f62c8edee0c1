"""Single-thread timing of the quantized CPU matmul (pagedrs._core.quant_matmul) at small row counts.

    taskset -c 0 env OMP_NUM_THREADS=1 python bench/quant_kernel.py [--n 49152] [--k 576]
        [--types Q4_1,Q8_0] [--rows 1,2,4,6,8,16] [--repeats 7] [--threads 1]

The weight is random bytes with sane f16 scales (the kernels' cost does not depend on the values); x is
random float32. Prints the best-of-repeats and the median time per call, and the best time per activation
row, for each (type, M). The default shape is SmolLM2-135M's tied embedding / LM head (49152 x 576).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from pagedrs import _core

# ggml ids, block length, block bytes, byte offsets of the f16 scale fields.
TYPES = {
    "Q4_0": (2, 32, 18, (0,)),
    "Q4_1": (3, 32, 20, (0, 2)),
    "Q5_0": (6, 32, 22, (0,)),
    "Q5_1": (7, 32, 24, (0, 2)),
    "Q8_0": (8, 32, 34, (0,)),
    "Q4_K": (12, 256, 144, (0, 2)),
    "Q5_K": (13, 256, 176, (0, 2)),
    "Q6_K": (14, 256, 210, (208,)),
}


def weight(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    _, bl, bb, fields = TYPES[name]
    w = rng.integers(0, 256, size=(n, k // bl, bb), dtype=np.uint8)
    scales = (rng.uniform(0.002, 0.05, size=(n, k // bl)).astype(np.float16)).view(np.uint8)
    for at in fields:
        w[:, :, at : at + 2] = scales.reshape(n, k // bl, 2)
    return w.reshape(n, -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=49152)
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--types", default="Q4_1,Q8_0")
    ap.add_argument("--rows", default="1,2,4,6,8,16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"isa {_core.quant_isa()}  N={args.n} K={args.k} threads={args.threads}")
    print(f"{'type':5} {'M':>3} {'best ms':>9} {'median ms':>10} {'ms/row':>8}")
    for name in args.types.split(","):
        w = weight(name, args.n, args.k, rng)
        for m in (int(r) for r in args.rows.split(",")):
            x = rng.standard_normal((m, args.k), dtype=np.float32)
            out = np.empty((m, args.n), dtype=np.float32)
            _core.quant_matmul(x, w, TYPES[name][0], out, num_threads=args.threads)  # warm-up
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                _core.quant_matmul(x, w, TYPES[name][0], out, num_threads=args.threads)
                times.append((time.perf_counter() - t0) * 1e3)
            best, med = min(times), statistics.median(times)
            print(f"{name:5} {m:>3} {best:>9.2f} {med:>10.2f} {best / m:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
