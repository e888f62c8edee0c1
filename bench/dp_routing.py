r"""Data-parallel routing policies side by side on one machine: a multi-tenant workload and one without
shared prefixes, against `pagedrs serve --data-parallel-size 2 --dp-routing {cache,least_loaded,
round_robin}` and DP=1 as the baseline.

    python bench/dp_routing.py --json bench/results/dp_routing.json --plot bench/results/dp_routing.png
    # flags after `--` go to every server this script starts
    python bench/dp_routing.py --tenants 8 --requests 48 -- --max-num-seqs 8

Workloads (drawn once from --seed; every server gets the same requests in the same order):
  * `multi_tenant`: --tenants tenants, each with its own system prompt of --system-words words; each
    request is one tenant's system prompt and a question of --question-words words, the tenant drawn at
    random per request (all tenants interleaved);
  * `no_shared`: --no-shared-requests requests of the same length, no two sharing a prefix (the hot-spot check: cache
    routing should do as well as least_loaded here).

Each server (one per entry of --configs: `dp1` is DP=1, the others DP=--dp with that routing policy) is
started on 127.0.0.1 with --threads CPU threads in all (OMP_NUM_THREADS, shared out among replicas) and
--num-kv-blocks blocks per replica (DP=1: --dp times as many, the same KV memory in all). The defaults size
the multi-tenant workload so that where the requests go decides what stays cached: 8 tenants' prefixes of
16 blocks (of 16 tokens) each are 128 blocks, 1.45x one replica's 88; half of them and the requests in
flight fit in one replica, all of them do not. Each server is warmed up, then runs each workload at
--concurrency requests in flight: streaming `/v1/completions`, greedy, `ignore_eos`, --max-tokens output
tokens each.
With --rounds N every server runs N times, the configs taking turns, and each figure is the median of the
N runs (each run's under `<figure>_rounds` in the JSON, the runs themselves under `runs`).
Per server and workload: output tok/s, TTFT p50/p90, and the prefix-cache hit rate (hit / queried prompt
tokens) from the server's `pagedrs:prefix_cache_hits` / `pagedrs:prefix_cache_queries` counters before and
after (per replica where the series carry an `engine` label). Prints, for the goals,

    output throughput: A tok/s (cache) vs B tok/s (round_robin) = A/B x

and the hit-rate, TTFT p90 and no-shared-prefix ratios. Imports only the installed `pagedrs` package
(through the servers it starts); reuses serving.py's client and server start.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

from _common import add_commit_arg, command_line, git_info, machine_info, write_json
from serving import (
    Result,
    _free_port,
    _raise_interrupt,
    http_get,
    launch_and_wait,
    one_request,
    package_info,
    stop_process_group,
    summarize,
)

POLICIES = ("cache", "least_loaded", "round_robin")
WORKLOADS = ("multi_tenant", "no_shared")
WORDS = (
    "the a river city light music engine garden history quiet storm paper window winter market language "
    "machine forest ocean mountain bridge letter friend morning question answer science story journey "
    "animal memory kitchen evening system problem reason colour silver voice field always never policy "
    "customer order refund invoice account support ticket product shipping warranty careful polite"
).split()
COUNTERS = ("pagedrs:prefix_cache_hits", "pagedrs:prefix_cache_queries", "pagedrs:prompt_tokens")
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_ENGINE = re.compile(r'(?:^|,)\s*engine="(?P<engine>[^"]*)"')


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_workloads(args: argparse.Namespace) -> dict[str, list[str]]:
    """The prompts of each workload, in sending order (the same for a given seed)."""
    rng = random.Random(args.seed)
    systems = [
        f"Tenant {k}: {_words(rng, 3)}. You are the support assistant of this company. {_words(rng, args.system_words)}"
        for k in range(args.tenants)
    ]
    multi = []
    for _ in range(args.requests):
        system = systems[rng.randrange(args.tenants)]
        multi.append(f"{system}\n\nUser: {_words(rng, args.question_words)}?\nAssistant:")
    no_shared = [
        f"{_words(rng, args.system_words + 12)}\n\nUser: {_words(rng, args.question_words)}?\nAssistant:"
        for _ in range(args.no_shared_requests)
    ]
    return {"multi_tenant": multi, "no_shared": no_shared}


def parse_counters(text: str) -> dict[str, dict[str, float]]:
    """{counter: {"total": engine-wide value, engine label: value, ...}} from Prometheus text: the total is
    the sum of the samples without an `engine` label, or of the per-engine ones where there are only those."""
    plain: dict[str, float] = {}
    per_engine: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or not m.group("name").endswith("_total"):
            continue
        name = m.group("name")[: -len("_total")]
        if name not in COUNTERS:
            continue
        try:
            value = float(m.group("value"))
        except ValueError:
            continue
        eng = _ENGINE.search(m.group("labels") or "")
        if eng:
            per_engine.setdefault(name, {})[eng.group("engine")] = (
                per_engine.get(name, {}).get(eng.group("engine"), 0.0) + value
            )
        else:
            plain[name] = plain.get(name, 0.0) + value
    out: dict[str, dict[str, float]] = {}
    for name in COUNTERS:
        engines = per_engine.get(name, {})
        total = plain.get(name, sum(engines.values()) if engines else None)
        if total is None:
            continue
        out[name] = {"total": total, **engines}
    return out


def scrape(url: str) -> dict[str, dict[str, float]]:
    status, text = http_get(f"{url}/metrics", timeout=30)
    if status != 200:
        raise SystemExit(f"{url}/metrics answered HTTP {status}")
    return parse_counters(text)


def counter_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Hit rate over the interval, engine-wide and per engine; prompt tokens seen."""
    out: dict[str, Any] = {}
    hits, queries = "pagedrs:prefix_cache_hits", "pagedrs:prefix_cache_queries"
    if hits not in after or queries not in after:
        out["hit_rate"] = None
        out["metrics_missing"] = sorted({hits, queries} - set(after))
        return out
    per: dict[str, dict[str, float]] = {}
    for key in after[queries]:
        dq = after[queries][key] - before.get(queries, {}).get(key, 0.0)
        dh = after[hits].get(key, 0.0) - before.get(hits, {}).get(key, 0.0)
        per[key] = {"hits": dh, "queries": dq, "hit_rate": dh / dq if dq > 0 else None}
    total = per.pop("total")
    out.update(
        hit_rate=total["hit_rate"], prefix_cache_hits=total["hits"], prefix_cache_queries=total["queries"]
    )
    if per:
        out["per_engine"] = per
    pt = "pagedrs:prompt_tokens"
    if pt in after:
        out["prompt_tokens"] = after[pt]["total"] - before.get(pt, {}).get("total", 0.0)
    return out


async def run_workload(
    url: str, prompts: list[str], max_tokens: int, concurrency: int, timeout: float
) -> Any:
    """Every prompt sent in order with at most `concurrency` in flight; (results, duration)."""
    slots = asyncio.Semaphore(concurrency)

    async def one(prompt: str) -> Any:
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with slots:
            try:
                return await asyncio.wait_for(one_request(url, {}, body), timeout)
            except asyncio.TimeoutError:
                return Result(False, error=f"timed out after {timeout:g} s")

    start = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    return list(results), time.perf_counter() - start


def server_args(config: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
    # DP=1 gets the KV memory of all the replicas, so that the comparison is at equal memory
    blocks = args.num_kv_blocks * (args.dp if config == "dp1" else 1)
    out = ["--num-kv-blocks", str(blocks)]
    if config != "dp1":
        out += ["--data-parallel-size", str(args.dp), "--dp-routing", config]
    return out + extra


def start(cmd: list[str], args: argparse.Namespace, log: str, data_dir: str) -> tuple[Any, str]:
    """`python -m pagedrs.entrypoints.openai.api_server` on a free loopback port with --threads CPU
    threads in all (OMP_NUM_THREADS, which the server shares out among its replicas)."""
    port = _free_port()
    argv = [sys.executable, "-m", "pagedrs.entrypoints.openai.api_server", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--data-dir", data_dir, *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    return launch_and_wait(argv, port, log, args.server_start_timeout, "server", env=env)


def bench_config(
    config: str, args: argparse.Namespace, workloads: dict[str, list[str]], extra: list[str]
) -> list[dict[str, Any]]:
    data_dir = tempfile.mkdtemp(prefix="pagedrs-dp-bench-")
    log = os.path.join(tempfile.gettempdir(), f"pagedrs-dp-bench-{config}.log")
    cmd = server_args(config, args, extra)
    proc = None
    rows = []
    try:
        proc, url = start(cmd, args, log, data_dir)
        warm = [f"warm up {i}: {_words(random.Random(i), 20)}" for i in range(4)]
        asyncio.run(run_workload(url, warm, 4, 4, args.request_timeout))
        for name in args.workloads:
            before = scrape(url)
            results, duration = asyncio.run(
                run_workload(url, workloads[name], args.max_tokens, args.concurrency, args.request_timeout)
            )
            row = summarize(float("inf"), results, duration, args.concurrency, args.concurrency)
            row.update(config=config, workload=name, server_args=cmd, **counter_delta(before, scrape(url)))
            # per request, in sending order (None: failed): where the slow first tokens fall
            row["ttft_ms_by_request"] = [round(r.ttft * 1000, 1) if r.ok else None for r in results]
            rows.append(row)
            print_row(row)
    finally:
        if proc is not None:
            stop_process_group(proc, 20)
        shutil.rmtree(data_dir, ignore_errors=True)
    return rows


def print_row(row: dict[str, Any]) -> None:
    hr = row["hit_rate"]
    print(
        f"{row['config']:>13} {row['workload']:>12}: {row['output_token_throughput']:7.1f} out tok/s, TTFT p50 "
        f"{row['ttft_p50_ms']:6.0f} ms p90 {row['ttft_p90_ms']:6.0f} ms, hit rate "
        f"{'-' if hr is None else f'{hr:.1%}'}, {row['completed']}/{row['sent']} done",
        flush=True,
    )


MEDIAN_KEYS = ("output_token_throughput", "ttft_p50_ms", "ttft_p90_ms", "hit_rate")


def merge_rounds(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (config, workload): with one round, its run; with several, the first round's row with
    each of MEDIAN_KEYS the median over the rounds (the upper one of an even count), every round's value
    under `<key>_rounds`, and completed / sent summed."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in runs:
        groups.setdefault((row["config"], row["workload"]), []).append(row)
    out = []
    for group in groups.values():
        if len(group) == 1:
            out.append({k: v for k, v in group[0].items() if k != "round"})
            continue
        row = {k: v for k, v in group[0].items() if k not in ("round", "ttft_ms_by_request")}
        for key in MEDIAN_KEYS:
            vals = [g.get(key) for g in group]
            row[f"{key}_rounds"] = vals
            known = sorted(v for v in vals if v is not None)
            row[key] = known[len(known) // 2] if known else None
        row["completed"] = sum(g["completed"] for g in group)
        row["sent"] = sum(g["sent"] for g in group)
        out.append(row)
    return out


def _row(rows: list[dict[str, Any]], config: str, workload: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["config"] == config and r["workload"] == workload), None)


def goals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ratios the goals are stated in (None where a side is missing)."""

    def ratio(a: Any, b: Any) -> float | None:
        return a / b if a is not None and b else None

    out: dict[str, Any] = {}
    c, rr = _row(rows, "cache", "multi_tenant"), _row(rows, "round_robin", "multi_tenant")
    if c and rr:
        out["multi_tenant_hit_rate_cache_over_rr"] = ratio(c["hit_rate"], rr["hit_rate"])
        out["multi_tenant_tok_s_cache_over_rr"] = ratio(
            c["output_token_throughput"], rr["output_token_throughput"]
        )
        out["multi_tenant_ttft_p90_cache_over_rr"] = ratio(c["ttft_p90_ms"], rr["ttft_p90_ms"])
        print(
            f"output throughput: {c['output_token_throughput']:.1f} tok/s (cache) vs "
            f"{rr['output_token_throughput']:.1f} tok/s (round_robin) = "
            f"{out['multi_tenant_tok_s_cache_over_rr'] or float('nan'):.2f}x (goal >= 1.5x)"
        )
        print(
            f"prefix hit rate: cache / round_robin = {out['multi_tenant_hit_rate_cache_over_rr'] or float('nan'):.2f}x"
            f" (goal >= 2x); TTFT p90 cache / round_robin = "
            f"{out['multi_tenant_ttft_p90_cache_over_rr'] or float('nan'):.2f} (goal <= 0.5)"
        )
    c, ll = _row(rows, "cache", "no_shared"), _row(rows, "least_loaded", "no_shared")
    if c and ll:
        out["no_shared_tok_s_cache_over_least_loaded"] = ratio(
            c["output_token_throughput"], ll["output_token_throughput"]
        )
        print(
            f"no shared prefix: {c['output_token_throughput']:.1f} tok/s (cache) vs "
            f"{ll['output_token_throughput']:.1f} tok/s (least_loaded) = "
            f"{out['no_shared_tok_s_cache_over_least_loaded'] or float('nan'):.2f}x (goal >= 0.9x)"
        )
    return out


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w for w in WORKLOADS if any(r["workload"] == w for r in rows)]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    panels = (
        ("output_token_throughput", "output tok/s", 1.0),
        ("ttft_p50_ms", "TTFT p50 (s)", 1e-3),
        ("ttft_p90_ms", "TTFT p90 (s)", 1e-3),
        ("hit_rate", "prefix-cache hit rate (%)", 100.0),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4))
    width = 0.8 / max(1, len(configs))
    for ax, (key, label, scale) in zip(axes, panels, strict=True):
        for j, config in enumerate(configs):
            vals = []
            for w in workloads:
                r = _row(rows, config, w)
                v = r.get(key) if r else None
                vals.append(v * scale if v is not None else 0.0)
            xs = [i + (j - (len(configs) - 1) / 2) * width for i in range(len(workloads))]
            bars = ax.bar(xs, vals, width, label=config, color=f"C{j}")
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_title(label)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="dp1,cache,least_loaded,round_robin", help="dp1 and/or policies")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--dp", type=int, default=2, help="replicas of the policy runs")
    p.add_argument("--threads", type=int, default=2, help="CPU threads in all (shared out among replicas)")
    p.add_argument("--num-kv-blocks", type=int, default=88, help="KV-cache blocks per replica")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--system-words", type=int, default=240, help="words of a tenant's system prompt")
    p.add_argument("--question-words", type=int, default=12)
    p.add_argument("--requests", type=int, default=256, help="requests of the multi-tenant workload")
    p.add_argument("--no-shared-requests", type=int, default=32, help="requests of the no-shared workload")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds", type=int, default=1, help="run every config this many times, taking turns; report medians"
    )
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--server-start-timeout", type=float, default=300.0)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    add_commit_arg(p)
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for c in args.configs:
        if c != "dp1" and c not in POLICIES:
            p.error(f"--configs: {c!r} is neither dp1 nor one of {POLICIES}")
    for w in args.workloads:
        if w not in WORKLOADS:
            p.error(f"--workloads: {w!r} is not one of {WORKLOADS}")
    if (
        min(args.tenants, args.requests, args.no_shared_requests, args.concurrency, args.rounds) < 1
        or args.dp < 2
    ):
        p.error(
            "--tenants, --requests, --no-shared-requests, --concurrency and --rounds must be >= 1, --dp >= 2"
        )
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(list(sys.argv[1:] if argv is None else argv))
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    workloads = make_workloads(args)
    runs: list[dict[str, Any]] = []
    started = time.time()
    for r in range(args.rounds):  # configs take turns, so that a change in the machine's load hits each
        for config in args.configs:
            runs.extend({**row, "round": r} for row in bench_config(config, args, workloads, extra))
    rows = merge_rounds(runs)
    if args.rounds > 1:
        print(f"medians of {args.rounds} rounds:")
        for row in rows:
            print_row(row)
    summary = goals(rows)
    if args.json:
        write_json(
            args.json,
            {
                "bench": "dp_routing",
                "command": command_line(),
                "git": git_info(args.commit),
                "machine": machine_info(),
                "package": package_info(),
                "loadavg_after": list(os.getloadavg()),
                "wall_s": time.time() - started,
                "config": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
                "server_extra_args": extra,
                "rows": rows,
                "runs": runs if args.rounds > 1 else None,
                "goals": summary,
            },
        )
        print(f"wrote {args.json}")
    if args.plot:
        title = (
            f"pagedrs data-parallel routing: {args.tenants} tenants x {args.system_words}-word system prompts, "
            f"{args.requests} requests, concurrency {args.concurrency}, {args.max_tokens} output tokens, "
            f"{args.threads} threads, {args.num_kv_blocks} KV blocks per replica"
        )
        plot(rows, args.plot, title)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
