"""Executors: how the engine core runs a step plan on the model.

- `UniProcExecutor`: one device, the model runner in this process.
- `TPExecutor`: tensor parallelism. This process is rank 0 (it samples); each step it broadcasts the plan
  (`step_packet`: two int64 tensors over the gloo group, every KV-cache group's tables included) to ranks
  1..N-1, then runs its own shard; the all-reduces inside the forward keep the ranks in step. Requests'
  images stay on rank 0, which runs the vision tower and broadcasts the step's encoder rows
  (`runner.mm_share`).

A tensor-parallel failure (a rank that raised or died, or a collective that broke) is fatal to the
group: the executor names the rank, stops every worker and refuses further steps (`ExecutorDeadError`).
The engine core then ends (behind the server: the core process exits and is restarted).
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedrs._core import StepPlan
from pagedrs.distributed.group import TPGroup
from pagedrs.executor.rank import agree_kv_blocks
from pagedrs.executor.rank_processes import RankFailure, RankProcesses
from pagedrs.executor.startup_log import kv_pools_line
from pagedrs.executor.step_packet import lora_header, pack_step, shutdown_header
from pagedrs.layers.sampler import SamplingRow
from pagedrs.lora.manager import LoRAManager
from pagedrs.multimodal import MultiModalItem
from pagedrs.multimodal.mrope import MRopeTable
from pagedrs.runner.kv_cache import KVCachePool
from pagedrs.runner.kv_disk import DiskTierLink
from pagedrs.runner.kv_groups import WindowGroup, step_tokens
from pagedrs.runner.model_runner import ModelRunner
from pagedrs.runner.outputs import RunnerOutput

__all__ = ["ExecutorDeadError", "KVCacheSpec", "TPExecutor", "UniProcExecutor"]

logger = logging.getLogger("pagedrs.executor")

_FAILURE_REPORT_WAIT_S = 2.0  # how long a failed step waits for the failing rank to say why
_HEALTH_CHECK_INTERVAL_S = 0.2  # between two looks at the worker processes


class ExecutorDeadError(RuntimeError):
    """The executor cannot run steps any more (a tensor-parallel rank failed); the engine must be
    restarted. `rank` names the rank that failed (None if unknown)."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV pool an executor allocated (on every rank: the same block count). `groups`: the layers whose
    blocks live in pools of their own (sliding windows), each to be added to the scheduler as a KV-cache
    group, in this order (the plan's group index)."""

    num_blocks: int
    num_swap_blocks: int
    dtype: torch.dtype
    bytes_per_block: int  # per rank
    groups: tuple[WindowGroup, ...] = ()
    num_layers: int = 0  # the model's attention layers (those of `groups` and the full-attention pool's)
    num_tier_blocks: int = 0  # the host KV tier's blocks (`kv_offloading_size`), on every rank
    # State slots of the linear-attention layers' recurrent group (0: none), added after `groups`.
    recurrent_slots: int = 0
    recurrent_snapshots: int = 0  # and its snapshot slots for prefix caching
    recurrent_layers: int = 0  # and the linear-attention layers whose state they hold

    @property
    def has_full_layers(self) -> bool:
        """Whether some layer stores its KV in the full-attention pool (else it is bookkeeping only)."""
        return not self.groups or self.num_layers > sum(len(g.layers) for g in self.groups)


class UniProcExecutor:
    """The model on one device, in this process. The executor interface the engine core sees:
    `init_kv_cache`, `attach_block_table`, `execute`, `check_health`, `shutdown`; the runner is its own."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.driver_worker: ModelRunner | None = runner  # vLLM's name (vLLM 0.4's notebook deletes it)
        self.disk_tier: DiskTierLink | None = None  # the disk KV tier behind the host tier (`kv_disk`)

    @property
    def tensor_parallel_size(self) -> int:
        return 1

    def init_kv_cache(self) -> KVCacheSpec:
        """Size and allocate the KV pool (and on CUDA capture the decode graphs)."""
        pool = self._init_pool()
        rec = self.runner.recurrent
        spec = KVCacheSpec(
            pool.num_blocks,
            pool.num_swap_blocks,
            pool.dtype,
            pool.bytes_per_block,
            self.runner.kv_groups,
            pool.num_layers,
            pool.num_tier_blocks,
            rec.num_slots if rec is not None else 0,
            rec.num_snapshots if rec is not None else 0,
            rec.num_layers if rec is not None else 0,
        )
        if spec.groups or spec.recurrent_slots:
            cfg = self.runner.config
            logger.info(
                kv_pools_line(
                    spec.num_blocks,
                    spec.groups,
                    spec.num_layers,
                    self.runner.block_size,
                    cfg.scheduler.max_model_len,
                    step_tokens(cfg),
                    (spec.recurrent_slots, spec.recurrent_layers),
                )
            )
        self._log_tier(pool)
        return spec

    def _log_tier(self, pool: KVCachePool) -> None:
        size = self.runner.config.cache.kv_offloading_size
        if pool.num_tier_blocks:
            logger.info(
                "host KV tier: %d blocks of %d tokens (%.2f GiB per rank, kv_offloading_size=%g GiB)",
                pool.num_tier_blocks,
                pool.block_size,
                pool.num_tier_blocks * pool.bytes_per_block / (1 << 30),
                size,
            )
        elif size:
            logger.warning(
                "kv_offloading_size=%g GiB gives no host KV tier: it needs prefix caching, a pool without "
                "KV-cache groups of their own and no drafter KV, and at least one block",
                size,
            )

    def _init_pool(self) -> KVCachePool:
        return self.runner.init_kv_cache(self.runner.determine_num_blocks())

    def attach_block_table(self, view: np.ndarray) -> None:
        """The scheduler's persistent block table (a read-only view the runner reads every step)."""
        self.runner.attach_block_table(view)

    def attach_lora(self, manager: LoRAManager) -> None:
        """The core's adapters (the other ranks follow their slots); their CUDA kernels are on where the
        runner's layer kernels are."""
        manager.batch.use_kernels = self.runner.layer_kernels

    def execute(
        self,
        plan: StepPlan,
        rows: Sequence[SamplingRow],
        prompt_logprobs: dict[int, tuple[int, Sequence[int]]] | None = None,
        token_bitmask: Any = None,
    ) -> RunnerOutput:
        out = self.runner.execute(plan, rows, prompt_logprobs, token_bitmask)
        if self.disk_tier is not None:  # the plan's tier stores are in their host slots now
            self.disk_tier.stored(plan)
        return out

    def add_mm_request(
        self, seq_ids: Sequence[int], items: list[MultiModalItem], mrope: MRopeTable | None = None
    ) -> None:
        """A request's images (and M-RoPE table), for the runner's encoder side (`runner.mm_step`);
        ValueError where they cannot run."""
        self.runner.add_mm_request(seq_ids, items, mrope)

    def drop_mm_request(self, seq_ids: Sequence[int]) -> None:
        self.runner.drop_mm_request(seq_ids)

    def encoder_cache_changes(self) -> tuple[list[str], list[str]]:
        """Image hashes whose encoder outputs the runner stored, and evicted, since the last call."""
        return self.runner.encoder_cache_changes()

    def check_health(self) -> None:
        """Raise ExecutorDeadError if a step can no longer run."""

    def shutdown(self) -> None:
        """Stop any ranks, then free the model, the KV pool and the graphs (device memory); the disk KV
        tier's queued blocks are written first."""
        if self.disk_tier is not None:
            self.disk_tier.close()
            self.disk_tier = None
        self._stop_ranks()
        self.runner.release()

    def _stop_ranks(self) -> None:
        pass


class TPExecutor(UniProcExecutor):
    """Rank 0 of a tensor-parallel group: broadcasts each plan, runs its shard, samples."""

    def __init__(self, runner: ModelRunner, ranks: RankProcesses) -> None:
        super().__init__(runner)
        self.ranks = ranks
        # Step broadcasts reach every rank: the group itself, or under liquid scaling the world.
        self.bcast: TPGroup = getattr(ranks, "world", None) or runner.tp
        self._dead: ExecutorDeadError | None = None
        self._next_health_check = 0.0
        self._stopped = False
        self.lora: LoRAManager | None = None
        # Workers must not outlive the engine, also when nobody calls shutdown().
        self._finalizer = weakref.finalize(self, TPExecutor._shutdown_ranks, ranks, self.bcast, False)
        atexit.register(self._finalizer)

    @property
    def tp(self) -> TPGroup:
        """The group the model's collectives run over now."""
        return self.runner.tp

    @property
    def tensor_parallel_size(self) -> int:
        return self.tp.size

    def _init_pool(self) -> KVCachePool:
        try:
            num_blocks, num_swap = agree_kv_blocks(self.runner, self.tp)
        except Exception as exc:
            raise self._fail(exc) from exc
        return self.runner.init_kv_cache(num_blocks, num_swap)

    def attach_lora(self, manager: LoRAManager) -> None:
        super().attach_lora(manager)
        self.lora = manager

    def _broadcast(self, plan: StepPlan, extra: np.ndarray | None) -> None:
        message = self.lora.wire_message() if self.lora is not None else None
        if message is not None:  # slot changes and the step's adapter rows, before the step
            self.bcast.broadcast_cpu(lora_header(len(message)))
            self.bcast.broadcast_cpu(torch.frombuffer(bytearray(message), dtype=torch.uint8))
        header, payload = pack_step(plan, extra)
        self.bcast.broadcast_cpu(header)
        if payload.numel():
            self.bcast.broadcast_cpu(payload)

    def execute(
        self,
        plan: StepPlan,
        rows: Sequence[SamplingRow],
        prompt_logprobs: dict[int, tuple[int, Sequence[int]]] | None = None,
        token_bitmask: Any = None,
    ) -> RunnerOutput:
        self.check_health()
        try:  # every rank runs the forward: a failure here breaks the group
            fwd = self.runner.forward(plan, prompt_logprobs, before_forward=self._broadcast, rows=rows)
        except Exception as exc:
            raise self._fail(exc) from exc
        # Sampling is rank 0's alone: an error here fails this step only.
        return self.runner.sample(plan, rows, fwd, token_bitmask)

    def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead
        # A rank that fails during a step breaks that step's collectives at once; between steps, a few
        # checks a second find an idle rank that died without a per-step cost (a Ray query is not free).
        now = time.monotonic()
        if now < self._next_health_check:
            return
        self._next_health_check = now + _HEALTH_CHECK_INTERVAL_S
        failure = self.ranks.failure()
        if failure is not None:
            raise self._fail(failure)

    def _fail(self, exc: BaseException) -> ExecutorDeadError:
        """Name the failed rank (a worker's own report wins over rank 0's broken collective), stop
        every worker, and stay dead."""
        if self._dead is not None:
            return self._dead
        failure = exc if isinstance(exc, RankFailure) else None
        deadline = time.monotonic() + _FAILURE_REPORT_WAIT_S
        while failure is None and time.monotonic() < deadline:
            failure = self.ranks.failure()
            if failure is None:
                time.sleep(0.05)
        if failure is not None:
            dead = ExecutorDeadError(str(failure), failure.rank)
        else:
            dead = ExecutorDeadError(f"tensor-parallel rank 0 failed: {type(exc).__name__}: {exc}", 0)
        logger.error("%s; stopping the tensor-parallel ranks", dead)
        self._dead = dead
        self._stop(graceful=False)
        return dead

    def _stop_ranks(self) -> None:
        self._stop(graceful=self._dead is None)

    def _stop(self, graceful: bool) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._finalizer.detach()
        atexit.unregister(self._finalizer)
        TPExecutor._shutdown_ranks(self.ranks, self.bcast, graceful)

    @staticmethod
    def _shutdown_ranks(ranks: RankProcesses, bcast: TPGroup, graceful: bool) -> None:
        if graceful:
            try:
                bcast.broadcast_cpu(shutdown_header())
            except Exception:  # a worker already gone: it is stopped below
                graceful = False
        ranks.stop(5.0 if graceful else 0.0)
        ranks.abort_groups()
