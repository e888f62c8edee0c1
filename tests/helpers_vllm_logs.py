"""What users of vLLM read in its logs: its lines as regexes (numbers made patterns, the text as vLLM 0.4
and later versions print it) and the continuous-batching notebook's parser of the batch pictures in a
server log (its logic as the notebook has it)."""

from __future__ import annotations

import re
from pathlib import Path

_NUM = r"[0-9]+(?:\.[0-9]+)?"

# vLLM 0.4's periodic stats line, e.g. "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput:
# 2.8 tokens/s, Running: 1 reqs, Swapped: 0 reqs, Pending: 0 reqs, GPU KV cache usage: 21.2%, CPU KV cache
# usage: 0.0%" (the whole message: nothing before or after it).
STATS_LINE = re.compile(
    rf"^Avg prompt throughput: (?P<prompt>{_NUM}) tokens/s, Avg generation throughput: (?P<gen>{_NUM}) "
    r"tokens/s, Running: (?P<running>\d+) reqs, Swapped: (?P<swapped>\d+) reqs, Pending: (?P<pending>\d+) "
    rf"reqs, GPU KV cache usage: (?P<gpu>{_NUM})%, CPU KV cache usage: (?P<cpu>{_NUM})%$"
)
# vLLM's prefix-cache line after it.
HIT_RATE_LINE = re.compile(rf"^Prefix cache hit rate: GPU: (?P<gpu>{_NUM})%, CPU: (?P<cpu>{_NUM})%$")

# Start-up lines: vLLM 0.4's config line (resolved values) and block counts, later versions' cache lines.
CONFIG_LINE = re.compile(
    r"Initializing an LLM engine \((?:pagedrs )?v[^)]+\) with config: model='(?P<model>[^']+)', .*"
    r"dtype=(?P<dtype>torch\.\w+), max_seq_len=(?P<max_seq_len>\d+), .*device_config=(?P<device>cpu|cuda)"
)
GPU_CPU_BLOCKS = re.compile(r"# GPU blocks: (?P<gpu>\d+), # CPU blocks: (?P<cpu>\d+)")
KV_CACHE_SIZE = re.compile(r"(?P<where>GPU|CPU) KV cache size: (?P<tokens>[0-9,]+) tokens")
MAX_CONCURRENCY = re.compile(
    r"Maximum concurrency for (?P<len>[0-9,]+) tokens per request: (?P<x>[0-9]+\.[0-9]{2})x"
)
CHUNKED_PREFILL = re.compile(r"Chunked prefill is enabled with max_num_batched_tokens=(?P<n>\d+)\.")
CASTING = re.compile(r"Casting torch\.bfloat16 to torch\.float16\.")


def as_int(text: str) -> int:
    """A number vLLM prints with thousands separators ("527,328")."""
    return int(text.replace(",", ""))


def get_next_batch(file_path: str | Path, line_to_start_at: int) -> tuple[str | None, int]:
    """The continuous-batching notebook's `get_next_batch`: from a byte offset, the lines from the first
    one holding "Batch" up to (not including) the next line holding "INFO" or "Batch"; returns (batch,
    next offset). Kept as the notebook has it (its exception print left out: errors raise here)."""
    with open(file_path, "rb") as file:
        file.seek(0, 2)  # Go to the end of the file
        file_size = file.tell()
        if line_to_start_at >= file_size:
            return None, line_to_start_at  # No new content
        file.seek(line_to_start_at)
        content = file.read()
        lines = content.split(b"\n")
        batch_start = None
        for i, line in enumerate(lines):
            if b"Batch" in line:
                batch_start = i
                break
        if batch_start is not None:
            batch_lines = []
            for j in range(batch_start, len(lines)):
                if b"INFO" in lines[j] or (b"Batch" in lines[j] and j > batch_start):
                    break
                batch_lines.append(lines[j])
            if batch_lines:
                next_batch = b"\n".join(batch_lines).decode("utf-8", errors="replace")
                new_line_to_start_at = line_to_start_at + sum(len(line) + 1 for line in lines[:j])
                return next_batch, new_line_to_start_at
        return None, file_size  # No batch found, return the current file size as the new starting point


def notebook_batches(log_file_path: str | Path) -> list[str]:
    """The batches the notebook's `print_batches` loop prints from a log, in order."""
    found: list[str] = []
    last_processed_line = 0
    while True:
        batch, last_processed_line = get_next_batch(log_file_path, last_processed_line)
        if not batch:
            return found
        found.append(batch)
