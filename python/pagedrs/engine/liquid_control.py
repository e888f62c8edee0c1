"""Liquid scaling from the engine core's side: moves between degrees and the automatic policy, always
between two steps. A move runs its own block-ops steps (the pool shrinking before a scale-in) through the
core's plain step, never from inside another step."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from pagedrs import _core
from pagedrs.config import ParallelConfig
from pagedrs.executor.liquid_executor import LiquidExecutor
from pagedrs.executor.liquid_policy import LiquidAutoPolicy

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
        ex, sched = self.executor, self.scheduler
        before = int(sched.num_blocks)
        if target > ex.degree:
            stats = ex.scale_once(ex.degree * 2)
            grown = ex.target_blocks(ex.degree)
            if grown > sched.num_blocks:
                sched.resize(grown)  # the next plan grows the pool on every active rank
        else:
            dst = ex.degree // 2
            shrunk = ex.target_blocks(dst)
            if shrunk < sched.num_blocks:
                sched.resize(shrunk)  # ResizeError (a ValueError) names both numbers
                self._run_step()  # its plan applies the shrink on every rank before the shards move
            stats = ex.scale_once(dst)
        stats.num_blocks_before = before
        stats.num_blocks_after = int(sched.num_blocks)
        logger.info("%s", ex.describe(stats))
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
