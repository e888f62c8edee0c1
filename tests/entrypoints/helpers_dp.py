"""Helpers of the data-parallel server tests: a tiny model served with `-dp 2` (1 thread per replica),
the per-replica routing counters from /metrics, and the server's process tree."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import child_pids

DP_FLAGS = [
    "--data-parallel-size",
    "2",
    "--block-size",
    "4",
    "--max-num-batched-tokens",
    "16",
    "--max-model-len",
    "256",
    "--num-kv-blocks",
    "64",
    "--max-engine-restarts",
    "2",
    "--disable-log-stats",
]
SHARED = "The tenant's long system prompt, shared by every request it sends. "


def dp_flags(model: Path, *extra: str) -> list[str]:
    return ["--model", str(model), *DP_FLAGS, *extra]


def start_dp_server(server: Any) -> Any:
    """Starts a `SubprocessServer` with a 2-thread budget: each of the 2 replicas gets 1 thread."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "2")
        return server.start()


def routed(metrics_text: str) -> dict[str, float]:
    """`pagedrs:dp_routed_requests` per engine label."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        m = re.match(r'pagedrs:dp_routed_requests_total\{.*engine="(\d+)".*\} (\S+)', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def tree(pid: int) -> list[int]:
    """Every descendant of `pid`."""
    out: list[int] = []
    todo = [pid]
    while todo:
        try:
            kids = child_pids(todo.pop())
        except OSError:
            continue
        out += kids
        todo += kids
    return out
