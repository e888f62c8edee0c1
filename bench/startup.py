"""Start-up time: how long until a model answers, side by side with the peers, each in a fresh process.

    python bench/startup.py                                   # the default model, 3 rounds
    python bench/startup.py --llama-server /path/to/llama-server --json bench/results/startup-cpu.json

Per round, each in a process of its own (imports included, as a user starts it):
- `pagedrs serve`: seconds from the command to the first `GET /health` 200 (the engine core has loaded the
  model and the port is open), then SIGTERM;
- `LLM(model)`: seconds from `python -c` to the constructed `LLM` (offline start);
- HF transformers: `AutoModelForCausalLM.from_pretrained` of the same model plus its tokenizer (for a GGUF
  file, transformers' own GGUF loader, which dequantizes to float32);
- llama.cpp's `llama-server` on the same GGUF file (with `--llama-server PATH`): seconds to `/health` 200.
The rounds alternate between the engines; the report gives each one's median and its ratio to pagedrs serve.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import Any

from _common import add_commit_arg, command_line, git_info, machine_info, write_json


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _time_to_health(cmd: list[str], port: int, timeout: float) -> float:
    """Seconds from starting `cmd` to its first /health 200; the process group is ended either way."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode} before answering /health")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"{cmd[0]} did not answer /health within {timeout:.0f} s")
    finally:
        with_group(proc, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with_group(proc, signal.SIGKILL)
            proc.wait()


def with_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _time_python(code: str, timeout: float) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, timeout=timeout, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def _default_model() -> str:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from pagedrs.loader.default_model import default_model_path as f; print(f())",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def _hf_code(model: str) -> str:
    if model.lower().endswith(".gguf"):
        folder, name = os.path.split(model)
        args = f"{folder!r}, gguf_file={name!r}"
    else:
        args = repr(model)
    return (
        "import transformers as t\n"
        f"t.AutoTokenizer.from_pretrained({args})\n"
        f"t.AutoModelForCausalLM.from_pretrained({args}, dtype='float32')\n"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path (default: the embedded default model)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one start may take")
    p.add_argument("--llama-server", default=None, metavar="PATH", help="llama.cpp's llama-server binary")
    p.add_argument("--no-hf", action="store_true", help="leave out the HF transformers load")
    p.add_argument("--json", default=None, help="write the figures here")
    add_commit_arg(p)
    args = p.parse_args()
    model = args.model or _default_model()
    engines: dict[str, Any] = {
        "pagedrs serve": lambda port: _time_to_health(
            ["pagedrs", "serve", "--model", model, "--port", str(port)], port, args.timeout
        ),
        "pagedrs LLM()": lambda port: _time_python(
            f"from pagedrs import LLM\nLLM({model!r}).shutdown()", args.timeout
        ),
    }
    if not args.no_hf:
        engines["HF transformers"] = lambda port: _time_python(_hf_code(model), args.timeout)
    if args.llama_server:
        if not model.lower().endswith(".gguf"):
            p.error("--llama-server needs a .gguf --model")
        engines["llama-server"] = lambda port: _time_to_health(
            [args.llama_server, "-m", model, "--port", str(port), "-t", str(os.cpu_count() or 1)],
            port,
            args.timeout,
        )
    times: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, run in engines.items():
            times[name].append(run(_free_port()))
            print(f"round {r + 1}: {name}: {times[name][-1]:.2f} s", flush=True)
    base = statistics.median(times["pagedrs serve"])
    rows = {
        name: {
            "median_s": statistics.median(ts),
            "runs_s": ts,
            "ratio_to_pagedrs_serve": statistics.median(ts) / base,
        }
        for name, ts in times.items()
    }
    print(f"\n{'engine':<18}{'median s':>10}{'x pagedrs serve':>17}")
    for name, row in rows.items():
        print(f"{name:<18}{row['median_s']:>10.2f}{row['ratio_to_pagedrs_serve']:>17.2f}")
    if args.json:
        write_json(
            args.json,
            {
                "bench": "startup",
                "command": command_line(),
                "date": time.strftime("%Y-%m-%d"),
                "model": model,
                "machine": machine_info(),
                **git_info(args.commit),
                "results": rows,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
