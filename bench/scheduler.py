"""Scheduler step cost: median wall time of one schedule() + update() round, Python call included.

Cases: 64 / 256 / 1024 / 4096 running decode requests with contexts of 512-2048 tokens, and a
prefill-heavy mix (256 decodes sharing each step with 512-2048-token prompts under a 2048-token
budget). One line per case; `--json PATH` writes {"commit", "command", "cases"}, cases a list of objects
with the keys case, running, median_us (plus p90_us, median_us_arrays, median_us_runner, tokens_per_step);
the commit is --commit, else $PAGEDRS_COMMIT, else `git rev-parse HEAD`, else "unknown".

median_us: schedule() + update() alone. median_us_runner: the persistent-block-table path a runner
takes: every plan array except block_tables, plus block_table_rows, changed_rows and the changed
rows gathered from Scheduler.block_table_view(). median_us_arrays: every array, block_tables (the
padded [B, max_blocks] copy, built lazily) included.

    python bench/scheduler.py [--rounds 300] [--json out.json] [--commit SHA]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import asdict, dataclass

# numpy's BLAS worker threads spin on the 2-core machines this runs on; the scheduler needs none.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
from _common import add_commit_arg, command_line, resolve_commit, write_json

from pagedrs._core import Scheduler, StepPlan

BLOCK_SIZE = 16
ARRAYS = (
    "req_ids",
    "num_scheduled_tokens",
    "num_computed_tokens",
    "num_prompt_tokens",
    "seq_lens",
    "query_start_loc",
    "input_ids",
    "positions",
    "slot_mapping",
    "block_tables",
    "logits_indices",
    "sampled_seq_ids",
    "swap_out",
    "swap_in",
    "copies",
    "block_moves",
    "preempted",
)


@dataclass
class Result:
    case: str
    running: int
    median_us: float
    p90_us: float
    median_us_arrays: float
    median_us_runner: float
    tokens_per_step: float


RUNNER_ARRAYS = tuple(a for a in ARRAYS if a != "block_tables") + ("block_table_rows", "changed_rows")


def _touch(plan: StepPlan, mode: str, view: np.ndarray) -> None:
    """mode "none": read nothing; "all": every array; "runner": the persistent-table path."""
    if mode == "all":
        for name in ARRAYS:
            getattr(plan, name)
    elif mode == "runner":
        for name in RUNNER_ARRAYS:
            getattr(plan, name)
        view[plan.changed_rows]  # the host side of dev_table[changed] = view[changed]


def _prompt(rng: np.random.Generator, lo: int, hi: int) -> np.ndarray:
    return rng.integers(100, 30000, size=int(rng.integers(lo, hi + 1)), dtype=np.int64)


def _decode_scheduler(n: int, rng: np.random.Generator) -> Scheduler:
    """n requests, prefilled until every one is decoding. The pool holds 3072 tokens per request, so
    nothing is preempted while the contexts grow during the run. The large token budget only speeds
    up the prefill; decode steps use n tokens."""
    max_model_len = 4096
    num_blocks = n * 3072 // BLOCK_SIZE + 1024
    s = Scheduler(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=max(n, 65536),
        max_num_seqs=n,
        max_model_len=max_model_len,
        watermark=0.0,
    )
    for i in range(n):
        s.add_request([i], _prompt(rng, 512, 2048), max_tokens=max_model_len, ignore_eos=True)
    while True:
        plan = s.schedule()
        s.update(plan, np.full(len(plan.sampled_seq_ids), 7, dtype=np.int64))
        if plan.num_prefill_tokens == 0 and plan.num_decode_tokens == n:
            return s


def bench_decode(n: int, rounds: int, seed: int) -> Result:
    rng = np.random.default_rng(seed)
    s = _decode_scheduler(n, rng)
    _time_decode(s, n, 10, "none")  # warm-up
    plain: list[float] = []
    arrays: list[float] = []
    runner: list[float] = []
    # Interleave the variants so all see the same context lengths.
    for _ in range(rounds // 10):
        plain += _time_decode(s, n, 10, "none")
        arrays += _time_decode(s, n, 10, "all")
        runner += _time_decode(s, n, 10, "runner")
    return _result(f"decode-{n}", n, plain, arrays, runner, float(n))


def _time_decode(s: Scheduler, n: int, rounds: int, mode: str) -> list[float]:
    sampled = np.full(n, 7, dtype=np.int64)
    view = s.block_table_view()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        plan = s.schedule()
        _touch(plan, mode, view)
        s.update(plan, sampled)
        times.append(time.perf_counter() - t0)
    return times


def bench_prefill_mix(rounds: int, seed: int, running: int = 256) -> Result:
    """256 decodes plus a queue of 512-2048-token prompts under a 2048-token budget."""
    rng = np.random.default_rng(seed)
    s = Scheduler(
        num_blocks=200_000,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=2048,
        max_num_seqs=running + 64,
        max_model_len=4096,
        watermark=0.0,
    )
    next_id = 0

    def add(k: int, max_tokens: int) -> None:
        nonlocal next_id
        for _ in range(k):
            s.add_request([next_id], _prompt(rng, 512, 2048), max_tokens=max_tokens, ignore_eos=True)
            next_id += 1

    add(running, 4096 - 2048)  # long-lived decodes
    for _ in range(400):
        plan = s.schedule()
        s.update(plan, np.full(len(plan.sampled_seq_ids), 7, dtype=np.int64))

    def refill() -> None:
        if s.stats().num_waiting < 4:
            add(4, 8)  # short requests: prefill-dominated

    times: list[float] = []
    arrays: list[float] = []
    runner: list[float] = []
    tokens = 0.0
    for _ in range(rounds // 10):
        t, tok = _time_mix(s, 10, "none", refill)
        times += t
        tokens += tok
        t, _ = _time_mix(s, 10, "all", refill)
        arrays += t
        t, _ = _time_mix(s, 10, "runner", refill)
        runner += t
    return _result("prefill-mix", running, times, arrays, runner, tokens / max(1, rounds // 10))


def _time_mix(s: Scheduler, rounds: int, mode: str, refill) -> tuple[list[float], float]:
    view = s.block_table_view()
    times: list[float] = []
    tokens = 0
    for _ in range(rounds):
        refill()
        t0 = time.perf_counter()
        plan = s.schedule()
        _touch(plan, mode, view)
        sampled = np.full(len(plan.sampled_seq_ids), 7, dtype=np.int64)
        s.update(plan, sampled)
        times.append(time.perf_counter() - t0)
        tokens += plan.num_tokens
    return times, tokens / rounds


def _result(
    case: str, running: int, plain: list[float], arrays: list[float], runner: list[float], tokens: float
) -> Result:
    q = statistics.quantiles(plain, n=10)
    return Result(
        case,
        running,
        round(statistics.median(plain) * 1e6, 1),
        round(q[-1] * 1e6, 1),
        round(statistics.median(arrays) * 1e6, 1),
        round(statistics.median(runner) * 1e6, 1),
        round(tokens, 1),
    )


def main(argv: list[str] | None = None) -> list[Result]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=300, help="timed rounds per case (default 300)")
    ap.add_argument("--cases", default="64,256,1024,4096,mix", help="comma-separated: sizes and/or 'mix'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    add_commit_arg(ap)
    args = ap.parse_args(argv)
    results: list[Result] = []
    for case in args.cases.split(","):
        r = (
            bench_prefill_mix(args.rounds, args.seed)
            if case == "mix"
            else bench_decode(int(case), args.rounds, args.seed)
        )
        results.append(r)
        print(
            f"{r.case:>12}: running={r.running:5d}  schedule+update median {r.median_us:8.1f} us  "
            f"p90 {r.p90_us:8.1f} us  runner path (persistent table) {r.median_us_runner:8.1f} us  "
            f"all arrays incl. padded block_tables {r.median_us_arrays:8.1f} us  "
            f"({r.tokens_per_step:.0f} tokens/step)",
            flush=True,
        )
    if args.json:
        out = {"commit": resolve_commit(args.commit), "command": command_line()}
        write_json(args.json, out | {"cases": [asdict(r) for r in results]})
    return results


if __name__ == "__main__":
    main()
