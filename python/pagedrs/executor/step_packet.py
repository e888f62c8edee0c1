"""A step plan as two int64 CPU tensors, for the one broadcast per step from rank 0 to the other ranks.

The header (fixed length) carries the opcode, the payload length, the plan's scalars and the length of
each array; the payload is every array the forward needs, concatenated. No per-request Python objects
and no pickle: what a worker receives is exactly what `ModelRunner.execute_model` reads.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch

from pagedrs.worker.model_runner import PlanLike

__all__ = [
    "HEADER_LEN",
    "Op",
    "WorkerStep",
    "liquid_header",
    "pack_step",
    "shutdown_header",
    "unpack_step",
]


class Op(IntEnum):
    EXECUTE = 1
    SHUTDOWN = 2
    LIQUID = 3  # header[2:6] = from degree, to degree, pool blocks, swap blocks


# (name, dtype the runner expects, number of columns: 0 = 1-d)
_ARRAYS: tuple[tuple[str, type, int], ...] = (
    ("input_ids", np.int64, 0),
    ("positions", np.int64, 0),
    ("slot_mapping", np.int64, 0),
    ("query_start_loc", np.int32, 0),
    ("seq_lens", np.int32, 0),
    ("num_scheduled_tokens", np.int32, 0),
    ("logits_indices", np.int64, 0),
    ("block_tables", np.int32, -1),  # columns in the header
    ("block_moves", np.int64, 2),
    ("swap_out", np.int64, 2),
    ("swap_in", np.int64, 2),
    ("copies", np.int64, 2),
    ("extra_logits_indices", np.int64, 0),
)
_SCALARS = ("num_blocks", "num_tokens", "num_decode_tokens")
# op, payload length, scalars, block-table columns, one length per array
HEADER_LEN = 2 + len(_SCALARS) + 1 + len(_ARRAYS)
_EMPTY_I32 = np.zeros(0, dtype=np.int32)
_EMPTY_I64 = np.zeros(0, dtype=np.int64)


class WorkerStep:
    """A plan as a non-driver rank sees it (the `PlanLike` the runner reads)."""

    num_blocks: int
    num_tokens: int
    num_decode_tokens: int
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    num_scheduled_tokens: np.ndarray
    logits_indices: np.ndarray
    block_tables: np.ndarray
    block_moves: np.ndarray
    swap_out: np.ndarray
    swap_in: np.ndarray
    copies: np.ndarray
    extra_logits_indices: np.ndarray
    # Driver-only bookkeeping, empty here: workers read the dense block_tables, not a mirror.
    num_computed_tokens = _EMPTY_I32
    req_ids = _EMPTY_I64
    block_table_rows = _EMPTY_I32
    changed_rows = _EMPTY_I32


def pack_step(plan: PlanLike, extra_logits_indices: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) for one EXECUTE step."""
    header = np.zeros(HEADER_LEN, dtype=np.int64)
    header[0] = Op.EXECUTE
    header[2 : 2 + len(_SCALARS)] = [int(getattr(plan, s)) for s in _SCALARS]
    parts: list[np.ndarray] = []
    base = 2 + len(_SCALARS)
    for i, (name, _, cols) in enumerate(_ARRAYS):
        if name == "extra_logits_indices":
            arr = extra_logits_indices if extra_logits_indices is not None else _EMPTY_I64
        else:
            arr = getattr(plan, name)
        if cols == -1:
            header[base] = arr.shape[1] if arr.ndim == 2 else 0
        flat = np.ascontiguousarray(arr, dtype=np.int64).reshape(-1)
        header[base + 1 + i] = flat.size
        parts.append(flat)
    payload = np.concatenate(parts) if parts else _EMPTY_I64
    header[1] = payload.size
    return torch.from_numpy(header), torch.from_numpy(payload)


def shutdown_header() -> torch.Tensor:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = Op.SHUTDOWN
    return header


def liquid_header(src: int, dst: int, num_blocks: int, num_swap_blocks: int) -> torch.Tensor:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = Op.LIQUID
    header[2:6] = torch.tensor([src, dst, num_blocks, num_swap_blocks])
    return header


def unpack_step(header: np.ndarray, payload: np.ndarray) -> WorkerStep:
    step = WorkerStep()
    for name, value in zip(_SCALARS, header[2 : 2 + len(_SCALARS)].tolist(), strict=True):
        setattr(step, name, int(value))
    base = 2 + len(_SCALARS)
    bt_cols = int(header[base])
    offset = 0
    for i, (name, dtype, cols) in enumerate(_ARRAYS):
        n = int(header[base + 1 + i])
        arr = payload[offset : offset + n].astype(dtype)
        offset += n
        if cols == -1:
            arr = arr.reshape(-1, bt_cols) if bt_cols else arr.reshape(0, 0)
        elif cols:
            arr = arr.reshape(-1, cols)
        setattr(step, name, arr)
    return step
