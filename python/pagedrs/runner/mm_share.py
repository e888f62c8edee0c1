"""Images under tensor parallelism: rank 0 runs the vision tower and every other rank takes its step's
encoder rows from it. The vision tower is small next to the text model and its layers are not split, so
running it once and broadcasting the rows (a few rows of the model's hidden size per image token) costs less
than running it on every rank, and the ranks then need neither the requests' pixels nor their M-RoPE
tables: rank 0 also broadcasts each step's [3, T] M-RoPE positions. Every rank calls these at the same
point of every step with tokens (a model that takes images only), so the broadcasts line up."""

from __future__ import annotations

import torch
from torch import Tensor

from pagedrs.distributed.group import TPGroup
from pagedrs.multimodal import MultiModalBatch
from pagedrs.multimodal.encoder_cache import MultiModalStep

__all__ = ["share_mm_step", "share_positions"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def share_mm_step(
    tp: TPGroup, mm: MultiModalStep | None, num_tokens: int, device: torch.device
) -> MultiModalStep | None:
    """Rank 0's `mm` for this step (None: no image rows), on every rank."""
    header = torch.zeros(6, dtype=torch.int64)
    if tp.is_driver and mm is not None:
        embeds = mm.batch.embeds
        limits = mm.key_limits
        header = torch.tensor(
            [
                1,
                embeds.shape[0],
                embeds.shape[1],
                _DTYPES.index(embeds.dtype),
                limits is not None,
                len(mm.key_limit_reqs),
            ],
            dtype=torch.int64,
        )
    tp.broadcast_cpu(header)
    has_mm, rows, width, dtype_index, has_limits, num_reqs = (int(x) for x in header.tolist())
    if not has_mm:
        return None
    if tp.is_driver:
        assert mm is not None
        embeds = mm.batch.embeds.detach().cpu().contiguous()
        mask = mm.batch.mask.cpu().to(torch.uint8)
        limits = mm.key_limits.cpu() if mm.key_limits is not None else torch.empty(0, dtype=torch.int64)
        reqs = torch.tensor(mm.key_limit_reqs, dtype=torch.int64)
    else:
        embeds = torch.empty(rows, width, dtype=_DTYPES[dtype_index])
        mask = torch.empty(num_tokens, dtype=torch.uint8)
        limits = torch.empty(num_tokens if has_limits else 0, dtype=torch.int64)
        reqs = torch.empty(num_reqs, dtype=torch.int64)
    for t in (embeds, mask, limits, reqs):
        if t.numel():
            tp.broadcast_cpu(t)
    if tp.is_driver:
        return mm
    batch = MultiModalBatch(embeds.to(device), mask.bool().to(device))
    key_limits = limits.to(device) if has_limits else None
    return MultiModalStep(batch, key_limits, reqs.tolist())


def share_positions(tp: TPGroup, positions: Tensor) -> Tensor:
    """Rank 0's [3, T] M-RoPE positions of this step, on every rank (`positions`: this rank's, same shape)."""
    rows = positions.detach().cpu().to(torch.int64).contiguous()
    tp.broadcast_cpu(rows)
    return positions if tp.is_driver else rows.to(device=positions.device, dtype=positions.dtype)
