"""Serving benchmark: Poisson arrivals at several rates through the OpenAI HTTP API (loopback only).

    python bench/serving.py --rates 0.5,1,2 --num-requests 16 --max-tokens 32 \
        --json bench/results/serving.json --plot bench/results/serving.png

Starts `python -m pagedrs.entrypoints.openai.api_server` on 127.0.0.1 (a free port) unless
--base-url names a running one (it must be a loopback address). Each rate sends a bounded number
of streaming completions with exponential gaps, then waits for them all; it measures TTFT, TPOT
(per request: (e2e - ttft) / (output tokens - 1)), ITL (gaps between streamed chunks) and
end-to-end latency (p50/p90/p99), request and output-token throughput, and checks
completed + failed == sent.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import numpy as np

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle stays upright while moving.",
    "List three facts about the planet Mars.",
    "What is the difference between weather and climate?",
    "Describe the taste of a ripe mango to someone who has never had one.",
    "Give me a recipe for a simple tomato soup.",
    "Why is the sky blue? Answer in two sentences.",
    "Summarize the plot of a heist movie you would like to see.",
]


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def _check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(f"--base-url must be a loopback address (127.0.0.0/8, ::1, localhost), got {host!r}")


async def one_request(client: httpx.AsyncClient, body: dict[str, Any]) -> Result:
    start = time.perf_counter()
    first = last = None
    itl: list[float] = []
    tokens = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return Result(False, error=f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    return Result(False, error=str(data["error"])[:200])
                if data.get("usage"):
                    tokens = int(data["usage"]["completion_tokens"])
                if any(c.get("text") for c in data.get("choices", [])):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        itl.append(now - last)  # type: ignore[operator]
                    last = now
    except (httpx.HTTPError, ValueError) as exc:
        return Result(False, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    if first is None:
        return Result(False, error="no tokens streamed")
    return Result(True, ttft=first - start, e2e=end - start, output_tokens=tokens, itl=itl)


async def run_rate(
    base_url: str,
    api_key: str | None,
    rate: float,
    num: int,
    max_tokens: int,
    rng: random.Random,
    model: str | None,
) -> tuple[list[Result], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=num + 4, max_keepalive_connections=num + 4)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=600, limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for i in range(num):
            body = {
                "prompt": rng.choice(PROMPTS),
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if model:
                body["model"] = model
            tasks.append(asyncio.create_task(one_request(client, body)))
            if i + 1 < num:
                await asyncio.sleep(rng.expovariate(rate))
        results = list(await asyncio.gather(*tasks))
        return results, time.perf_counter() - start


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000.0 if values else float("nan")


def summarize(rate: float, results: list[Result], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    e2e = [r.e2e for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    out_tokens = sum(r.output_tokens for r in ok)
    row: dict[str, Any] = {
        "rate": rate,
        "sent": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
    }
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}_ms"] = _pct(vals, q)
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        row["errors"] = errors[:5]
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'rate':>6} {'done':>5} {'fail':>4} {'req/s':>6} {'tok/s':>7} | {'TTFT p50':>8} {'p90':>7} "
        f"{'p99':>7} | {'TPOT p50':>8} {'p90':>6} {'p99':>6} | {'ITL p50':>7} {'p90':>6} {'p99':>6} | "
        f"{'E2E p50':>7} {'p90':>7} {'p99':>7}   (ms)"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['rate']:>6.2f} {r['completed']:>5} {r['failed']:>4} {r['request_throughput']:>6.2f} "
            f"{r['output_token_throughput']:>7.1f} | {r['ttft_p50_ms']:>8.0f} {r['ttft_p90_ms']:>7.0f} "
            f"{r['ttft_p99_ms']:>7.0f} | {r['tpot_p50_ms']:>8.1f} {r['tpot_p90_ms']:>6.1f} "
            f"{r['tpot_p99_ms']:>6.1f} | {r['itl_p50_ms']:>7.1f} {r['itl_p90_ms']:>6.1f} "
            f"{r['itl_p99_ms']:>6.1f} | {r['e2e_p50_ms']:>7.0f} {r['e2e_p90_ms']:>7.0f} "
            f"{r['e2e_p99_ms']:>7.0f}"
        )


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["rate"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (
        ("ttft_p50_ms", "TTFT p50"),
        ("ttft_p99_ms", "TTFT p99"),
        ("e2e_p50_ms", "E2E p50"),
        ("e2e_p99_ms", "E2E p99"),
    ):
        ax1.plot(rates, [r[key] for r in rows], marker="o", label=label)
    for key, label in (
        ("tpot_p50_ms", "TPOT p50"),
        ("tpot_p99_ms", "TPOT p99"),
        ("itl_p50_ms", "ITL p50"),
        ("itl_p99_ms", "ITL p99"),
    ):
        ax2.plot(rates, [r[key] for r in rows], marker="o", label=label)
    for ax, title in ((ax1, "request latency"), (ax2, "per-token latency")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("arrival rate (req/s, Poisson)")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("pagedrs serving: latency vs request rate")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(server_args: list[str], log_path: str, data_dir: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "pagedrs.entrypoints.openai.api_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--data-dir",
        data_dir,
        *server_args,
    ]
    log = open(log_path, "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server did not start in time; see {log_path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server (loopback only); default: start one")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.add_argument("--rates", default="0.5,1,2,4", help="comma-separated request rates (req/s)")
    p.add_argument("--num-requests", type=int, default=16, help="requests per rate")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (ignore_eos)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a PNG of latency vs rate here")
    p.add_argument(
        "--server-log",
        default=os.path.join(tempfile.gettempdir(), "pagedrs-serving-bench.log"),
        help="the started server's output (default: in the temp dir)",
    )
    p.add_argument(
        "server_args",
        nargs=argparse.REMAINDER,
        help="after `--`: flags for the server this script starts (e.g. -- --device cpu)",
    )
    args = p.parse_args(argv)
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    if not rates or any(r <= 0 for r in rates) or args.num_requests < 1:
        raise SystemExit("--rates must be positive and --num-requests >= 1")
    server_args = [a for a in args.server_args if a != "--"]

    proc = None
    data_dir = None
    if args.base_url:
        _check_loopback(args.base_url)
        url = args.base_url.rstrip("/")
    else:
        data_dir = tempfile.mkdtemp(prefix="pagedrs-bench-")
        proc, url = start_server(server_args, args.server_log, data_dir)
    rows = []
    served = None
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        models = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json().get("data", [])
        served = models[0]["id"] if models else None
        rng = random.Random(args.seed)
        # one warm-up request (not counted): first-call costs are not a rate's latency
        asyncio.run(run_rate(url, args.api_key, 1.0, 1, 4, random.Random(0), args.model))
        for rate in rates:
            results, duration = asyncio.run(
                run_rate(url, args.api_key, rate, args.num_requests, args.max_tokens, rng, args.model)
            )
            row = summarize(rate, results, duration)
            assert row["completed"] + row["failed"] == row["sent"] == args.num_requests
            rows.append(row)
            print(f"rate {rate:g} req/s: {row['completed']}/{row['sent']} completed", file=sys.stderr)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        if data_dir is not None:
            shutil.rmtree(data_dir, ignore_errors=True)
    print_table(rows)
    sent = sum(r["sent"] for r in rows)
    completed = sum(r["completed"] for r in rows)
    failed = sum(r["failed"] for r in rows)
    best = max(rows, key=lambda r: r["output_token_throughput"])
    print(
        f"serving: {completed}/{sent} completed, {failed} failed over {len(rows)} rates; "
        f"peak {best['output_token_throughput']:.1f} output tok/s at {best['rate']:g} req/s "
        f"(TTFT p99 {best['ttft_p99_ms']:.0f} ms, TPOT p50 {best['tpot_p50_ms']:.1f} ms)"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {
                    "sent": sent,
                    "completed": completed,
                    "failed": failed,
                    "model": served,
                    "num_requests_per_rate": args.num_requests,
                    "max_tokens": args.max_tokens,
                    "server_args": server_args,
                    "cpu_count": os.cpu_count(),
                    "rates": rows,
                },
                f,
                indent=2,
            )
    if args.plot:
        plot(rows, args.plot)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
