"""Helpers of the data-parallel tests: a tiny model's engine settings (1 thread per replica), prompts
with and without a shared prefix, greedy runs through `AsyncLLMEngine`, and process checks."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from pagedrs import SamplingParams
from pagedrs.engine.async_engine import AsyncLLMEngine

# Small pools and budgets: chunked prefill fires (16-token steps) and the prefix cache is 4-token blocks.
ENGINE: dict[str, Any] = dict(
    device="cpu",
    dtype="float32",
    block_size=4,
    num_kv_blocks=64,
    max_num_batched_tokens=16,
    disable_log_stats=True,
    num_threads=1,
    max_model_len=256,
)
SHARED = list(range(30, 62))  # 8 blocks
PREFIXED = [SHARED + [i, i + 1] for i in range(1, 13, 2)]
DISTINCT = [[(17 * i + j) % 250 + 3 for j in range(12)] for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


async def greedy_ids(
    engine: AsyncLLMEngine, prompts: list[list[int]], *, concurrent: bool = True, tag: str = "g"
) -> list[list[int]]:
    """Each prompt's greedy token ids (all at once, or one after the other)."""

    async def one(i: int, prompt: list[int]) -> list[int]:
        outs = [o async for o in engine.generate(f"{tag}{i}-{time.monotonic_ns()}", prompt, GREEDY)]
        return list(outs[-1].outputs[0].token_ids)

    if concurrent:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    return [await one(i, p) for i, p in enumerate(prompts)]


def routed(engine: AsyncLLMEngine) -> list[int]:
    """Requests the router sent to each replica so far."""
    assert engine.router is not None
    return [r.routed for r in engine.router.snapshot()]


def gone(pid: int, timeout: float = 20.0) -> bool:
    """The process exited (or is a zombie) within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.1)
    return False
