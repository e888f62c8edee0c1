"""Engine statistics: the `EngineStats` snapshot, the periodic stats log line (vLLM's format) and the
per-step batch picture (`enable_log_batch_visualization`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

if TYPE_CHECKING:
    from pagedrs._core import StepPlan

__all__ = [
    "EngineStats",
    "StatLogger",
    "format_hit_rate_line",
    "format_stats_line",
    "token_boxes",
    "visualize_batch",
    "visualize_batch_boxes",
]

logger = logging.getLogger("pagedrs.engine")


class EngineStats(msgspec.Struct, array_like=True):
    """A snapshot of the engine after a step: scheduler queues, the KV pool, cumulative token counters and
    the step's own timings. It travels in every step message of the engine core (msgspec, no pickle)."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_usage: float = 0.0  # 0..1 of the device pool
    prefix_cache_queries: int = 0  # prompt tokens looked up (cumulative)
    prefix_cache_hits: int = 0  # of which found in the cache (cumulative)
    prompt_tokens_total: int = 0  # prompt tokens computed (prefill, recompute included)
    generation_tokens_total: int = 0  # tokens sampled
    num_preemptions: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_swap_blocks: int = 0
    num_free_swap_blocks: int = 0
    num_steps: int = 0
    step_time_s: float = 0.0  # schedule + execute + update of the latest step
    batch_size: int = 0  # sequences that sampled a token in the latest step
    send_time_s: float = 0.0  # encoding + sending the previous step message (engine core process only)
    # Speculative decoding (cumulative): verifications (a sequence speculating in a step), draft tokens
    # proposed, draft tokens accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_pauses: int = 0  # engine-wide pauses: speculation measured slower than plain decoding
    # Each KV pool's usage (0..1) by KV-cache group: `full` (the full-attention pool, unless every layer
    # is windowed), `window:W` per sliding-window group and `recurrent` (state slots); `kv_usage` is the
    # fullest's.
    kv_group_usage: dict[str, float] = msgspec.field(default_factory=dict)
    # The host KV tier (`kv_offloading_size`): its blocks and those in use, prompt tokens looked up in it
    # after the device pool's prefix hit ended and found there (vLLM's external prefix cache), bytes
    # copied in and out (per rank, cumulative) and blocks dropped to make room.
    kv_offload_blocks: int = 0
    kv_offload_used_blocks: int = 0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_offload_bytes_stored: int = 0
    kv_offload_bytes_loaded: int = 0
    kv_offload_evicted_blocks: int = 0

    @property
    def kv_offload_usage(self) -> float:
        return self.kv_offload_used_blocks / self.kv_offload_blocks if self.kv_offload_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def format_stats_line(prompt_tps: float, gen_tps: float, stats: EngineStats) -> str:
    """vLLM 0.4's stats line, field for field: "GPU" is the device pool (on a CPU device too, as vLLM's
    CPU backend prints it), "CPU" the swap pool."""
    swap = stats.num_swap_blocks
    swap_usage = (swap - stats.num_free_swap_blocks) / swap if swap else 0.0
    return (
        f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, "
        f"Avg generation throughput: {gen_tps:.1f} tokens/s, "
        f"Running: {stats.num_running} reqs, Swapped: {stats.num_swapped} reqs, "
        f"Pending: {stats.num_waiting} reqs, GPU KV cache usage: {100.0 * stats.kv_usage:.1f}%, "
        f"CPU KV cache usage: {100.0 * swap_usage:.1f}%"
    )


def format_hit_rate_line(hit_rate: float) -> str:
    """vLLM's prefix-cache line (logged after the stats line once prompts were looked up); swapped blocks
    are never prefix hits, so the CPU rate is 0."""
    return f"Prefix cache hit rate: GPU: {100.0 * hit_rate:.2f}%, CPU: 0.00%"


def format_spec_line(drafts: int, draft_tokens: int, accepted: int, elapsed: float) -> str:
    """vLLM V1's speculative-decoding line over one logging interval."""
    return (
        f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / max(drafts, 1):.2f}, "
        f"Accepted throughput: {accepted / elapsed:.2f} tokens/s, "
        f"Drafted throughput: {draft_tokens / elapsed:.2f} tokens/s, "
        f"Accepted: {accepted} tokens, Drafted: {draft_tokens} tokens, "
        f"Avg Draft acceptance rate: {100.0 * accepted / max(draft_tokens, 1):.1f}%"
    )


class StatLogger:
    """Logs vLLM's stats line every `interval` seconds (checked after each step), then the prefix-cache
    hit rate line."""

    def __init__(self, interval: float, log: logging.Logger | None = None) -> None:
        self.interval = interval
        self.log = log or logger
        self.last_time = time.monotonic()
        self.last_prompt = 0
        self.last_gen = 0
        self.last_queries = 0
        self.last_hits = 0
        self.last_line: str | None = None
        self.last_hit_rate_line: str | None = None
        self.last_spec = (0, 0, 0)
        self.last_spec_line: str | None = None

    def maybe_log(self, stats: EngineStats, now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        elapsed = now - self.last_time
        if elapsed < self.interval:
            return None
        return self.log_now(stats, now)

    def log_now(self, stats: EngineStats, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        elapsed = max(now - self.last_time, 1e-9)
        prompt_tps = (stats.prompt_tokens_total - self.last_prompt) / elapsed
        gen_tps = (stats.generation_tokens_total - self.last_gen) / elapsed
        dq = stats.prefix_cache_queries - self.last_queries
        dh = stats.prefix_cache_hits - self.last_hits
        # Hit rate over this interval's lookups; the cumulative one when nothing was looked up.
        hit_rate = dh / dq if dq > 0 else stats.prefix_cache_hit_rate
        line = format_stats_line(prompt_tps, gen_tps, stats)
        self.log.info(line)
        if stats.prefix_cache_queries:
            self.last_hit_rate_line = format_hit_rate_line(hit_rate)
            self.log.info(self.last_hit_rate_line)
        spec = (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)
        if spec[0] > self.last_spec[0]:
            d, dt, acc = (a - b for a, b in zip(spec, self.last_spec, strict=True))
            self.last_spec_line = format_spec_line(d, dt, acc, elapsed)
            self.log.info(self.last_spec_line)
        self.last_spec = spec
        self.last_time = now
        self.last_prompt = stats.prompt_tokens_total
        self.last_gen = stats.generation_tokens_total
        self.last_queries = stats.prefix_cache_queries
        self.last_hits = stats.prefix_cache_hits
        self.last_line = line
        return line


_UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def visualize_batch(plan: StepPlan, step: int, token_budget: int, width: int = 64) -> str:
    """A compact picture of one step: a bar over the token budget where each sequence's tokens are drawn
    with its letter (UPPERCASE = prefill chunk, lowercase = decode, '.' = unused budget), then a legend.

    e.g. ``step 7 |AAAAAAAAAAAAAAbcd.............| 18/64 tok: A=seq 3 prefill 0..14/20, decode b=4 c=5 d=6``
    """
    req_ids = np.asarray(plan.req_ids).tolist()
    num_sched = np.asarray(plan.num_scheduled_tokens).tolist()
    computed = np.asarray(plan.num_computed_tokens).tolist()
    prompt_lens = np.asarray(plan.num_prompt_tokens).tolist()
    total = int(sum(num_sched))
    budget = max(token_budget, total, 1)
    scale = width / budget
    bar: list[str] = []
    prefills: list[str] = []
    decodes: list[str] = []
    pos = 0.0
    for i, (sid, n, c, p) in enumerate(zip(req_ids, num_sched, computed, prompt_lens, strict=True)):
        letter = _UPPER[i % 26]
        is_decode = n == 1 and c >= p
        ch = letter.lower() if is_decode else letter
        end = pos + n * scale
        cells = max(1, round(end) - round(pos))
        bar.append(ch * cells)
        pos = end
        if is_decode:
            decodes.append(f"{ch}={sid}")
        else:
            prefills.append(f"{ch}=seq {sid} prefill {c}..{c + n}/{p}")
    body = "".join(bar)
    body += "." * max(0, width - len(body))
    legend = ", ".join(prefills)
    if decodes:
        legend += (", " if legend else "") + "decode " + " ".join(decodes)
    preempted = np.asarray(plan.preempted).tolist()
    if preempted:
        legend += f"; preempted {preempted}"
    return f"step {step} |{body}| {total}/{token_budget} tok: {legend or 'idle'}"


def _fit(text: str, width: int) -> str:
    text = text.replace("\n", "\\n").replace("\t", "\\t")
    return (text[: width - 2] + ".." if len(text) > width else text).ljust(width)


def token_boxes(
    plan: StepPlan,
    seqs: Mapping[int, Any],
    tokenizer: Any,
    cache: dict[int, str],
    num_slots: int,
) -> str:
    """The continuous-batching notebook's picture of `plan`: each request in the step, its tokens so far
    (prompt then output; `seqs` maps a seq id to an object with `prompt_token_ids` and
    `output_token_ids`) as boxes. `cache` keeps each token id's text between steps."""
    columns: list[list[str]] = []
    for sid in plan.req_ids.tolist():
        seq = seqs.get(sid)
        if seq is None:
            continue
        texts = []
        for t in [*seq.prompt_token_ids, *seq.output_token_ids]:
            if t not in cache:
                cache[t] = tokenizer.decode([t]).strip() or repr(tokenizer.decode([t]))[1:-1]
            texts.append(cache[t])
        columns.append(texts)
    return visualize_batch_boxes(columns, num_slots if columns else 0)


def visualize_batch_boxes(columns: list[list[str]], num_slots: int, cell: int = 14) -> str:
    """The continuous-batching notebook's picture of a step (vLLM's `enable_log_batch_visualization`): one column per batch slot ("Batch 1".."Batch N"), each running
    request's tokens so far stacked in boxes, one box per token."""
    width = cell + 2
    lines = [
        "".join(f" Batch {i + 1}".ljust(width) for i in range(num_slots)).rstrip(),
        "─" * (width * num_slots),
    ]
    for r in range(max((len(c) for c in columns), default=0)):
        cells = [c[r] if r < len(c) else None for c in columns]
        blank = " " * width
        lines.append("".join("┌" + "─" * cell + "┐" if t is not None else blank for t in cells).rstrip())
        lines.append(
            "".join("│ " + _fit(t, cell - 2) + " │" if t is not None else blank for t in cells).rstrip()
        )
        lines.append("".join("└" + "─" * cell + "┘" if t is not None else blank for t in cells).rstrip())
    return "\n".join(lines)
