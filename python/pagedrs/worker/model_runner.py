"""The model runner: StepPlan -> tensors -> ForwardContext -> model.forward -> logits -> sampler.

One step costs a handful of numpy -> torch conversions (zero-copy on CPU), the forward, and a sampler call
over the rows that produce a token; there is no per-token Python.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pagedrs.config import EngineConfig
from pagedrs.layers.attention import AttentionMetadata, ForwardContext, get_attention_backend
from pagedrs.layers.sampler import (
    LogprobsTensors,
    Sampler,
    SamplingMetadata,
    SamplingRow,
    compute_token_logprobs,
)
from pagedrs.worker.kv_cache import KVCachePool, block_bytes, num_blocks_for_bytes, profile_num_gpu_blocks

__all__ = ["ModelRunner", "PromptLogprobsChunk", "RunnerOutput"]

logger = logging.getLogger(__name__)

_GiB = 1 << 30
_DEFAULT_CPU_KV_GB = 4.0


@dataclass
class PromptLogprobsChunk:
    """Prompt logprobs computed this step for one sequence: positions start..start+n-1 of the prompt, each
    the logprob of that prompt token given the tokens before it."""

    start: int
    token_ids: np.ndarray  # [n, 1 + k] the prompt token, then the top-k
    logprobs: np.ndarray  # [n, 1 + k]
    ranks: np.ndarray  # [n]


@dataclass
class RunnerOutput:
    sampled_token_ids: np.ndarray  # int64 [S], row i for plan.sampled_seq_ids[i]
    logprobs: LogprobsTensors | None  # CPU tensors, [S, 1 + k]
    prompt_logprobs: dict[int, PromptLogprobsChunk]


def _tensor(arr: np.ndarray, device: torch.device) -> Tensor:
    # from_numpy shares memory (zero-copy on CPU); a read-only view is copied first.
    if not arr.flags.writeable:
        arr = np.array(arr)
    t = torch.from_numpy(arr)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


class ModelRunner:
    """Owns the model, the KV pool, the attention backend and the sampler for one device."""

    def __init__(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        *,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.config = config
        self.model = model
        self.device = config.device.device
        self.block_size = config.cache.block_size
        self.eos_token_ids = list(eos_token_ids)
        self.backend = get_attention_backend(config.device.attention_backend, self.device)
        self.sampler = Sampler()
        self.kv_dtype = next(model.parameters()).dtype
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.model.seed)
        self.kv_pool: KVCachePool | None = None
        self.cuda_graphs: Any = None  # CudaGraphRunner for decode-only steps (CUDA + cupy backend)
        # The scheduler's persistent block table (read-only numpy view) and, off the CPU, its device
        # mirror. INVARIANT: after each plan's changed rows are copied, the mirror equals the view.
        self._bt_view: np.ndarray | None = None
        self._bt_device: Tensor | None = None

    def attach_block_table(self, view: np.ndarray, *, mirror: bool | None = None) -> None:
        """Use the scheduler's persistent block table. With a mirror (the default off the CPU) only the rows
        a plan changed are copied to the device each step, instead of the whole padded table."""
        self._bt_view = view
        if mirror if mirror is not None else self.device.type != "cpu":
            self._bt_device = torch.as_tensor(np.array(view), device=self.device)

    def _sync_block_table(self, plan: object) -> None:
        # Every plan, empty ones included, or the mirror drifts from the view.
        changed = plan.changed_rows  # type: ignore[attr-defined]
        if self._bt_device is None or self._bt_view is None or not len(changed):
            return
        idx = torch.from_numpy(changed.astype(np.int64)).to(self.device, non_blocking=True)
        rows_now = torch.from_numpy(self._bt_view[changed]).to(self.device, non_blocking=True)
        self._bt_device.index_copy_(0, idx, rows_now)

    def _block_tables(self, plan: object) -> Tensor:
        if self._bt_device is None:
            return _tensor(plan.block_tables, self.device)  # type: ignore[attr-defined]
        rows = torch.from_numpy(plan.block_table_rows.astype(np.int64))  # type: ignore[attr-defined]
        return self._bt_device.index_select(0, rows.to(self.device, non_blocking=True))

    # ---- KV pool sizing -------------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        m = self.model
        return block_bytes(m.num_layers, self.block_size, m.num_kv_heads, m.head_size, self.kv_dtype)

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
            )
        sched = self.config.scheduler
        if cache.cpu_kv_cache_gb is not None:
            num = num_blocks_for_bytes(cache.cpu_kv_cache_gb * _GiB, per_block)
        else:
            # No more than every sequence at full length would need, and at most 4 GiB.
            blocks_per_seq = math.ceil(sched.max_model_len / self.block_size)
            num = min(
                sched.max_num_seqs * blocks_per_seq,
                num_blocks_for_bytes(_DEFAULT_CPU_KV_GB * _GiB, per_block),
            )
        if num < 1:
            raise ValueError(
                f"cpu_kv_cache_gb={cache.cpu_kv_cache_gb} holds no block of {per_block} bytes; raise it"
            )
        return num

    def init_kv_cache(self, num_blocks: int) -> KVCachePool:
        m = self.model
        num_swap = num_blocks_for_bytes(self.config.cache.swap_space * _GiB, self.bytes_per_block)
        self.kv_pool = KVCachePool(
            num_layers=m.num_layers,
            num_kv_heads=m.num_kv_heads,
            head_size=m.head_size,
            block_size=self.block_size,
            num_blocks=num_blocks,
            dtype=self.kv_dtype,
            device=self.device,
            num_swap_blocks=num_swap,
        )
        dev_cfg = self.config.device
        if self.device.type == "cuda" and not dev_cfg.enforce_eager and self.backend.name == "cupy":
            from pagedrs.worker.cuda_graphs import CudaGraphRunner

            sched = self.config.scheduler
            self.cuda_graphs = CudaGraphRunner(
                self.model,
                self.kv_pool.kv_caches,
                self.backend,
                max_batch_size=min(sched.max_num_seqs, 512),
                max_blocks_per_seq=math.ceil(sched.max_model_len / self.block_size),
                block_size=self.block_size,
            )
        return self.kv_pool

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

    # ---- one step ----------------------------------------------------------------------------------
    def _attn_metadata(self, plan: object) -> AttentionMetadata:
        dev = self.device
        qsl_np = plan.query_start_loc  # type: ignore[attr-defined]
        seq_lens_np = plan.seq_lens  # type: ignore[attr-defined]
        num_sched = plan.num_scheduled_tokens  # type: ignore[attr-defined]
        return AttentionMetadata(
            slot_mapping=_tensor(plan.slot_mapping, dev),  # type: ignore[attr-defined]
            query_start_loc=_tensor(qsl_np, dev),
            seq_lens=_tensor(seq_lens_np, dev),
            block_tables=self._block_tables(plan),
            query_start_loc_cpu=qsl_np.tolist(),
            seq_lens_cpu=seq_lens_np.tolist(),
            max_query_len=int(num_sched.max()) if len(num_sched) else 0,
            max_seq_len=int(seq_lens_np.max()) if len(seq_lens_np) else 0,
            block_size=self.block_size,
            num_decode_tokens=int(plan.num_decode_tokens),  # type: ignore[attr-defined]
        )

    @torch.inference_mode()
    def execute(
        self,
        plan: object,
        rows: Sequence[SamplingRow],
        prompt_logprobs: dict[int, tuple[int, Sequence[int]]] | None = None,
    ) -> RunnerOutput:
        """Run one step plan. `rows[i]` is the sequence of logits row i; `prompt_logprobs` maps a seq id to
        (top-k, prompt token ids) for the sequences whose prompt logprobs are wanted."""
        pool = self.kv_pool
        assert pool is not None, "init_kv_cache() first"
        pool.apply_plan_ops(plan)
        self._sync_block_table(plan)
        num_rows = len(plan.logits_indices)  # type: ignore[attr-defined]
        out = RunnerOutput(np.zeros(0, dtype=np.int64), None, {})
        if plan.num_tokens > 0:  # type: ignore[attr-defined]
            dev = self.device
            meta = self._attn_metadata(plan)
            ctx = ForwardContext(attn_metadata=meta, kv_caches=pool.kv_caches, backend=self.backend)
            input_ids = _tensor(plan.input_ids, dev)  # type: ignore[attr-defined]
            positions = _tensor(plan.positions, dev)  # type: ignore[attr-defined]
            hidden = None
            if self.cuda_graphs is not None:  # decode-only steps replay a captured graph
                hidden = self.cuda_graphs.run(input_ids, positions, meta, pool.kv_caches)
            if hidden is None:
                hidden = self.model(input_ids, positions, ctx)
            if prompt_logprobs:
                out.prompt_logprobs = self._prompt_logprobs(plan, hidden, prompt_logprobs)
            if num_rows:
                logits_idx = _tensor(plan.logits_indices, dev)  # type: ignore[attr-defined]
                logits = self.model.compute_logits(hidden.index_select(0, logits_idx))
                sampling = SamplingMetadata.from_rows(
                    rows,
                    vocab_size=logits.shape[-1],
                    device=dev,
                    eos_token_ids=self.eos_token_ids,
                    default_generator=self.generator,
                )
                sampled = self.sampler(logits, sampling)
                out.sampled_token_ids = (
                    sampled.sampled_token_ids.to("cpu").numpy().astype(np.int64, copy=False)
                )
                if sampled.logprobs is not None:
                    lp = sampled.logprobs
                    out.logprobs = LogprobsTensors(lp.token_ids.cpu(), lp.logprobs.cpu(), lp.ranks.cpu())
        pool.apply_plan_shrink(plan)
        return out

    def _prompt_logprobs(
        self, plan: object, hidden: Tensor, wanted: dict[int, tuple[int, Sequence[int]]]
    ) -> dict[int, PromptLogprobsChunk]:
        result: dict[int, PromptLogprobsChunk] = {}
        req_ids = plan.req_ids.tolist()  # type: ignore[attr-defined]
        qsl = plan.query_start_loc  # type: ignore[attr-defined]
        computed = plan.num_computed_tokens  # type: ignore[attr-defined]
        seq_lens = plan.seq_lens  # type: ignore[attr-defined]
        for b, seq_id in enumerate(req_ids):
            if seq_id not in wanted:
                continue
            k, prompt = wanted[seq_id]
            start, end = int(computed[b]), min(int(seq_lens[b]), len(prompt) - 1)
            if end <= start:
                continue
            first = int(qsl[b])
            h = hidden[first : first + (end - start)]
            logprobs = self.model.compute_logits(h).float().log_softmax(dim=-1)
            targets = torch.as_tensor(
                np.asarray(prompt[start + 1 : end + 1], dtype=np.int64), device=h.device
            )
            lp = compute_token_logprobs(logprobs, targets, min(k, logprobs.shape[-1]))
            # Position p's logits predict prompt token p + 1.
            result[seq_id] = PromptLogprobsChunk(
                start=start + 1,
                token_ids=lp.token_ids.cpu().numpy(),
                logprobs=lp.logprobs.cpu().numpy(),
                ranks=lp.ranks.cpu().numpy(),
            )
        return result
