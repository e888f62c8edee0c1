"""Liquid scaling from the engine core's side: moves between degrees and the automatic policy, always
between two steps. A move runs its own block-ops steps (the pool shrinking before a scale-in) through the
core's plain step, never from inside another step."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from pagedrs import _core
from pagedrs.config import ParallelConfig
from pagedrs.executor.liquid.executor import LiquidExecutor
from pagedrs.executor.liquid.log import event_header, finished_line, log_receives, log_sends, shard_moves
from pagedrs.executor.liquid.policy import LiquidAutoPolicy

__all__ = ["LiquidControl"]

logger = logging.getLogger("pagedrs.engine")


class LiquidControl:
    """`run_step()` runs one schedule -> execute -> update step (its outputs are the caller's to keep)."""

    def __init__(
        self,
        executor: LiquidExecutor,
        scheduler: _core.Scheduler,
        parallel: ParallelConfig,
        run_step: Callable[[], None],
    ) -> None:
        self.executor = executor
        self.scheduler = scheduler
        self._run_step = run_step
        self._moving = False
        self.policy: LiquidAutoPolicy | None = None
        if parallel.liquid_auto:
            self.policy = LiquidAutoPolicy(
                executor.max_degree,
                parallel.liquid_auto_window,
                parallel.liquid_scale_out_threshold,
                parallel.liquid_scale_in_threshold,
            )

    @property
    def degree(self) -> int:
        return self.executor.degree

    def move(self, target: int) -> list[dict[str, Any]]:
        """Move to `target` active ranks (a power of two within liquid_gpu_range), one doubling or halving
        at a time: running and waiting requests carry on. The pool grows after each scale-out and shrinks
        before each scale-in (ValueError with the numbers when the live blocks do not fit; the engine
        keeps serving at the degree it reached). Returns one record per event."""
        ex = self.executor
        target = int(target)
        if target < 1 or target & (target - 1) or target > ex.max_degree:
            raise ValueError(
                f"liquid target must be a power of two from 1 to {ex.max_degree} active ranks, got {target}"
            )
        events: list[dict[str, Any]] = []
        self._moving = True
        try:
            while ex.degree != target:
                events.append(self._move_once(target))
        finally:
            self._moving = False
        return events

    def _move_once(self, target: int) -> dict[str, Any]:
        """One doubling or halving, logged as the liquid fork logs an event (`executor.liquid_log`)."""
        ex, sched = self.executor, self.scheduler
        n, src = len(ex.events), ex.degree
        dst = src * 2 if target > src else src // 2
        before = int(sched.num_blocks)
        start = time.perf_counter()
        moves = shard_moves(src, dst, ex.num_shards)
        logger.info("%s", event_header(n, src, dst, ex.devices, ex.device_word))
        shrink_seconds = 0.0
        if dst < src:
            shrunk = ex.target_blocks(dst)
            s = sched.stats()
            logger.info(
                "Shrink to: #%d, currently using blocks: #%d",
                shrunk,
                int(s.num_blocks) - int(s.num_free_blocks),
            )
            if shrunk < sched.num_blocks:
                sched.resize(shrunk)  # ResizeError (a ValueError) names both numbers
                self._run_step()  # its plan applies the shrink on every rank before the shards move
            shrink_seconds = time.perf_counter() - start
        for m in moves:
            logger.info(
                "Start to do liquid from src: %d to dst: %d with shard_ids: %s", m.src, m.dst, m.shard_ids
            )
        stats = ex.scale_once(dst)
        mine = moves[0]  # rank 0's pair: it sends on a scale-out, receives on a scale-in
        (log_sends if dst > src else log_receives)(stats, mine)
        if dst > src:
            grown = ex.target_blocks(dst)
            if grown > sched.num_blocks:
                sched.resize(grown)  # the next plan grows the pool on every active rank
            logger.info("After scale out, num_gpu_blocks: #%d", int(sched.num_blocks))
        stats.num_blocks_before = before
        stats.num_blocks_after = int(sched.num_blocks)
        logger.info(
            "%s, current mem info on %s%d: %s, current gpu block: #%d",
            finished_line(n, stats, moves, shrink_seconds, time.perf_counter() - start),
            ex.device_word,
            ex.devices[0],
            ex.memory_info(),
            stats.num_blocks_after,
        )
        return dataclasses.asdict(stats)

    def tick(self, waiting_prompt_tokens: int) -> None:
        """Feed the automatic policy one sample of the concurrent cache usage ((used blocks + waiting
        prompt tokens / block size) / total blocks) and act on it."""
        policy = self.policy
        if policy is None or self._moving:
            return
        s = self.scheduler.stats()
        total = int(s.num_blocks)
        used = total - int(s.num_free_blocks)
        policy.observe((used + waiting_prompt_tokens / self.scheduler.block_size) / max(total, 1))
        ex = self.executor
        decision = policy.decide(ex.degree, used, ex.target_blocks)
        if decision is None:
            return
        target, why = decision
        logger.info("liquid auto: %s", why)
        try:
            self.move(target)
        except ValueError as exc:
            logger.warning("liquid auto: the move to %d ranks did not happen: %s", target, exc)
        finally:
            policy.reset()
