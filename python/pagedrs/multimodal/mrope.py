"""M-RoPE positions of a step (Qwen2-VL's 3-D rotary positions, as vLLM's `MRotaryEmbedding` inputs): a
request with a table (`EngineCoreRequest.mrope_positions`, [3, L] over its prompt) takes its prompt rows
from the table and every later position p as p + delta in all three rows; a request without one (a text
prompt) takes p in all three."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = ["MRopeTable", "mrope_table", "step_mrope_positions"]

MRopeTable = tuple[np.ndarray, int]  # ([3, L] int64, delta)


def mrope_table(flat: list[int], delta: int) -> MRopeTable:
    """The table of a request from its flattened row-major [3, L] positions."""
    arr = np.asarray(flat, dtype=np.int64)
    if arr.size % 3:
        raise ValueError(f"mrope_positions has {arr.size} values, not a multiple of 3")
    return arr.reshape(3, -1), int(delta)


def step_mrope_positions(
    positions: np.ndarray, qsl: np.ndarray, req_ids: np.ndarray, tables: Mapping[int, MRopeTable]
) -> np.ndarray:
    """[3, T] int64 positions of the step's flattened tokens."""
    num_tokens = int(qsl[-1])
    pos = np.asarray(positions[:num_tokens], dtype=np.int64)
    out = np.repeat(pos[None, :], 3, axis=0)
    if not tables:
        return out
    for b, sid in enumerate(req_ids.tolist()):
        entry = tables.get(sid)
        if entry is None:
            continue
        table, delta = entry
        lo, hi = int(qsl[b]), int(qsl[b + 1])
        p = pos[lo:hi]
        inside = p < table.shape[1]
        rows = out[:, lo:hi]
        rows[:, inside] = table[:, p[inside]]
        rows[:, ~inside] = p[~inside] + delta
    return out
