"""Rank 0 of a liquid group: a tensor-parallel executor whose degree changes while it serves.

It starts at degree 1 (rank 0 holds every shard, the other ranks idle) and moves one doubling or halving
at a time (`scale_once`); `EngineCore.liquid` wraps that with the pool: grow after a scale-out (each
rank's KV heads halve, so the same memory holds twice the blocks), shrink before a scale-in (live
blocks moved below the new end by the scheduler's resize, applied by one step on every rank).
"""

from __future__ import annotations

import logging
import math
import time

from pagedrs.executor.executor import TPExecutor
from pagedrs.executor.liquid import LiquidStats, rebuild_model, receive_shards, send_shards
from pagedrs.executor.step_packet import liquid_header
from pagedrs.executor.workers import RankProcesses
from pagedrs.worker.kv_cache import KVCachePool
from pagedrs.worker.model_runner import ModelRunner

__all__ = ["LiquidExecutor"]

logger = logging.getLogger("pagedrs.liquid")

_GiB = 1 << 30


class LiquidExecutor(TPExecutor):
    def __init__(self, runner: ModelRunner, workers: RankProcesses) -> None:
        super().__init__(runner, workers)
        assert workers.world is not None, "a liquid group has a world group"
        self.world = workers.world
        self.groups = workers.groups
        self.max_degree = self.world.size
        self.devices = list(runner.config.parallel.liquid_gpu_range or range(self.max_degree))
        self.events: list[LiquidStats] = []
        self._budget = 0  # bytes of KV pool per rank, from the first sizing

    @property
    def degree(self) -> int:
        """Active ranks: the size of the group the model's collectives run over now."""
        return self.runner.tp.size

    def _init_pool(self) -> KVCachePool:
        """Rank 0 alone holds the model at first; its pool is sized as on one device."""
        runner = self.runner
        pool = runner.init_kv_cache(runner.determine_num_blocks())
        runner.cuda_graphs = None  # the model object changes under the runner: eager steps only
        self._budget = pool.num_blocks * pool.bytes_per_block
        return pool

    def target_blocks(self, degree: int) -> int:
        """Blocks each rank's pool holds at `degree` (the same memory, fewer or more KV heads per block)."""
        cache, sched = self.runner.config.cache, self.runner.config.scheduler
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        pool = self.runner.kv_pool
        assert pool is not None
        per_block = pool.bytes_per_block * self.degree // degree
        num = self._budget // per_block
        if self.runner.device.type == "cpu" and cache.cpu_kv_cache_gb is None:
            num = min(num, sched.max_num_seqs * math.ceil(sched.max_model_len / cache.block_size))
        return int(num)

    def scale_once(self, dst: int) -> LiquidStats:
        """One doubling or halving of the active ranks (the pool already shrunk for a scale-in)."""
        self.check_health()
        src = self.degree
        if dst not in (2 * src, src // 2) or not 1 <= dst <= self.max_degree:
            raise ValueError(
                f"liquid: cannot move from {src} to {dst} active ranks (range of {self.max_degree})"
            )
        runner = self.runner
        pool = runner.kv_pool
        assert pool is not None
        stats = LiquidStats(src, dst, pool.num_blocks, pool.num_blocks)
        start = time.perf_counter()
        try:
            self.world.broadcast_cpu(liquid_header(src, dst, pool.num_blocks, pool.num_swap_blocks))
            if dst > src:  # rank 0 keeps the first half of its shards, rank `src` takes the rest
                model, new_pool = send_shards(
                    runner.model,
                    pool,
                    world=self.world,
                    partner=src,
                    scale_out=True,
                    new_tp=self.groups[dst],
                    stats=stats,
                )
            else:  # rank `dst` hands rank 0's partner shards back
                m = runner.model
                model, new_pool = receive_shards(
                    m,
                    pool,
                    world=self.world,
                    partner=dst,
                    scale_out=False,
                    new_model=rebuild_model(type(m), m.config, m.dtype, runner.device, self.groups[dst]),
                    pool_spec=(pool.num_blocks, pool.num_swap_blocks, pool.block_size, pool.dtype),
                    stats=stats,
                )
        except Exception as exc:
            raise self._fail(exc) from exc
        assert model is not None and new_pool is not None, "rank 0 keeps a model at every degree"
        runner.model = model
        runner.kv_pool = new_pool
        runner.tp = self.groups[dst]
        stats.total_seconds = time.perf_counter() - start
        self.events.append(stats)
        return stats

    def describe(self, stats: LiquidStats) -> str:
        """vLLM 0.5's liquid fork's log line for one event."""
        kind = "Scale out" if stats.dst_degree > stats.src_degree else "Scale in"
        what = "GPU" if self.runner.device.type == "cuda" else "rank"
        lo, hi = sorted((stats.src_degree, stats.dst_degree))
        moved = self.devices[lo:hi]
        home = self.devices[: hi - lo]
        src, dst = (home, moved) if kind == "Scale out" else (moved, home)

        def rate(b: int, s: float) -> str:
            return f"{b / _GiB / s:.2f} GB/s" if s > 0 else "-"

        return (
            f"{kind} from {what}{src} to {what}{dst}: weights {stats.weight_bytes / _GiB:.4f} GB in "
            f"{stats.weight_seconds:.3f} s ({rate(stats.weight_bytes, stats.weight_seconds)}), KV cache "
            f"{stats.kv_bytes / _GiB:.4f} GB in {stats.kv_seconds:.3f} s ({rate(stats.kv_bytes, stats.kv_seconds)}), "
            f"block pool {stats.num_blocks_before} -> {stats.num_blocks_after} blocks, "
            f"{stats.total_seconds:.3f} s in all; {stats.dst_degree} of {self.max_degree} ranks active"
        )
