"""What every bench script shares: where its figures came from (the commit, the machine) and how they are
written. Imported by the scripts of this folder as `_common` (a script's own folder is on its path)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

COMMIT_ENV = "PAGEDRS_COMMIT"
BENCH_DIR = Path(__file__).resolve().parent


def add_commit_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--commit",
        default=None,
        metavar="SHA",
        help=f"the commit these figures belong to (default: ${COMMIT_ENV}, else `git rev-parse HEAD` of this "
        "checkout, else 'unknown'); for a copy of the code without its git repository",
    )


def explicit_commit(cli: str | None = None) -> str | None:
    """--commit, else $PAGEDRS_COMMIT, else None."""
    for value in (cli, os.environ.get(COMMIT_ENV)):
        if value and value.strip():
            return value.strip()
    return None


def resolve_commit(cli: str | None = None) -> str:
    """--commit, else $PAGEDRS_COMMIT, else the checkout's HEAD, else "unknown"."""
    explicit = explicit_commit(cli)
    if explicit:
        return explicit
    head = (_git("rev-parse", "HEAD") or "").strip()
    return head or "unknown"


def git_info(commit: str | None = None) -> dict[str, Any]:
    """The commit (as resolve_commit gives it) and, where this is a git checkout, its uncommitted changes."""
    info: dict[str, Any] = {"commit": resolve_commit(commit)}
    status = _git("status", "--porcelain")
    if status is not None:
        changed = [ln for ln in status.splitlines() if ln.strip()]
        info["dirty"] = bool(changed)
        info["changes"] = changed[:50]
    return info


def _git(*args: str) -> str | None:
    """stdout of a git command run in this folder, or None where git or the repository is missing."""
    try:
        out = subprocess.run(["git", "-C", str(BENCH_DIR), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    if hasattr(os, "sched_getaffinity"):
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    return info


def command_line() -> str:
    """How this script was started, as a shell line."""
    return shlex.join(["python", Path(sys.argv[0]).as_posix(), *sys.argv[1:]])


def json_safe(obj: Any) -> Any:
    """obj with NaN and infinities as None (strict JSON has neither)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json(path: str | Path, obj: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(obj), indent=2, allow_nan=False) + "\n")


def low_time(fn: Callable[[], object], iters: int) -> float:
    """Seconds per call of `fn`: the 10th percentile of `iters` timed calls after two warm-up calls (the
    fastest runs, short of outliers: what the code costs when the machine leaves it alone)."""
    fn()
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 10]


def decode_tok_s(
    engine_args: Any,
    prompts: list[list[int]],
    max_tokens: int,
    check: Callable[[Any], None] | None = None,
) -> float:
    """Decode tok/s of the engine `engine_args` builds (`check` sees it first): the prompts added at once,
    `max_tokens` greedy tokens each (EOS ignored), timed from the step after the prompts' first step."""
    from pagedrs import LLMEngine, SamplingParams

    engine = LLMEngine.from_engine_args(engine_args)
    if check is not None:
        check(engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    engine.step()  # the prompts
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return len(prompts) * steps / (time.perf_counter() - t0)
