"""Single-thread timing of the quantized CPU matmul (pagedrs._core.quant_matmul) at small row counts.

    taskset -c 0 env OMP_NUM_THREADS=1 python bench/quant_kernel.py [--n 49152] [--k 576]
        [--types Q4_1,Q8_0] [--rows 1,2,4,6,8,16] [--repeats 7] [--threads 1]
    python bench/quant_kernel.py --types Q4_1 --n 3072 --x8      # also the 8-row interleaved layout
    python bench/quant_kernel.py --types Q4_K,Q6_K,Q5_0 --n 8960 --k 1536 --rows 1,16 --x8 --threads 2
    python bench/quant_kernel.py --types Q4_1,Q8_0 --x8-only --isas avx2,avx512-vnni --threads 2


The weight is random bytes with sane f16 scales (the kernels' cost does not depend on the values); x is
random float32. Prints the best-of-repeats and the median time per call, and the best time per activation
row, for each (type, M). The default shape is SmolLM2-135M's tied embedding / LM head (49152 x 576).
With --x8, the types with an x8 layout (not Q2_K, Q3_K, IQ4_NL, IQ4_XS) also run in the layout the
loader repacks them into (`_core.quant_pack_x8`), the two layouts' calls alternating within each repeat
(same machine load), with the ratio file / x8.
With --isas A,B each layout also runs on both kernel sets (`_core.quant_isa()` names), alternating
the same way, with the ratio A / B (they give the same bits; this is only their speed).
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
    "Q2_K": (10, 256, 84, (80, 82)),
    "Q3_K": (11, 256, 110, (108,)),
    "Q4_K": (12, 256, 144, (0, 2)),
    "Q5_K": (13, 256, 176, (0, 2)),
    "Q6_K": (14, 256, 210, (208,)),
    "IQ4_NL": (20, 32, 18, (0,)),
    "IQ4_XS": (23, 256, 136, (0,)),
}
# Types with no x8 layout: --x8 times them in the file's only.
NO_X8 = {"Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"}


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
    ap.add_argument("--x8", action="store_true", help="also time the x8 layout")
    ap.add_argument("--x8-only", action="store_true", help="only the x8 layout")
    ap.add_argument("--isas", default=None, help="two kernel sets to compare, e.g. avx2,avx512-vnni")
    args = ap.parse_args()
    isas = args.isas.split(",") if args.isas else [None]
    if len(isas) > 2:
        ap.error("--isas takes two names")
    rng = np.random.default_rng(0)
    print(f"isa {_core.quant_isa()}  N={args.n} K={args.k} threads={args.threads}")
    print(f"{'type':5} {'layout':6} {'M':>3} {'best ms':>9} {'median ms':>10} {'ms/row':>8}")
    for name in args.types.split(","):
        qid = TYPES[name][0]
        w = weight(name, args.n, args.k, rng)
        layouts = [] if args.x8_only else [("file", w, False)]
        if (args.x8 or args.x8_only) and name not in NO_X8:
            layouts.append(("x8", _core.quant_pack_x8(w, qid), True))
        runs = [
            (f"{lay}" + (f"/{isa}" if isa else ""), data, packed, isa)
            for lay, data, packed in layouts
            for isa in isas
        ]
        for m in (int(r) for r in args.rows.split(",")):
            x = rng.standard_normal((m, args.k), dtype=np.float32)
            out = np.empty((m, args.n), dtype=np.float32)
            times: dict[str, list[float]] = {label: [] for label, *_ in runs}
            for _, data, packed, isa in runs:  # warm-up
                _core.quant_matmul(x, data, qid, out, 0, args.threads, packed, isa)
            for _ in range(args.repeats):
                for label, data, packed, isa in runs:
                    t0 = time.perf_counter()
                    _core.quant_matmul(x, data, qid, out, 0, args.threads, packed, isa)
                    times[label].append((time.perf_counter() - t0) * 1e3)
            for label, ts in times.items():
                best, med = min(ts), statistics.median(ts)
                print(f"{name:5} {label:6} {m:>3} {best:>9.2f} {med:>10.2f} {best / m:>8.2f}", flush=True)
            if len(isas) == 2:
                for lay, *_ in layouts:
                    a, b = min(times[f"{lay}/{isas[0]}"]), min(times[f"{lay}/{isas[1]}"])
                    print(f"{name:5} {lay} {isas[0]}/{isas[1]} {m:>2} {a / b:.2f}x", flush=True)
            elif len(times) == 2:
                print(f"{name:5} file/x8 {m:>2} {min(times['file']) / min(times['x8']):.2f}x", flush=True)


if __name__ == "__main__":
    main()
