"""The step channel from the tensor-parallel driver (rank 0) to the other ranks: one fixed-length int64
header per message, then for a step its payload.

A step's header and payload are `_core.StepPlan.to_wire` / `from_wire`: the format is built from the Rust
plan itself (no second declaration of its fields here), and a non-driver rank runs the same
`_core.StepPlan` type the driver does. No per-request Python objects and no pickle. The other opcodes are
control messages carried in the header alone, but for LORA: header[1] bytes of msgpack (a
`pagedrs.lora.manager.LoRAWire`) follow it as a uint8 tensor, before the step they apply to. Every KV-cache
group's tables travel inside the plan itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

import numpy as np
import torch

from pagedrs import _core

__all__ = [
    "HEADER_LEN",
    "Op",
    "liquid_group_blocks",
    "liquid_header",
    "lora_header",
    "pack_step",
    "shutdown_header",
    "unpack_step",
]

HEADER_LEN: int = _core.STEP_WIRE_HEADER_LEN


class Op(IntEnum):
    EXECUTE = 1  # the header and payload of `StepPlan.to_wire`
    SHUTDOWN = 2
    LIQUID = (
        3  # header[2:7] = from degree, to degree, pool blocks, swap blocks, G; [7:7+G] each group's blocks
    )
    LORA = 4  # header[1] = bytes of the LoRA message that follows


def pack_step(
    plan: _core.StepPlan, extra_logits_indices: np.ndarray | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) for one EXECUTE step."""
    header, payload = plan.to_wire(extra_logits_indices)
    return torch.from_numpy(header), torch.from_numpy(payload)


def unpack_step(header: np.ndarray, payload: np.ndarray) -> tuple[_core.StepPlan, np.ndarray]:
    """(plan, extra logits rows) of an EXECUTE message; ValueError if it does not add up."""
    return _core.StepPlan.from_wire(np.ascontiguousarray(header), np.ascontiguousarray(payload))


def _control(op: Op, *values: int) -> torch.Tensor:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = op
    if values:
        header[2 : 2 + len(values)] = torch.tensor(values)
    return header


def shutdown_header() -> torch.Tensor:
    return _control(Op.SHUTDOWN)


def liquid_header(
    src: int, dst: int, num_blocks: int, num_swap_blocks: int, group_blocks: Sequence[int] = ()
) -> torch.Tensor:
    """A liquid event: the degrees, and the pools a rank that was idle builds (`group_blocks`: the blocks of
    each KV-cache group's own pool)."""
    if 7 + len(group_blocks) > HEADER_LEN:
        raise ValueError(f"{len(group_blocks)} KV-cache groups do not fit a step header of {HEADER_LEN}")
    return _control(Op.LIQUID, src, dst, num_blocks, num_swap_blocks, len(group_blocks), *group_blocks)


def liquid_group_blocks(header: np.ndarray) -> tuple[int, ...]:
    """Each KV-cache group's blocks of a `liquid_header`."""
    return tuple(int(n) for n in header[7 : 7 + int(header[6])])


def lora_header(num_bytes: int) -> torch.Tensor:
    header = _control(Op.LORA)
    header[1] = num_bytes
    return header
