r"""Serving benchmark through the OpenAI HTTP API (loopback only): Poisson arrivals at several rates, or
saturation (a fixed number of requests in flight), optionally against the offline `LLM.generate` baseline.

    # Poisson arrivals at several rates, --num-requests per rate
    python bench/serving.py --rates 0.5,1,2 --num-requests 16 --max-tokens 32 \
        --json bench/results/serving.json --plot bench/results/serving.png
    # saturation: at most 32 requests in flight, 64 in all; the same 64 requests offline first
    python bench/serving.py --offline-baseline --max-concurrency 32 --num-requests 64 --max-tokens 32 \
        --profile --json /tmp/sat.json --plot /tmp/sat.png
    # flags after `--` go to the server this script starts (and to the offline engine)
    python bench/serving.py --rates inf --num-requests 64 -- --device cpu --max-num-seqs 64

Starts `python -m pagedrs.entrypoints.openai.api_server` on 127.0.0.1 (a free port, its own process
group, always stopped at the end, Ctrl-C and errors included) unless --base-url names a running one (it
must be a loopback address). Requests are streaming `/v1/completions`, greedy, `ignore_eos`, exactly
--max-tokens output tokens each; the prompts are drawn once (--seed) and every rate sends the same ones.

Modes, per entry of --rates (req/s; `inf` = no gaps):
  * a finite rate without --max-concurrency: --num-requests requests with exponential gaps (Poisson);
  * `inf` (the default when --max-concurrency is given): all requests are sent at once or, with
    --max-concurrency C, each as soon as one of C slots frees up (saturation); a finite rate with
    --max-concurrency keeps its Poisson gaps but never has more than C in flight.

Measured per rate: TTFT, TPOT (per request: (e2e - ttft) / (output tokens - 1)), ITL (gaps between
streamed chunks) and end-to-end latency (mean, p50/p90/p99), request and output-token throughput (from the
first request sent to the last one done), and completed + failed == sent.

--offline-baseline runs the same prompts (same max_tokens, ignore_eos, greedy) through
`pagedrs.LLM(**engine flags).generate(...)` in a separate Python process before the server starts, with the
engine flags given to the server (parsed by the server's own parser), after a tiny warm-up generate; only
the timed generate call counts. serving efficiency = server output tok/s (the best saturation entry; the
best entry if there is none) / offline output tok/s.

--profile scrapes the server's /metrics (Prometheus text) before and after each rate and reports the
means (sum / count over that interval) of the step histograms pagedrs:engine_step_seconds,
pagedrs:output_send_seconds and pagedrs:frontend_step_seconds where the server exposes them, with the
mean engine step time next to the mean TPOT.

Every HTTP call, the server start and the offline process have bounded timeouts. Imports only the installed
`pagedrs` package (in the offline process and through the server it starts).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import ipaddress
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
from _common import add_commit_arg, git_info, json_safe, machine_info

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

# Step histograms the server may expose (seconds): name -> what one observation is.
STEP_HISTOGRAMS = {
    "pagedrs:engine_step_seconds": "engine core wall time per step",
    "pagedrs:output_send_seconds": "engine core encoding + sending one step's output",
    "pagedrs:frontend_step_seconds": "API server processing one step message",
}

OFFLINE_WORKER_FLAG = "--_offline-worker"


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    usage_missing: bool = False  # no usage chunk: output_tokens inferred (see one_request)


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


def _entry_label(row: dict[str, Any]) -> str:
    conc = row.get("max_concurrency")
    rate = "rate inf" if row["rate"] == "inf" else f"{row['rate']:g} req/s"
    return f"{rate}, concurrency {conc}" if conc else rate


class HTTPError(Exception):
    """The server could not be reached, or answered something that is not HTTP."""


# Loopback only: never through a proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str, headers: dict[str, str] | None = None, timeout: float = 30.0) -> tuple[int, str]:
    """GET with a bounded timeout: (status, body text); HTTPError when there is no HTTP answer."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return int(resp.status), resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise HTTPError(f"{type(exc).__name__}: {exc}") from exc


def http_post_json(url: str, body: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    """POST a JSON body, the JSON answer back (urllib's errors on a failed request)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with _OPENER.open(req, timeout=timeout) as resp:
        return dict(json.loads(resp.read()))


async def _post_lines(
    base_url: str, path: str, headers: dict[str, str], body: bytes
) -> AsyncIterator[tuple[int, str]]:
    """POST on a fresh HTTP/1.1 connection; yields (status, line) for each line of the (chunked or
    plain) response body. The caller bounds the whole exchange (asyncio.wait_for)."""
    url = urlparse(base_url)
    if url.scheme != "http":
        raise HTTPError(f"only http:// is supported, got {base_url!r}")
    reader, writer = await asyncio.open_connection(url.hostname, url.port or 80)
    try:
        head = [
            f"POST {url.path.rstrip('/')}{path} HTTP/1.1",
            f"Host: {url.netloc}",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
            "Accept: text/event-stream",
            "Connection: close",
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        await writer.drain()
        status_line = (await reader.readline()).decode("latin-1").split()
        if len(status_line) < 2 or not status_line[0].startswith("HTTP/"):
            raise HTTPError(f"not an HTTP answer: {' '.join(status_line)[:100]!r}")
        status = int(status_line[1])
        resp_headers: dict[str, str] = {}
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            key, _, value = line.decode("latin-1").partition(":")
            resp_headers[key.strip().lower()] = value.strip()

        async def raw() -> AsyncIterator[bytes]:
            if "chunked" in resp_headers.get("transfer-encoding", "").lower():
                while True:
                    size_line = await reader.readline()
                    if not size_line:
                        raise HTTPError("connection closed inside a chunked body")
                    size = int(size_line.split(b";")[0].strip(), 16)
                    if size == 0:
                        return
                    yield await reader.readexactly(size)
                    await reader.readexactly(2)  # the chunk's CRLF
            elif "content-length" in resp_headers:
                yield await reader.readexactly(int(resp_headers["content-length"]))
            else:
                while data := await reader.read(65536):
                    yield data

        pending = b""
        async for data in raw():
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield status, line.rstrip(b"\r").decode("utf-8", "replace")
        if pending:
            yield status, pending.rstrip(b"\r").decode("utf-8", "replace")
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def one_request(base_url: str, headers: dict[str, str], body: dict[str, Any]) -> Result:
    start = time.perf_counter()
    first = last = None
    itl: list[float] = []
    tokens: int | None = None
    chunks = 0
    finish = None
    try:
        status = 0
        error_text: list[str] = []
        stream = _post_lines(base_url, "/v1/completions", headers, json.dumps(body).encode())
        async with contextlib.aclosing(stream):  # the connection closes on an early return too
            async for status, line in stream:
                if status != 200:
                    error_text.append(line)
                    continue
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    return Result(False, error=str(data["error"])[:200])
                if data.get("usage"):
                    tokens = int(data["usage"]["completion_tokens"])
                for c in data.get("choices", []):
                    finish = c.get("finish_reason") or finish
                if any(c.get("text") for c in data.get("choices", [])):
                    chunks += 1
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        itl.append(now - last)  # type: ignore[operator]
                    last = now
        if status != 200:
            return Result(False, error=f"HTTP {status}: {' '.join(error_text)[:200]!r}")
    except (HTTPError, OSError, EOFError, ValueError) as exc:  # EOFError: asyncio.IncompleteReadError
        return Result(False, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    if first is None:
        return Result(False, error="no tokens streamed")
    missing = tokens is None
    if tokens is None:
        # no usage chunk (stream_options.include_usage ignored): with ignore_eos, finish_reason "length"
        # means exactly max_tokens; otherwise the text chunks are a lower bound
        tokens = int(body["max_tokens"]) if finish == "length" else chunks
    return Result(
        True, ttft=first - start, e2e=end - start, output_tokens=tokens, itl=itl, usage_missing=missing
    )


async def run_rate(
    base_url: str,
    api_key: str | None,
    rate: float,
    prompts: list[str],
    max_tokens: int,
    rng: random.Random,
    model: str | None,
    max_concurrency: int | None = None,
    request_timeout: float = 600.0,
) -> tuple[list[Result], float, int]:
    """Send one request per prompt (each on its own connection): exponential gaps at a finite rate, none
    at `inf`; never more than `max_concurrency` in flight when given. Returns the results, the duration
    (first send to last done) and the most requests seen in flight at once."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    num = len(prompts)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    in_flight = peak = 0

    async def run_one(body: dict[str, Any]) -> Result:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            # the whole streamed request is bounded, connect included
            return await asyncio.wait_for(one_request(base_url, headers, body), request_timeout)
        except asyncio.TimeoutError:
            return Result(False, error=f"timed out after {request_timeout:g} s")
        finally:
            in_flight -= 1
            if slots is not None:
                slots.release()

    tasks = []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if model:
            body["model"] = model
        if slots is not None:
            await slots.acquire()
        tasks.append(asyncio.create_task(run_one(body)))
        if math.isfinite(rate) and i + 1 < num:
            await asyncio.sleep(rng.expovariate(rate))
    results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - start, peak


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000.0 if values else float("nan")


def summarize(
    rate: float, results: list[Result], duration: float, max_concurrency: int | None = None, peak: int = 0
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    e2e = [r.e2e for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    out_tokens = sum(r.output_tokens for r in ok)
    saturation = math.isinf(rate) or max_concurrency is not None
    row: dict[str, Any] = {
        "rate": "inf" if math.isinf(rate) else rate,
        "max_concurrency": max_concurrency,
        "mode": "saturation" if saturation else "poisson",
        "sent": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "peak_in_flight": peak,
        "duration_s": duration,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
    }
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        row[f"{name}_mean_ms"] = float(np.mean(vals)) * 1000.0 if vals else float("nan")
        for q in (50, 90, 99):
            row[f"{name}_p{q}_ms"] = _pct(vals, q)
    missing = sum(r.usage_missing for r in ok)
    if missing:
        row["usage_missing"] = missing
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        row["errors"] = errors[:5]
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'rate':>6} {'conc':>4} {'done':>5} {'fail':>4} {'req/s':>6} {'tok/s':>7} | {'TTFT p50':>8} "
        f"{'p90':>7} {'p99':>7} | {'TPOT p50':>8} {'p90':>6} {'p99':>6} | {'ITL p50':>7} {'p90':>6} "
        f"{'p99':>6} | {'E2E p50':>7} {'p90':>7} {'p99':>7}   (ms)"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        rate = r["rate"] if r["rate"] == "inf" else f"{r['rate']:.2f}"
        conc = r["max_concurrency"] or "-"
        print(
            f"{rate:>6} {conc:>4} {r['completed']:>5} {r['failed']:>4} {r['request_throughput']:>6.2f} "
            f"{r['output_token_throughput']:>7.1f} | {r['ttft_p50_ms']:>8.0f} {r['ttft_p90_ms']:>7.0f} "
            f"{r['ttft_p99_ms']:>7.0f} | {r['tpot_p50_ms']:>8.1f} {r['tpot_p90_ms']:>6.1f} "
            f"{r['tpot_p99_ms']:>6.1f} | {r['itl_p50_ms']:>7.1f} {r['itl_p90_ms']:>6.1f} "
            f"{r['itl_p99_ms']:>6.1f} | {r['e2e_p50_ms']:>7.0f} {r['e2e_p90_ms']:>7.0f} "
            f"{r['e2e_p99_ms']:>7.0f}"
        )


def _plot_rates(plt: Any, rows: list[dict[str, Any]]) -> Any:
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
    return fig


def _plot_bars(plt: Any, rows: list[dict[str, Any]], summary: str) -> Any:
    """Grouped bars of p50/p90/p99 per metric, one group of bars per entry (saturation runs)."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    width = 0.8 / (3 * len(rows))
    for ax, metrics, title in (
        (axes[0], ("ttft", "e2e"), "request latency"),
        (axes[1], ("tpot", "itl"), "per-token latency"),
    ):
        for j, row in enumerate(rows):
            for k, q in enumerate((50, 90, 99)):
                offset = (j * 3 + k) * width - 0.4 + width / 2
                vals = [row[f"{m}_p{q}_ms"] for m in metrics]
                bars = ax.bar(
                    [i + offset for i in range(len(metrics))],
                    vals,
                    width,
                    label=f"p{q}" + (f" ({_entry_label(row)})" if len(rows) > 1 else ""),
                    color=f"C{j * 3 + k}",
                )
                ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(metrics)), [m.upper() for m in metrics])
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    label = "; ".join(
        f"{_entry_label(r)}: {r['output_token_throughput']:.1f} out tok/s, {r['completed']}/{r['sent']} done"
        for r in rows
    )
    fig.suptitle(f"pagedrs serving: {label}\n{summary}", fontsize=9)
    return fig


def plot(rows: list[dict[str, Any]], path: str, summary: str = "") -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if all(r["mode"] == "poisson" for r in rows):
        fig = _plot_rates(plt, rows)
    else:
        fig = _plot_bars(plt, rows, summary)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM to the process group this script started (the process and any children it made), then
    SIGKILL to what is left after `grace` seconds."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def start_server(
    server_args: list[str], log_path: str, data_dir: str, start_timeout: float
) -> tuple[subprocess.Popen[bytes], str]:
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
    return launch_and_wait(cmd, port, log_path, start_timeout, "server")


def launch_and_wait(
    cmd: list[str], port: int, log_path: str, timeout: float, name: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """Start `cmd` (a server on loopback `port`, output to `log_path`, environment `env` or this one's) and
    wait until its /health answers 200; (process, base url). SystemExit naming `name` if it exits or does
    not come up in time."""
    with open(log_path, "wb") as log:
        # its own session: Ctrl-C in the terminal reaches only this script, which stops the whole group
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"{name} exited with {proc.returncode}; see {log_path}")
            try:
                if http_get(f"{url}/health", timeout=2)[0] == 200:
                    return proc, url
            except HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{name} did not start in {timeout:g} s; see {log_path}")
    except BaseException:
        stop_process_group(proc, 5)
        raise


# --- the offline baseline (a separate process) -------------------------------------------------------


def offline_worker(spec_path: str) -> int:
    """`serving.py --_offline-worker SPEC.json`: LLM(**engine flags).generate over the spec's prompts;
    writes the timings to the spec's `out` path."""
    import dataclasses

    with open(spec_path) as f:
        spec = json.load(f)
    from pagedrs import LLM, EngineArgs, SamplingParams
    from pagedrs.entrypoints.cli_args import engine_kwargs, make_serve_parser

    kwargs = engine_kwargs(make_serve_parser().parse_args(spec["server_args"]))
    if hasattr(EngineArgs, "field_names"):
        known = set(EngineArgs.field_names())
    else:
        known = {f.name for f in dataclasses.fields(EngineArgs)}
    dropped = sorted(k for k in kwargs if k not in known)
    if dropped:
        print(f"offline baseline: the engine does not take {dropped}; left out", file=sys.stderr)
    kwargs = {k: v for k, v in kwargs.items() if k in known}
    prompts: list[str] = spec["prompts"]

    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t0
    warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    llm.generate(prompts[:1], warm, use_tqdm=False)
    params = SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True, temperature=0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    duration = time.perf_counter() - t0

    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    engine = getattr(llm, "llm_engine", None)
    device = getattr(engine, "device", None)
    if device is None:  # the engine's config, where it keeps one
        device = getattr(getattr(getattr(engine, "config", None), "device", None), "device", None)
    device = str(device) if device is not None else None
    info: dict[str, Any] = {
        "engine_kwargs": kwargs,
        "dropped_engine_kwargs": dropped,
        "model": getattr(engine, "model_name", None),
        "device": device,
        "load_s": load_s,
        "num_requests": len(prompts),
        "output_tokens": tokens,
        "expected_output_tokens": len(prompts) * spec["max_tokens"],
        "duration_s": duration,
        "request_throughput": len(prompts) / duration,
        "output_token_throughput": tokens / duration,
    }
    try:
        import torch

        info["torch_version"] = torch.__version__
        info["torch_num_threads"] = torch.get_num_threads()
        if device and device.startswith("cuda"):
            info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    except Exception as exc:  # informational only
        info["torch_error"] = repr(exc)
    with open(spec["out"], "w") as f:
        json.dump(info, f)
    return 0


def run_offline_baseline(
    prompts: list[str], max_tokens: int, server_args: list[str], timeout: float, log_path: str
) -> dict[str, Any]:
    """Runs offline_worker in a separate Python process (its own process group, killed on timeout or
    Ctrl-C); returns its result, or {"error": ...}."""
    with tempfile.TemporaryDirectory(prefix="pagedrs-offline-") as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        out_path = os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump(
                {"prompts": prompts, "max_tokens": max_tokens, "server_args": server_args, "out": out_path}, f
            )
        cmd = [sys.executable, os.path.abspath(__file__), OFFLINE_WORKER_FLAG, spec_path]
        start = time.monotonic()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"offline baseline timed out after {timeout:g} s; see {log_path}"}
        finally:
            stop_process_group(proc, 5)
        if rc != 0 or not os.path.exists(out_path):
            tail = Path(log_path).read_text(errors="replace").strip().splitlines()[-5:]
            return {"error": f"offline baseline exited with {rc}; see {log_path}: " + " | ".join(tail)}
        with open(out_path) as f:
            result: dict[str, Any] = json.load(f)
        result["wall_s"] = time.monotonic() - start
        return result


# --- /metrics ----------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LE = re.compile(r'(?:^|,)\s*le="(?P<le>[^"]*)"')


def scrape_metrics(base_url: str, api_key: str | None, timeout: float = 30.0) -> dict[str, Any] | None:
    """The step histograms from /metrics, summed over label sets: {name: {"sum", "count", "buckets"}};
    None when /metrics cannot be read."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        status, text = http_get(f"{base_url}/metrics", headers=headers, timeout=timeout)
    except HTTPError as exc:
        print(f"profile: /metrics: {exc}", file=sys.stderr)
        return None
    if status != 200:
        print(f"profile: /metrics answered HTTP {status}", file=sys.stderr)
        return None
    found: dict[str, Any] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name = m.group("name")
        for base in STEP_HISTOGRAMS:
            if not name.startswith(base):
                continue
            suffix = name[len(base) :]
            try:
                value = float(m.group("value"))
            except ValueError:
                break
            h = found.setdefault(base, {"sum": 0.0, "count": 0.0, "buckets": {}})
            if suffix == "_sum":
                h["sum"] += value
            elif suffix == "_count":
                h["count"] += value
            elif suffix == "_bucket":
                le = _LE.search(m.group("labels") or "")
                if le:
                    bound = float(le.group("le"))  # "+Inf" parses
                    h["buckets"][bound] = h["buckets"].get(bound, 0.0) + value
            break
    return found


def _hist_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative buckets (linear within a bucket)."""
    items = sorted(buckets.items())
    if not items or items[-1][1] <= 0:
        return None
    rank = q * items[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in items:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def profile_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """Per histogram: observations, mean, approximate p50/p90/p99 (ms) between two scrapes."""
    if after is None:
        return {"error": "/metrics could not be read"}
    before = before or {}
    out: dict[str, Any] = {}
    for name, desc in STEP_HISTOGRAMS.items():
        if name not in after:
            out[name] = None
            continue
        a, b = after[name], before.get(name, {"sum": 0.0, "count": 0.0, "buckets": {}})
        count = a["count"] - b["count"]
        total = a["sum"] - b["sum"]
        buckets = {k: v - b["buckets"].get(k, 0.0) for k, v in a["buckets"].items()}
        entry: dict[str, Any] = {
            "what": desc,
            "count": count,
            "sum_s": total,
            "mean_ms": total / count * 1000.0 if count > 0 else None,
        }
        for q in (50, 90, 99):
            v = _hist_quantile(q / 100, buckets)
            entry[f"p{q}_ms_approx"] = v * 1000.0 if v is not None else None
        out[name] = entry
    return out


def print_profile(label: str, prof: dict[str, Any], row: dict[str, Any] | None) -> None:
    if "error" in prof:
        print(f"profile ({label}): {prof['error']}")
        return
    if all(prof.get(name) is None for name in STEP_HISTOGRAMS):
        print(f"profile ({label}): this server exposes none of {', '.join(STEP_HISTOGRAMS)}")
        return
    for name in STEP_HISTOGRAMS:
        e = prof.get(name)
        if e is None:
            print(f"profile ({label}): {name} not exposed by this server")
        elif e["mean_ms"] is None:
            print(f"profile ({label}): {name}: no observations")
        else:
            approx = ", ".join(
                f"p{q} ~{e[f'p{q}_ms_approx']:.2f}" for q in (50, 99) if e[f"p{q}_ms_approx"] is not None
            )
            print(
                f"profile ({label}): {name}: mean {e['mean_ms']:.2f} ms over {e['count']:.0f} "
                f"({e['what']}{'; ' + approx + ' ms' if approx else ''})"
            )
    step = prof.get("pagedrs:engine_step_seconds")
    if row is not None and step and step["mean_ms"] is not None and math.isfinite(row["tpot_mean_ms"]):
        ratio = row["tpot_mean_ms"] / step["mean_ms"] if step["mean_ms"] > 0 else float("nan")
        print(
            f"profile ({label}): mean engine step {step['mean_ms']:.2f} ms vs mean TPOT "
            f"{row['tpot_mean_ms']:.2f} ms (TPOT / step = {ratio:.2f})"
        )


# --- provenance --------------------------------------------------------------------------------------


def package_info() -> dict[str, Any]:
    info: dict[str, Any] = {}
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        info["version"] = version("pagedrs")
    spec = importlib.util.find_spec("pagedrs")
    info["location"] = str(Path(spec.origin).parent) if spec and spec.origin else None
    return info


def _logged_device(log_path: str) -> str | None:
    with contextlib.suppress(OSError):
        m = re.search(r"engine ready:.*?device=(\S+)", Path(log_path).read_text(errors="replace"))
        if m:
            return m.group(1)
    return None


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# --- main --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [OFFLINE_WORKER_FLAG]:
        if len(argv) != 2:
            raise SystemExit(f"usage: {OFFLINE_WORKER_FLAG} SPEC.json")
        return offline_worker(argv[1])

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server (loopback only); default: start one")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.add_argument(
        "--rates",
        default=None,
        help="comma-separated request rates in req/s, `inf` = no gaps "
        "(default: 0.5,1,2,4; inf with --max-concurrency)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="at most this many requests in flight (saturation: each sent as soon as a slot frees)",
    )
    p.add_argument("--num-requests", type=int, default=16, help="requests per rate")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (ignore_eos)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt choice and the Poisson gaps")
    p.add_argument(
        "--offline-baseline",
        action="store_true",
        help="first run the same requests through LLM.generate (separate process, the server's engine "
        "flags) and report serving efficiency",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="report the server's step histograms (/metrics) per rate",
    )
    p.add_argument("--json", default=None, help="write the results here")
    add_commit_arg(p)
    p.add_argument("--plot", default=None, help="write a PNG of the latencies here (needs matplotlib)")
    p.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds one streamed request may take in all"
    )
    p.add_argument(
        "--server-start-timeout", type=float, default=600.0, help="seconds the server may take to answer"
    )
    p.add_argument(
        "--offline-timeout",
        type=float,
        default=1200.0,
        help="seconds the offline baseline process may take (model load included)",
    )
    p.add_argument(
        "--server-log",
        default=os.path.join(tempfile.gettempdir(), "pagedrs-serving-bench.log"),
        help="the started server's output (default: in the temp dir)",
    )
    p.add_argument(
        "--offline-log",
        default=os.path.join(tempfile.gettempdir(), "pagedrs-serving-bench-offline.log"),
        help="the offline baseline process's output (default: in the temp dir)",
    )
    p.add_argument(
        "server_args",
        nargs=argparse.REMAINDER,
        help="after `--`: flags for the server this script starts and for the offline engine "
        "(e.g. -- --device cpu --max-num-seqs 64)",
    )
    args = p.parse_args(argv)
    if args.rates is None:
        args.rates = "inf" if args.max_concurrency else "0.5,1,2,4"
    try:
        rates = [float(x) for x in args.rates.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--rates: not a list of numbers or inf: {args.rates!r}") from None
    if not rates or any(not r > 0 for r in rates) or args.num_requests < 1 or args.max_tokens < 1:
        raise SystemExit("--rates must be positive (or inf), --num-requests and --max-tokens >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit("--max-concurrency must be >= 1")
    for name in ("request_timeout", "server_start_timeout", "offline_timeout"):
        if not 0 < getattr(args, name) < math.inf:
            raise SystemExit(f"--{name.replace('_', '-')} must be a positive number of seconds")
    server_args = [a for a in args.server_args if a != "--"]

    # SIGTERM / SIGHUP unwind like Ctrl-C, so the server and the offline process are always stopped.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)

    git = git_info(
        args.commit
    )  # the code that runs is the checkout's now (an editable install reads it at start-up)
    load_start = _loadavg()
    if load_start and load_start[0] > 0.5 * (os.cpu_count() or 1):
        print(
            f"warning: the machine is busy (load average {load_start[0]:.2f} on {os.cpu_count()} CPUs): "
            "the figures will be lower and noisier than on an idle machine",
            file=sys.stderr,
        )
    prompt_rng = random.Random(args.seed)
    prompt_idx = [prompt_rng.randrange(len(PROMPTS)) for _ in range(args.num_requests)]
    prompts = [PROMPTS[i] for i in prompt_idx]

    offline: dict[str, Any] | None = None
    if args.offline_baseline:
        if args.base_url:
            print(
                "offline baseline: --base-url given; the offline engine gets only the flags after `--`, "
                "make sure they match the running server's",
                file=sys.stderr,
            )
        print(f"offline baseline: {len(prompts)} requests through LLM.generate ...", file=sys.stderr)
        offline = run_offline_baseline(
            prompts, args.max_tokens, server_args, args.offline_timeout, args.offline_log
        )
        if "error" in offline:
            print(offline["error"], file=sys.stderr)
        else:
            print(
                f"offline: {offline['output_token_throughput']:.1f} output tok/s "
                f"({offline['output_tokens']} tokens in {offline['duration_s']:.2f} s, "
                f"model load {offline['load_s']:.1f} s)",
                file=sys.stderr,
            )

    proc = None
    data_dir = None
    rows: list[dict[str, Any]] = []
    profiles: list[dict[str, Any]] = []
    profile_total: dict[str, Any] | None = None
    served = None
    try:
        if args.base_url:
            _check_loopback(args.base_url)
            url = args.base_url.rstrip("/")
        else:
            data_dir = tempfile.mkdtemp(prefix="pagedrs-bench-")
            proc, url = start_server(server_args, args.server_log, data_dir, args.server_start_timeout)
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        status, text = http_get(f"{url}/v1/models", headers=headers, timeout=30)
        if status != 200:
            raise SystemExit(f"GET /v1/models answered HTTP {status}: {text[:200]!r}")
        models = json.loads(text).get("data", [])
        served = models[0]["id"] if models else None
        gap_rng = random.Random(args.seed + 1)
        # one warm-up request (not counted): first-call costs are not a rate's latency
        asyncio.run(
            run_rate(url, args.api_key, 1.0, PROMPTS[:1], 4, random.Random(0), args.model, None, 120.0)
        )
        first_scrape = scrape_metrics(url, args.api_key) if args.profile else None
        prev_scrape = first_scrape
        for rate in rates:
            results, duration, peak = asyncio.run(
                run_rate(
                    url,
                    args.api_key,
                    rate,
                    prompts,
                    args.max_tokens,
                    gap_rng,
                    args.model,
                    args.max_concurrency,
                    args.request_timeout,
                )
            )
            row = summarize(rate, results, duration, args.max_concurrency, peak)
            assert row["completed"] + row["failed"] == row["sent"] == args.num_requests
            if row.get("usage_missing"):
                print(
                    f"warning: {row['usage_missing']} responses had no usage chunk; their output tokens are "
                    "inferred from finish_reason (length = max_tokens)",
                    file=sys.stderr,
                )
            if row["output_tokens"] != row["completed"] * args.max_tokens:
                print(
                    f"warning: {row['output_tokens']} output tokens, expected "
                    f"{row['completed'] * args.max_tokens} (ignore_eos)",
                    file=sys.stderr,
                )
            if args.profile:
                scrape = scrape_metrics(url, args.api_key)
                row["profile"] = profile_delta(prev_scrape, scrape)
                prev_scrape = scrape if scrape is not None else prev_scrape
            rows.append(row)
            print(
                f"{_entry_label(row)}: {row['completed']}/{row['sent']} completed, "
                f"{row['output_token_throughput']:.1f} output tok/s",
                file=sys.stderr,
            )
        if args.profile:
            profile_total = profile_delta(first_scrape, prev_scrape)
    finally:
        if proc is not None:
            stop_process_group(proc, 20)
        if data_dir is not None:
            shutil.rmtree(data_dir, ignore_errors=True)

    print_table(rows)
    sent = sum(r["sent"] for r in rows)
    completed = sum(r["completed"] for r in rows)
    failed = sum(r["failed"] for r in rows)
    saturated = [r for r in rows if r["mode"] == "saturation"]
    best = max(saturated or rows, key=lambda r: r["output_token_throughput"])
    print(
        f"serving: {completed}/{sent} completed, {failed} failed over {len(rows)} rates; "
        f"peak {best['output_token_throughput']:.1f} output tok/s at {_entry_label(best)} "
        f"(TTFT p99 {best['ttft_p99_ms']:.0f} ms, TPOT p50 {best['tpot_p50_ms']:.1f} ms)"
    )

    if args.profile:
        for row in rows:
            print_profile(_entry_label(row), row["profile"], row)
        profiles = [r["profile"] for r in rows]

    conc_label = (
        f"concurrency {best['max_concurrency']}"
        if best["max_concurrency"]
        else (f"concurrency {args.num_requests}, rate inf" if best["rate"] == "inf" else "")
    )
    where = conc_label if best["mode"] == "saturation" else f"Poisson {best['rate']:g} req/s"
    efficiency: dict[str, Any] | None = None
    if offline is not None and "error" not in offline:
        value = best["output_token_throughput"] / offline["output_token_throughput"]
        summary = (
            f"serving efficiency: {best['output_token_throughput']:.1f} tok/s (server, {where}) / "
            f"{offline['output_token_throughput']:.1f} tok/s (offline) = {value:.2f}"
        )
        efficiency = {
            "value": value,
            "server_output_tok_s": best["output_token_throughput"],
            "offline_output_tok_s": offline["output_token_throughput"],
            "server_entry": _entry_label(best),
        }
        if best["max_concurrency"] and best["max_concurrency"] < args.num_requests:
            efficiency["note"] = (
                f"the server had at most {best['max_concurrency']} requests in flight; offline submits all "
                f"{args.num_requests} at once (batch bounded by the engine's max_num_seqs)"
            )
    else:
        summary = f"serving: {best['output_token_throughput']:.1f} tok/s (server, {where})" + (
            f"; offline baseline failed: {offline['error']}" if offline is not None else ""
        )
    print(summary)
    if efficiency and "note" in efficiency:
        print(f"note: {efficiency['note']}")

    git_end = git_info(args.commit)
    if git_end.get("commit") != git.get("commit") or git_end.get("changes") != git.get("changes"):
        git["at_end"] = git_end
        print(
            "warning: the checkout changed during the run (commit or working tree): the offline run and the "
            "server may have loaded different code",
            file=sys.stderr,
        )
    machine = machine_info()
    machine["torch_device"] = (
        (offline or {}).get("device") or _logged_device(args.server_log) or _logged_device(args.offline_log)
    )
    machine["loadavg_start"] = load_start
    machine["loadavg_end"] = _loadavg()
    for key in ("torch_num_threads", "torch_version", "gpu"):
        if offline and key in offline:
            machine[key] = offline[key]
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        out = {
            "summary": summary,
            "command": shlex.join(sys.argv),
            "argv": sys.argv,
            "python": sys.executable,
            "git": git,
            "machine": machine,
            "package": package_info(),
            "sent": sent,
            "completed": completed,
            "failed": failed,
            "model": served,
            "num_requests_per_rate": args.num_requests,
            "max_tokens": args.max_tokens,
            "max_concurrency": args.max_concurrency,
            "request_timeout_s": args.request_timeout,
            "seed": args.seed,
            "server_args": server_args,
            "cpu_count": os.cpu_count(),
            "prompt_set": PROMPTS,
            "prompt_indices": prompt_idx,
            "rates": rows,
            "offline": offline,
            "efficiency": efficiency,
            "profile": {"total": profile_total, "per_rate": profiles} if args.profile else None,
        }
        with open(args.json, "w") as f:
            json.dump(json_safe(out), f, indent=2, allow_nan=False)
    if args.plot:
        plot(rows, args.plot, summary)
    ok = failed == 0 and (offline is None or "error" not in offline)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: the server and the offline process were stopped", file=sys.stderr)
        sys.exit(130)
