"""The runner's start: sizing and allocating the KV pool, and capturing the decode CUDA graphs against it.

On CUDA the decode graphs are captured when the KV pool is created, and the memory they will hold is kept
out of the pool when it is sized (`determine_num_blocks`, `profile_cudagraph_memory`). `KVSetupMixin` is
a part of `ModelRunner` (`model_runner.py`), which sets every attribute declared here.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import Tensor

from pagedrs.config import EngineConfig
from pagedrs.distributed.group import TPGroup
from pagedrs.layers.attention import AttentionBackend, ForwardContext
from pagedrs.layers.attention.selector import routes_to_reference
from pagedrs.models.interface import CausalLM
from pagedrs.runner.kv_cache import (
    KVCachePool,
    model_block_bytes,
    num_blocks_for_bytes,
    profile_num_gpu_blocks,
)
from pagedrs.runner.kv_groups import WindowGroup, plan_window_pools
from pagedrs.runner.recurrent import RecurrentState, has_recurrent_state
from pagedrs.runner.step_buffers import StepBuffers
from pagedrs.spec_decode import Drafter

__all__ = ["KVSetupMixin"]

_GiB = 1 << 30
_DEFAULT_CPU_KV_GB = 4.0
_PROFILE_GRAPH_BLOCKS = 16  # the throwaway KV pool the graph-memory profile captures against


class KVSetupMixin:
    """`ModelRunner`'s KV pool sizing and allocation, and its decode graphs' capture."""

    config: EngineConfig
    model: CausalLM
    tp: TPGroup
    device: torch.device
    block_size: int
    kv_dtype: torch.dtype
    backend: AttentionBackend
    kv_pool: KVCachePool | None
    max_blocks_per_seq: int
    graph_batch_size: int
    step_buffers: StepBuffers
    cuda_graphs: Any
    _graphs_failed: bool
    kv_groups: tuple[WindowGroup, ...]
    recurrent: RecurrentState | None
    drafter: Drafter | None

    @property
    def bytes_per_block(self) -> int:
        """One block's bytes on this rank: the target's KV, plus a drafter's own (a draft model's pool has
        as many blocks)."""
        own = model_block_bytes(self.model, self.block_size, self.kv_dtype)
        return own + (self.drafter.kv_bytes_per_block if self.drafter is not None else 0)

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        per_block = self.bytes_per_block
        if self.device.type == "cuda":
            return profile_num_gpu_blocks(
                self.model,
                self.profile_run,
                device=self.device,
                gpu_memory_utilization=cache.gpu_memory_utilization,
                per_block=per_block,
                reserved_bytes=self.profile_cudagraph_memory(),
            )
        sched = self.config.scheduler
        if cache.cpu_kv_cache_gb is not None:
            num = num_blocks_for_bytes(cache.cpu_kv_cache_gb * _GiB, per_block)
        else:
            # No more than every sequence at full length would need, and at most 4 GiB.
            num = min(
                sched.max_num_seqs * self.max_blocks_per_seq,
                num_blocks_for_bytes(_DEFAULT_CPU_KV_GB * _GiB, per_block),
            )
        if num < 1:
            raise ValueError(
                f"cpu_kv_cache_gb={cache.cpu_kv_cache_gb} holds no block of {per_block} bytes; raise it"
            )
        return num

    def determine_num_swap_blocks(self) -> int:
        if has_recurrent_state(self.model) and self.config.cache.swap_space_is_default:
            return 0  # the recurrent group does not swap: a preempted sequence recomputes
        return num_blocks_for_bytes(self.config.cache.swap_space * _GiB, self.bytes_per_block)

    def determine_num_tier_blocks(self) -> int:
        """Blocks of the host KV tier on this rank: `kv_offloading_size` GiB shared out over the tensor-parallel
        ranks (as vLLM's), in this rank's blocks. 0 without prefix caching, or where the tier would not hold
        every layer's state of a block: KV-cache groups with pools of their own (or recurrent state), a
        drafter's KV, liquid ranks."""
        cfg = self.config
        size = cfg.cache.kv_offloading_size
        if (
            not (size or cfg.cache.kv_offloading_blocks)
            or not cfg.cache.enable_prefix_caching
            or self.kv_groups
            or has_recurrent_state(self.model)
            or (self.drafter is not None and self.drafter.kv_bytes_per_block)
            or cfg.parallel.liquid_gpu_range is not None
        ):
            return 0
        if cfg.cache.kv_offloading_blocks:  # each rank holds its shard of every block
            return cfg.cache.kv_offloading_blocks
        own = model_block_bytes(self.model, self.block_size, self.kv_dtype)
        return num_blocks_for_bytes(size * _GiB / self.tp.size, own)

    def _new_pool(
        self, num_blocks: int, num_swap: int, groups: tuple[WindowGroup, ...] = (), num_tier: int = 0
    ) -> KVCachePool:
        return KVCachePool.for_model(
            self.model,
            block_size=self.block_size,
            num_blocks=num_blocks,
            dtype=self.kv_dtype,
            device=self.device,
            num_swap_blocks=num_swap,
            layer_blocks={i: g.num_blocks for g in groups for i in g.layers},
            groups=[g.layers for g in groups],
            num_tier_blocks=num_tier,
        )

    def init_kv_cache(self, num_blocks: int, num_swap_blocks: int | None = None) -> KVCachePool:
        """Allocate the KV pool, then (CUDA) capture every decode graph, before any request runs."""
        num_swap = self.determine_num_swap_blocks() if num_swap_blocks is None else num_swap_blocks
        num_blocks, self.kv_groups = plan_window_pools(self, num_blocks)
        self.kv_pool = self._new_pool(num_blocks, num_swap, self.kv_groups, self.determine_num_tier_blocks())
        if has_recurrent_state(
            self.model
        ):  # a state slot per running sequence, and snapshots (`runner.recurrent`)
            seqs = self.config.scheduler.max_num_seqs
            snapshots = seqs if self.config.cache.enable_prefix_caching else 0
            self.recurrent = RecurrentState(self.model, seqs, snapshots, self.device)
        if self.drafter is not None:
            self.drafter.init_kv_cache(num_blocks, num_swap)
        self.capture_model()
        return self.kv_pool

    @property
    def uses_cuda_graphs(self) -> bool:
        """Decode steps replay CUDA graphs: one CUDA device (tensor-parallel and liquid steps run eagerly:
        their collectives and their model objects change), the cupy backend, not enforce_eager, and no
        capture failed before."""
        dev = self.config.device
        return (
            self.device.type == "cuda"
            and self.tp.size == 1
            and self.config.parallel.liquid_gpu_range is None
            and not dev.enforce_eager
            and self.backend.name == "cupy"
            and not self._graphs_failed
            and not self.kv_groups  # the groups' tables are per plan, not in the graphs
            and self.recurrent is None  # the state slots are per plan, and the layers loop over rows
            and not routes_to_reference(self.model, self.backend)  # the reference plans on the host
        )

    def _graph_runner(self, kv_caches: list[Tensor], *, shared_inputs: bool) -> Any:
        from pagedrs.runner.cuda_graphs import CudaGraphRunner

        return CudaGraphRunner(
            self.model,
            kv_caches,
            self.backend,
            max_batch_size=self.graph_batch_size,
            max_blocks_per_seq=self.max_blocks_per_seq,
            block_size=self.block_size,
            inputs=self.step_buffers.graph_inputs() if shared_inputs else None,
        )

    @torch.inference_mode()
    def capture_model(self) -> None:
        """Capture every (batch size, context bucket) decode graph against the KV pool now, so that no
        request pays for a capture; a model that cannot be captured runs eagerly."""
        self.cuda_graphs = None
        if not self.uses_cuda_graphs or self.kv_pool is None:
            return
        graphs = self._graph_runner(self.kv_pool.kv_caches, shared_inputs=True)
        graphs.capture_all(progress=True)
        if graphs.enabled:
            self.cuda_graphs = graphs
        else:
            self._graphs_failed = True

    @torch.inference_mode()
    def profile_cudagraph_memory(self) -> int:
        """Bytes the decode graphs will hold once captured, measured before the KV pool exists.

        What vLLM V1 does (gpu_model_runner.profile_cudagraph_memory): capturing needs KV caches, so the
        two largest graphs are captured against a small throwaway pool, their free-memory deltas taken
        (the first is the shared pool, the second one graph's own cost, at least 1 MiB), and
        first + second * (num_graphs - 1) is kept out of the KV budget; the graphs and the pool are then
        dropped, and the real capture follows the pool's allocation. A margin fixed in advance would be
        wrong both ways: the shared pool grows with the batch, the context bucket and the model's width.
        0 when graphs are off; a model that fails to capture here is marked eager for good."""
        if not self.uses_cuda_graphs:
            return 0
        pool = self._new_pool(_PROFILE_GRAPH_BLOCKS, 0)
        graphs = self._graph_runner(pool.kv_caches, shared_inputs=False)
        estimate = int(graphs.profile_memory())
        if not graphs.enabled:
            self._graphs_failed = True
        del graphs, pool
        gc.collect()
        torch.cuda.empty_cache()
        return estimate

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward at the largest token budget with no KV cache, and the logits of a full batch."""
        sched = self.config.scheduler
        num_tokens = min(sched.max_num_batched_tokens, sched.max_model_len)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        pos = torch.arange(num_tokens, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, pos, ForwardContext(attn_metadata=None, kv_caches=[], backend=self.backend))
        rows = min(sched.max_num_seqs, num_tokens)
        self.model.compute_logits(hidden[:rows])
