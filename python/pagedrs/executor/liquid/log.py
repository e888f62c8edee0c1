"""The liquid fork's log block for one scale event, line for line: the header, which shard ids move
between which ranks, each sender's weight and KV-cache send time and bandwidth, the pool after a
scale-out (or the shrink before a scale-in), each device's memory, and the closing line with the latency
breakdown. Rank 0 logs the block; every other rank logs its own sends and memory (as the fork's workers do).

Devices are named as the fork names them on GPUs ("GPU0", "GPU[0,1]"); on CPU the ranks ("rank0",
"rank[0,1]")."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from pagedrs.executor.liquid.shards import LiquidStats, liquid_position

__all__ = [
    "ShardMove",
    "event_header",
    "finished_line",
    "log_receives",
    "log_sends",
    "memory_info",
    "shard_moves",
]

logger = logging.getLogger("pagedrs.liquid")

_GB = 1 << 30  # the fork's "GB" are GiB (torch's byte counts / 2**30)


@dataclass(frozen=True)
class ShardMove:
    """The shard ids rank `src` hands to rank `dst` in one event."""

    src: int
    dst: int
    shard_ids: list[int]


def shard_moves(src_degree: int, dst_degree: int, num_shards: int) -> list[ShardMove]:
    """Every pair's move. Rank r at degree d holds shards [p * S/d, (p + 1) * S/d) with p its position;
    a scale-out sends the second half of each active rank's shards to rank r + d, a scale-in sends all of
    rank r + d's back to rank r."""

    def held(rank: int, degree: int) -> list[int]:
        per = num_shards // degree
        p = liquid_position(rank, degree)
        return list(range(p * per, (p + 1) * per))

    if dst_degree > src_degree:
        return [
            ShardMove(r, r + src_degree, held(r, src_degree)[num_shards // dst_degree :])
            for r in range(src_degree)
        ]
    return [ShardMove(r, r - dst_degree, held(r, src_degree)) for r in range(dst_degree, src_degree)]


def _devices(word: str, ids: list[int]) -> str:
    return f"{word}{ids[0]}" if len(ids) == 1 else f"{word}[{','.join(map(str, ids))}]"


def event_header(n: int, src_degree: int, dst_degree: int, devices: list[int], word: str) -> str:
    """`---------Start N'th liquid: Scale out from GPU0 to GPU1---------` (N counts from 0)."""
    lo, hi = sorted((src_degree, dst_degree))
    moved, home = devices[lo:hi], devices[: hi - lo]
    out = dst_degree > src_degree
    src, dst = (home, moved) if out else (moved, home)
    kind = "Scale out" if out else "Scale in"
    return (
        f"---------Start {n}'th liquid: {kind} from {_devices(word, src)} to {_devices(word, dst)}---------"
    )


def _rate(num_bytes: int, seconds: float) -> str:
    return f"{num_bytes / _GB / seconds:.2f}GB/s" if seconds > 0 else "-"


def log_sends(stats: LiquidStats, move: ShardMove) -> None:
    """The sender's lines of one move (weights, then KV cache)."""
    logger.info(
        "send weights shards takes: %.2fs, sent out: %.2fGB, sent bw: %s",
        stats.weight_seconds,
        stats.weight_bytes / _GB,
        _rate(stats.weight_bytes, stats.weight_seconds),
    )
    logger.info(
        "send kvc shards takes: %.2fs, sent out: %.2fGB, sent bw: %s",
        stats.kv_seconds,
        stats.kv_bytes / _GB,
        _rate(stats.kv_bytes, stats.kv_seconds),
    )
    logger.info("Successfully send kv cache shards: %s to rank: %d", move.shard_ids, move.dst)


def log_receives(stats: LiquidStats, move: ShardMove) -> None:
    """The receiver's lines of one move (rank 0 on a scale-in; its sender logs the fork's send lines)."""
    logger.info(
        "recv weights shards takes: %.2fs, received: %.2fGB, recv bw: %s",
        stats.weight_seconds,
        stats.weight_bytes / _GB,
        _rate(stats.weight_bytes, stats.weight_seconds),
    )
    logger.info(
        "recv kvc shards takes: %.2fs, received: %.2fGB, recv bw: %s; shards %s from rank: %d",
        stats.kv_seconds,
        stats.kv_bytes / _GB,
        _rate(stats.kv_bytes, stats.kv_seconds),
        move.shard_ids,
        move.src,
    )


def memory_info(device: torch.device, index: int, held_bytes: int) -> str:
    """The fork's memory report of one device. On a GPU: torch's allocated and reserved bytes, the
    device's free memory and the reserved-but-unallocated ("frag") part. On CPU the rank's own tensors
    (weights + KV pool: `held_bytes`) and the host's available memory."""
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
        free = torch.cuda.mem_get_info(device)[0]
        return (
            f"allocated space on GPU {index}: {allocated / _GB:.3f} GB, reserved space on GPU {index}: "
            f"{reserved / _GB:.3f} GB, free space: {free / _GB:.3f}GB, frag space: {(reserved - allocated) / _GB:.3f}GB"
        )
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        free = 0
    return f"allocated space on rank {index}: {held_bytes / _GB:.3f} GB, free space: {free / _GB:.3f}GB"


def finished_line(
    n: int, stats: LiquidStats, moves: list[ShardMove], shrink_seconds: float, e2e_seconds: float
) -> str:
    """`Finished liquid for N times, output: Completed! Move shard: ... ;liquid e2e latency: ...`, without
    the memory part (the caller appends it)."""
    shards = sorted(s for m in moves for s in m.shard_ids)
    parts = [f"liquid e2e latency: {e2e_seconds:.2f}s"]
    if stats.dst_degree < stats.src_degree:
        parts.append(f"move and shrink latency: {shrink_seconds:.2f}s")
    parts += [
        f"liquid model weights latency: {stats.weight_seconds:.2f}s",
        f"liquid kvc latency: {stats.kv_seconds:.2f}s",
    ]
    return (
        f"Finished liquid for {n} times, output: Completed! Move shard: {shards} from "
        f"{[m.src for m in moves]} to {[m.dst for m in moves]};{', '.join(parts)};"
    )
