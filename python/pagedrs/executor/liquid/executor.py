"""Rank 0 of a liquid group: a tensor-parallel executor whose degree changes while it serves.

It starts at degree 1 (rank 0 holds every shard, the other ranks idle) and moves one doubling or halving
at a time (`scale_once`); `EngineCore.liquid` wraps that with the pool, sized from each rank's memory
after the move (`target_blocks`): grow after a scale-out (each rank's KV heads halve and the weight
shards it sent free their memory), shrink before a scale-in (live blocks moved below the new end by the
scheduler's resize, applied by one step on every rank).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

from pagedrs.executor.executor import TPExecutor
from pagedrs.executor.liquid.log import memory_info
from pagedrs.executor.liquid.shards import (
    LiquidStats,
    PoolSpec,
    rebuild_model,
    receive_shards,
    send_shards,
    weight_bytes,
)
from pagedrs.executor.rank_processes import RankProcesses
from pagedrs.executor.step_packet import liquid_header
from pagedrs.multimodal import MultiModalItem
from pagedrs.multimodal.mrope import MRopeTable
from pagedrs.runner.kv_cache import KVCachePool
from pagedrs.runner.model_runner import ModelRunner

__all__ = ["LiquidExecutor"]

logger = logging.getLogger("pagedrs.liquid")


class LiquidExecutor(TPExecutor):
    def __init__(self, runner: ModelRunner, ranks: RankProcesses) -> None:
        super().__init__(runner, ranks)
        assert ranks.world is not None, "a liquid group has a world group"
        self.world = ranks.world
        self.groups = ranks.groups
        self.max_degree = self.world.size
        self.devices = list(runner.config.parallel.liquid_gpu_range or range(self.max_degree))
        self.events: list[LiquidStats] = []
        self._budget = 0  # bytes of KV pool per rank, from the first sizing
        self._weights = self._replicated = 0  # parameter bytes at degree 1, and of those replicated

    def add_mm_request(
        self, seq_ids: Sequence[int], items: list[MultiModalItem], mrope: MRopeTable | None = None
    ) -> None:
        raise ValueError(
            "images are not supported under liquid scaling (the active group changes under them)"
        )

    @property
    def degree(self) -> int:
        """Active ranks: the size of the group the model's collectives run over now."""
        return self.runner.tp.size

    def _init_pool(self) -> KVCachePool:
        """Rank 0 alone holds the model at first; its pool is sized as on one device."""
        runner = self.runner
        quantized = ("qweight", "kernel_weight")  # kept for the CPU kernels, or MoE experts for the CUDA ones
        if any(getattr(m, q, None) is not None for m in runner.model.modules() for q in quantized):
            raise ValueError(
                "liquid scaling moves float weights between ranks, and this model's weights are kept "
                "quantized: pass dtype='float32' to load them dequantized"
            )
        pool = runner.init_kv_cache(runner.determine_num_blocks())
        runner.cuda_graphs = None  # the model object changes under the runner: eager steps only
        self._budget = pool.num_blocks * pool.bytes_per_block
        self._weights, self._replicated = weight_bytes(runner.model)  # at degree 1: every shard
        return pool

    def target_blocks(self, degree: int) -> int:
        """Blocks each rank's pool holds at `degree`, sized from the memory a rank has after the move, as
        the liquid fork does: the KV budget rank 0 was sized with at degree 1 (the start-up rule: the
        profiled GPU memory, or the CPU budget) plus the weight bytes a rank no longer holds at `degree`,
        over the bytes of a block at `degree` (fewer KV heads per block). Every rank holds the same
        shard sizes, so rank 0's number is each rank's; on GPUs this assumes the ranks' devices have rank
        0's memory (it is not measured on each)."""
        cache, sched = self.runner.config.cache, self.runner.config.scheduler
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        pool = self.runner.kv_pool
        assert pool is not None
        per_block = pool.bytes_per_block * self.degree // degree
        held = self._replicated + (self._weights - self._replicated) // degree
        num = (self._budget + self._weights - held) // per_block
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
            group_blocks = [pool.group_num_blocks(g) for g in range(len(pool.groups))]
            self.world.broadcast_cpu(
                liquid_header(src, dst, pool.num_blocks, pool.num_swap_blocks, group_blocks)
            )
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
                    pool_spec=PoolSpec(pool.num_blocks, pool.num_swap_blocks, pool.block_size, pool.dtype),
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

    @property
    def num_shards(self) -> int:
        return int(self.runner.config.parallel.liquid_total_num_shards or self.max_degree)

    @property
    def device_word(self) -> str:
        """How the liquid fork's log names a device: GPUs on CUDA, ranks on CPU."""
        return "GPU" if self.runner.device.type == "cuda" else "rank"

    def memory_info(self) -> str:
        """Rank 0's memory as the liquid fork reports it (`liquid_log.memory_info`)."""
        runner = self.runner
        held = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        pool = runner.kv_pool
        if pool is not None:
            held += sum(t.numel() * t.element_size() for t in pool.kv_caches)
        return memory_info(runner.device, self.devices[0], held)
