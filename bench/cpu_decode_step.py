"""The quantized CPU decode step (pagedrs.models.cpu_decode) against the torch modules, in one run.

    python bench/cpu_decode_step.py --threads 1 --batch 1 --json bench/results/cpu-decode-step.json

One engine on the default model (GGUF kept quantized) decodes `--batch` greedy requests; the decode steps
alternate in blocks of `--block` between the fast path and the modules (`LlamaModel.cpu_decode` set to
None), so both see the same machine load and the same context lengths. Reported: mean wall time of one
`LLMEngine.step` per path and their ratio. Both paths give the same bits (tests/models/test_cpu_decode.py).
"""

from __future__ import annotations

import argparse
import time

from _common import add_commit_arg, command_line, git_info, machine_info, write_json

from pagedrs import EngineArgs, LLMEngine, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=8, help="blocks per path")
    p.add_argument("--block", type=int, default=20, help="steps per block")
    p.add_argument("--json", default=None)
    add_commit_arg(p)
    args = p.parse_args()
    import torch  # after pagedrs, which sets the OpenMP spin count torch's libgomp reads when it loads

    torch.set_num_threads(args.threads)
    engine = LLMEngine.from_engine_args(EngineArgs(disable_log_stats=True, cpu_kv_cache_gb=0.5))
    inner = engine.runner.model.model
    fast = inner.cpu_decode
    if fast is None:
        raise SystemExit("the default model did not get the CPU decode step (PAGEDRS_CPU_DECODE=0?)")
    steps = 2 * args.rounds * args.block + 10
    params = SamplingParams(temperature=0, max_tokens=steps + 5, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), [1, 2, 3, 4 + i, 5, 6, 7, 8], params)
    for _ in range(10):  # prefill, warm-up
        engine.step()
    times: dict[str, list[float]] = {"fast": [], "modules": []}
    for _ in range(args.rounds):
        for name, step in (("fast", fast), ("modules", None)):
            inner.cpu_decode = step
            t0 = time.perf_counter()
            for _ in range(args.block):
                engine.step()
            times[name].append((time.perf_counter() - t0) / args.block * 1e3)
    inner.cpu_decode = fast
    mean = {k: sum(v) / len(v) for k, v in times.items()}
    result = {
        "command": command_line(),
        "machine": machine_info(),
        **git_info(args.commit),
        "threads": args.threads,
        "batch": args.batch,
        "ms_per_step": mean,
        "ms_per_step_blocks": times,
        "speedup": mean["modules"] / mean["fast"],
    }
    print(
        f"batch {args.batch}, {args.threads} thread(s): fast {mean['fast']:.2f} ms/step, modules "
        f"{mean['modules']:.2f} ms/step, {result['speedup']:.2f}x"
    )
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
