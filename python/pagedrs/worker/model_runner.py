"""The model runner: StepPlan -> tensors -> ForwardContext -> model.forward -> logits -> sampler.

One step costs a handful of numpy -> torch conversions (zero-copy on CPU), the forward, and a sampler call
over the rows that produce a token; there is no per-token Python.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from pagedrs.config import EngineConfig, kv_cache_torch_dtype
from pagedrs.distributed.group import TPGroup
from pagedrs.layers.attention import AttentionMetadata, ForwardContext, get_attention_backend
from pagedrs.layers.sampler import (
    LogprobsTensors,
    Sampler,
    SamplingMetadata,
    SamplingRow,
    compute_token_logprobs,
)
from pagedrs.worker.kv_cache import KVCachePool, block_bytes, num_blocks_for_bytes, profile_num_gpu_blocks

__all__ = [
    "ModelRunner",
    "PlanLike",
    "PromptLogprobsChunk",
    "PromptLogprobsPlan",
    "PromptSpan",
    "RunnerOutput",
]

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
class PromptSpan:
    """One sequence's prompt positions scored this step: targets = prompt[start : start + n]."""

    seq_id: int
    start: int
    k: int
    targets: np.ndarray  # int64 [n]


@dataclass
class PromptLogprobsPlan:
    """The hidden rows whose logits give this step's prompt logprobs (after the sampled rows' logits),
    span by span."""

    indices: np.ndarray  # int64, concatenated over spans
    spans: list[PromptSpan]


class PlanLike(Protocol):
    """What a step needs from its plan: `_core.StepPlan` on rank 0, an unpacked `WorkerStep` elsewhere."""

    @property
    def num_blocks(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_decode_tokens(self) -> int: ...
    @property
    def input_ids(self) -> np.ndarray: ...
    @property
    def positions(self) -> np.ndarray: ...
    @property
    def slot_mapping(self) -> np.ndarray: ...
    @property
    def query_start_loc(self) -> np.ndarray: ...
    @property
    def seq_lens(self) -> np.ndarray: ...
    @property
    def num_scheduled_tokens(self) -> np.ndarray: ...
    @property
    def num_computed_tokens(self) -> np.ndarray: ...
    @property
    def req_ids(self) -> np.ndarray: ...
    @property
    def logits_indices(self) -> np.ndarray: ...
    @property
    def block_tables(self) -> np.ndarray: ...
    @property
    def block_table_rows(self) -> np.ndarray: ...
    @property
    def changed_rows(self) -> np.ndarray: ...
    @property
    def block_moves(self) -> np.ndarray: ...
    @property
    def swap_out(self) -> np.ndarray: ...
    @property
    def swap_in(self) -> np.ndarray: ...
    @property
    def copies(self) -> np.ndarray: ...


@dataclass
class RunnerOutput:
    sampled_token_ids: np.ndarray  # int64 [S], row i for plan.sampled_seq_ids[i]
    logprobs: LogprobsTensors | None  # CPU tensors, [S, 1 + k]
    prompt_logprobs: dict[int, PromptLogprobsChunk]
    sampled_logprobs: np.ndarray | None = None  # float32 [S]: each sampled token's raw logprob


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
        tp: TPGroup | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.tp = tp or TPGroup()
        self.device = config.device.device
        self.block_size = config.cache.block_size
        self.eos_token_ids = list(eos_token_ids)
        self.kv_dtype = kv_cache_torch_dtype(config.cache.cache_dtype, next(model.parameters()).dtype)
        self.backend = get_attention_backend(config.device.attention_backend, self.device)
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.model.seed)
        self.kv_pool: KVCachePool | None = None
        self.cuda_graphs: Any = None  # CudaGraphRunner for decode-only steps (CUDA + cupy backend)
        # The scheduler's persistent block table (read-only numpy view) and, off the CPU, its device
        # mirror. INVARIANT: after each plan's changed rows are copied, the mirror equals the view.
        self._bt_view: np.ndarray | None = None
        self.last_hidden: Tensor | None = None
        self._bt_device: Tensor | None = None

    def attach_block_table(self, view: np.ndarray, *, mirror: bool | None = None) -> None:
        """Use the scheduler's persistent block table. With a mirror (the default off the CPU) only the rows
        a plan changed are copied to the device each step, instead of the whole padded table."""
        self._bt_view = view
        if mirror if mirror is not None else self.device.type != "cpu":
            self._bt_device = torch.as_tensor(np.array(view), device=self.device)

    def _sync_block_table(self, plan: PlanLike) -> None:
        # Every plan, empty ones included, or the mirror drifts from the view.
        changed = plan.changed_rows
        if self._bt_device is None or self._bt_view is None or not len(changed):
            return
        idx = torch.from_numpy(changed.astype(np.int64)).to(self.device, non_blocking=True)
        rows_now = torch.from_numpy(self._bt_view[changed]).to(self.device, non_blocking=True)
        self._bt_device.index_copy_(0, idx, rows_now)

    def _block_tables(self, plan: PlanLike) -> Tensor:
        if self._bt_device is None:
            return _tensor(plan.block_tables, self.device)
        rows = torch.from_numpy(plan.block_table_rows.astype(np.int64))
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

    def determine_num_swap_blocks(self) -> int:
        return num_blocks_for_bytes(self.config.cache.swap_space * _GiB, self.bytes_per_block)

    def init_kv_cache(self, num_blocks: int, num_swap_blocks: int | None = None) -> KVCachePool:
        m = self.model
        num_swap = self.determine_num_swap_blocks() if num_swap_blocks is None else num_swap_blocks
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
        # CUDA graphs capture one device's forward; a tensor-parallel step runs eagerly.
        graphs_ok = self.tp.size == 1 and not dev_cfg.enforce_eager and self.backend.name == "cupy"
        if self.device.type == "cuda" and graphs_ok:
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
    def _attn_metadata(self, plan: PlanLike) -> AttentionMetadata:
        dev = self.device
        qsl_np = plan.query_start_loc
        seq_lens_np = plan.seq_lens
        num_sched = plan.num_scheduled_tokens
        return AttentionMetadata(
            slot_mapping=_tensor(plan.slot_mapping, dev),
            query_start_loc=_tensor(qsl_np, dev),
            seq_lens=_tensor(seq_lens_np, dev),
            block_tables=self._block_tables(plan),
            query_start_loc_cpu=qsl_np.tolist(),
            seq_lens_cpu=seq_lens_np.tolist(),
            max_query_len=int(num_sched.max()) if len(num_sched) else 0,
            max_seq_len=int(seq_lens_np.max()) if len(seq_lens_np) else 0,
            block_size=self.block_size,
            num_decode_tokens=int(plan.num_decode_tokens),
        )

    @torch.inference_mode()
    def execute(
        self,
        plan: PlanLike,
        rows: Sequence[SamplingRow],
        prompt_logprobs: dict[int, tuple[int, Sequence[int]]] | None = None,
        token_bitmask: Any = None,
    ) -> RunnerOutput:
        """Run one step plan. `rows[i]` is the sequence of logits row i; `prompt_logprobs` maps a seq id to
        (top-k, prompt token ids) for the sequences whose prompt logprobs are wanted; `token_bitmask`
        (bitmask, row indices) limits those rows to the tokens a grammar allows."""
        plp = self.prompt_logprobs_plan(plan, prompt_logprobs)
        logits = self.execute_model(plan, plp.indices if plp is not None else None)
        return self.sample(plan, rows, plp, logits, token_bitmask)

    @torch.inference_mode()
    def sample(
        self,
        plan: PlanLike,
        rows: Sequence[SamplingRow],
        plp: PromptLogprobsPlan | None,
        logits: Tensor | None,
        token_bitmask: Any = None,
    ) -> RunnerOutput:
        """Rank 0 only: prompt logprobs from the rows after the sampled ones, then the grammar masks
        (structured outputs), then the sampler (logprobs are reported after masking, as vLLM does)."""
        out = RunnerOutput(np.zeros(0, dtype=np.int64), None, {})
        if logits is None:
            return out
        num_rows = len(plan.logits_indices)
        if plp is not None:
            out.prompt_logprobs = self._prompt_logprobs(logits[num_rows:], plp)
        if hasattr(token_bitmask, "result"):  # built in a helper thread while the forward ran
            token_bitmask = token_bitmask.result()
        if num_rows and token_bitmask is not None:
            import xgrammar as xgr

            mask, indices = token_bitmask
            xgr.apply_token_bitmask_inplace(
                logits[:num_rows], mask.to(logits.device), vocab_size=logits.shape[-1], indices=indices
            )
        if num_rows:
            sampling = SamplingMetadata.from_rows(
                rows,
                vocab_size=logits.shape[-1],
                device=self.device,
                eos_token_ids=self.eos_token_ids,
                default_generator=self.generator,
            )
            sampled = self.sampler(logits[:num_rows], sampling)
            out.sampled_token_ids = sampled.sampled_token_ids.to("cpu").numpy().astype(np.int64, copy=False)
            if sampled.sampled_logprobs is not None:
                out.sampled_logprobs = sampled.sampled_logprobs.to("cpu").numpy()
            if sampled.logprobs is not None:
                lp = sampled.logprobs
                out.logprobs = LogprobsTensors(lp.token_ids.cpu(), lp.logprobs.cpu(), lp.ranks.cpu())
        return out

    @torch.inference_mode()
    def execute_model(self, plan: PlanLike, extra_logits_indices: np.ndarray | None = None) -> Tensor | None:
        """Block ops, the forward, and the logits of `plan.logits_indices` then `extra_logits_indices`.

        Every tensor-parallel rank runs this with the same plan (its collectives must line up); the
        logits come back on rank 0 only (None elsewhere, and when the plan asks for none)."""
        pool = self.kv_pool
        assert pool is not None, "init_kv_cache() first"
        pool.apply_plan_ops(plan)
        self._sync_block_table(plan)
        logits: Tensor | None = None
        self.last_hidden = None
        if plan.num_tokens > 0:
            dev = self.device
            meta = self._attn_metadata(plan)
            ctx = ForwardContext(attn_metadata=meta, kv_caches=pool.kv_caches, backend=self.backend)
            input_ids = _tensor(plan.input_ids, dev)
            positions = _tensor(plan.positions, dev)
            hidden = None
            if self.cuda_graphs is not None:  # decode-only steps replay a captured graph
                hidden = self.cuda_graphs.run(input_ids, positions, meta, pool.kv_caches)
            if hidden is None:
                hidden = self.model(input_ids, positions, ctx)
            self.last_hidden = hidden  # the final hidden states, for embedding requests (rank 0 reads)
            idx = plan.logits_indices
            if extra_logits_indices is not None and len(extra_logits_indices):
                idx = np.concatenate([idx, extra_logits_indices])
            if len(idx):
                logits = self.model.compute_logits(hidden.index_select(0, _tensor(idx, dev)))
        pool.apply_plan_shrink(plan)
        return logits

    def prompt_logprobs_plan(
        self, plan: PlanLike, wanted: dict[int, tuple[int, Sequence[int]]] | None
    ) -> PromptLogprobsPlan | None:
        """Which hidden rows give this step's prompt logprobs: position p's logits predict token p + 1."""
        if not wanted:
            return None
        idx: list[np.ndarray] = []
        spans: list[PromptSpan] = []
        qsl = plan.query_start_loc
        computed = plan.num_computed_tokens
        seq_lens = plan.seq_lens
        for b, seq_id in enumerate(plan.req_ids.tolist()):
            if seq_id not in wanted:
                continue
            k, prompt = wanted[seq_id]
            start, end = int(computed[b]), min(int(seq_lens[b]), len(prompt) - 1)
            if end <= start:
                continue
            first = int(qsl[b])
            idx.append(np.arange(first, first + (end - start), dtype=np.int64))
            targets = np.asarray(prompt[start + 1 : end + 1], dtype=np.int64)
            spans.append(PromptSpan(seq_id, start + 1, k, targets))
        if not spans:
            return None
        return PromptLogprobsPlan(np.concatenate(idx), spans)

    def _prompt_logprobs(self, logits: Tensor, plp: PromptLogprobsPlan) -> dict[int, PromptLogprobsChunk]:
        result: dict[int, PromptLogprobsChunk] = {}
        offset = 0
        for span in plp.spans:
            n = len(span.targets)
            logprobs = logits[offset : offset + n].log_softmax(dim=-1)
            offset += n
            targets = torch.from_numpy(span.targets).to(logprobs.device)
            lp = compute_token_logprobs(logprobs, targets, min(span.k, logprobs.shape[-1]))
            result[span.seq_id] = PromptLogprobsChunk(
                start=span.start,
                token_ids=lp.token_ids.cpu().numpy(),
                logprobs=lp.logprobs.cpu().numpy(),
                ranks=lp.ranks.cpu().numpy(),
            )
        return result
