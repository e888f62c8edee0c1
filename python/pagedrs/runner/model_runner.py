"""The model runner: StepPlan -> tensors -> ForwardContext -> model.forward -> logits -> sampler.

One step costs one host-to-device copy of the plan's arrays into persistent device buffers (the CUDA
graphs' static inputs included; `step_buffers.py`), the forward (a graph replay for a decode-only step on
CUDA), and a sampler call over the rows that produce a token, built from sampling parameters kept per
sequence (`sampling_state.py`); there is no per-token or per-layer Python.

The KV pool's sizing and allocation and the decode graphs' capture are in `kv_setup.py`, the sampling side
in `sample_step.py` (mixins of `ModelRunner`); this module holds the runner's state and the step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pagedrs._core import StepPlan
from pagedrs.config import EngineConfig, kv_cache_torch_dtype
from pagedrs.distributed.group import TPGroup
from pagedrs.layers.attention import AttentionMetadata, ForwardContext, get_attention_backend
from pagedrs.layers.sampler import Sampler, SamplingRow
from pagedrs.models.interface import CausalLM
from pagedrs.models.prepare import prepare_for_device, runner_options
from pagedrs.multimodal.encoder_cache import EncoderCache
from pagedrs.runner.kv_cache import KVCachePool, model_block_bytes
from pagedrs.runner.kv_groups import WindowGroup, group_metadata
from pagedrs.runner.kv_setup import KVSetupMixin
from pagedrs.runner.mm_step import MultiModalStepMixin
from pagedrs.runner.outputs import Forward, RunnerOutput
from pagedrs.runner.recurrent import RecurrentState
from pagedrs.runner.sample_step import SampleStepMixin
from pagedrs.runner.sampling_state import SamplingState
from pagedrs.runner.step_buffers import StepBuffers, StepInputs
from pagedrs.spec_decode import Drafter, DrafterContext, StepContext, build_drafter

__all__ = ["ModelRunner"]

logger = logging.getLogger(__name__)

_MAX_GRAPH_BATCH = 512  # decode batches up to this many requests replay a CUDA graph


def check_batch_invariant(model: torch.nn.Module, kv_dtype: torch.dtype) -> None:
    """`DeviceConfig.batch_invariant` for `model` (its quantized weights on the integer kernels at any row
    count, the attention backend's every query through the per-token kernel): ValueError where the
    arithmetic could not be per token (activations or KV cache not float32)."""
    dtype = next(model.parameters()).dtype
    if dtype != torch.float32 or kv_dtype != torch.float32:
        raise ValueError(
            f"batch_invariant needs float32 activations and KV cache, got dtype {dtype} and a {kv_dtype} cache"
        )


class ModelRunner(KVSetupMixin, SampleStepMixin, MultiModalStepMixin):
    """Owns the model, the KV pool, the attention backend and the sampler for one device."""

    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM,
        *,
        eos_token_ids: Sequence[int] = (),
        tp: TPGroup | None = None,
        draft_model: CausalLM | None = None,
    ) -> None:
        """`draft_model`: the loaded draft of speculative decoding's "draft_model" method."""
        self.config = config
        self.model = model
        self.tp = tp or TPGroup()
        self.device = config.device.device
        self.block_size = config.cache.block_size
        self.eos_token_ids = list(eos_token_ids)
        self.kv_dtype = kv_cache_torch_dtype(config.cache.cache_dtype, next(model.parameters()).dtype)
        self.backend = get_attention_backend(
            config.device.attention_backend, self.device, batch_invariant=config.device.batch_invariant
        )
        if config.device.batch_invariant:
            check_batch_invariant(model, self.kv_dtype)
            if draft_model is not None:
                check_batch_invariant(draft_model, self.kv_dtype)
        # The CUDA backend also takes the fused layer kernels (norms, RoPE, gated activations); the torch
        # backend keeps the whole model on torch ops (the reference path), also for a model reused here.
        self.layer_kernels = self.backend.name == "cupy"
        prepare_for_device(model, runner_options(config, layer_kernels=self.layer_kernels))
        if draft_model is not None:
            prepare_for_device(draft_model, runner_options(config))
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.model.seed)
        self.kv_pool: KVCachePool | None = None
        sched = config.scheduler
        self.max_blocks_per_seq = math.ceil(sched.max_model_len / self.block_size)
        self.graph_batch_size = min(sched.max_num_seqs, _MAX_GRAPH_BATCH)
        # Persistent step inputs (pinned staging + device buffer); the graphs' static inputs live in it.
        self.step_buffers = StepBuffers(
            max_num_tokens=sched.max_num_batched_tokens,
            max_num_reqs=sched.max_num_seqs,
            table_width=self.max_blocks_per_seq,
            graph_rows=self.graph_batch_size,
            device=self.device,
        )
        self.sampling_state: SamplingState | None = None  # built at the first sampled step (vocab size)
        self.cuda_graphs: Any = None  # CudaGraphRunner for decode-only steps (CUDA + cupy backend)
        self._graphs_failed = False  # a capture failed once: this model runs eagerly
        # The sliding-window layers' own pools (`kv_groups`), in the order of the plan's group arrays.
        self.kv_groups: tuple[WindowGroup, ...] = ()
        # The linear-attention layers' state slots (`runner.recurrent`), the KV-cache group after the window groups.
        self.recurrent: RecurrentState | None = None
        # The scheduler's persistent block table (read-only numpy view) and, off the CPU, its device
        # mirror. INVARIANT: after each plan's changed rows are copied, the mirror equals the view.
        self._bt_view: np.ndarray | None = None
        self.last_hidden: Tensor | None = None
        self._bt_device: Tensor | None = None
        # Speculative decoding: the drafts the drafter proposed in the last step's forward (sampled order;
        # None: the plan's own, proposed by the scheduler) and the distributions of its sampled drafts
        # ([drafts, draft vocab]; None when every draft was deterministic), for the verifier's q.
        self.last_drafts: np.ndarray | None = None
        self.last_draft_probs: Tensor | None = None
        # The sampled sequences' rows of the step being run (rank 0): a draft model samples the drafts of
        # a sequence that samples (temperature > 0) from its own distribution under the same parameters.
        self.step_rows: Sequence[SamplingRow] | None = None
        self.drafter: Drafter | None = build_drafter(self._drafter_context(draft_model))
        # A multimodal model's items and encoder outputs (`multimodal.encoder_cache`); None for text models.
        self.encoder_cache: EncoderCache | None = EncoderCache() if model.supports_multimodal else None

    def _drafter_context(self, draft_model: CausalLM | None) -> DrafterContext:
        """What a drafter may use of this runner; its buffers and pools come from the factories."""
        sched, block_size, device = self.config.scheduler, self.block_size, self.device
        return DrafterContext(
            config=self.config,
            target=self.model,
            draft_model=draft_model,
            tp=self.tp,
            device=device,
            block_size=block_size,
            max_blocks_per_seq=self.max_blocks_per_seq,
            backend=self.backend,
            generator=self.generator,
            new_substep_buffers=lambda: StepBuffers(
                max_num_tokens=sched.max_num_seqs,
                max_num_reqs=sched.max_num_seqs,
                table_width=self.max_blocks_per_seq,
                graph_rows=1,
                device=device,
            ),
            new_kv_pool=lambda model, num_blocks, num_swap, dtype: KVCachePool.for_model(
                model,
                block_size=block_size,
                num_blocks=num_blocks,
                dtype=dtype,
                device=device,
                num_swap_blocks=num_swap,
            ),
            kv_block_bytes=lambda model, dtype: model_block_bytes(model, block_size, dtype),
        )

    def attach_block_table(self, view: np.ndarray, *, mirror: bool | None = None) -> None:
        """Use the scheduler's persistent block table. With a mirror (the default off the CPU) only the rows
        a plan changed are copied to the device each step, instead of the whole padded table."""
        self._bt_view = view
        if mirror if mirror is not None else self.device.type != "cpu":
            self._bt_device = torch.as_tensor(np.array(view), device=self.device)

    def release(self) -> None:
        """Free the model, the KV pool and the graphs (device memory); the runner takes no more steps."""
        if self.kv_pool is not None and self.kv_pool.tier is not None:
            self.kv_pool.tier.close()  # its worker's stores finish first
        self.kv_pool = None
        self.cuda_graphs = None
        self.last_hidden = None
        self.drafter = None  # a draft model and its pool with it
        self.__dict__.pop("model", None)  # no reference left here; a second release is a no-op
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- one step ----------------------------------------------------------------------------------
    def _attn_metadata(
        self, plan: StepPlan, inputs: StepInputs, max_query_len: int, max_seq_len: int, *, groups: bool = True
    ) -> AttentionMetadata:
        if inputs.block_tables is not None:
            block_tables = inputs.block_tables
        else:
            assert self._bt_device is not None and inputs.block_table_rows is not None
            block_tables = self._bt_device.index_select(0, inputs.block_table_rows)
        meta = AttentionMetadata(
            slot_mapping=inputs.slot_mapping,
            query_start_loc=inputs.query_start_loc,
            seq_lens=inputs.seq_lens,
            block_tables=block_tables,
            # The plan's own arrays (a backend indexes them like lists); no per-step list is built.
            query_start_loc_cpu=plan.query_start_loc,
            seq_lens_cpu=plan.seq_lens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            block_size=self.block_size,
            num_decode_tokens=int(plan.num_decode_tokens),
        )
        if groups and self.kv_groups and self.kv_pool is not None:
            if plan.num_groups != len(self.kv_groups):
                raise RuntimeError(
                    f"step {plan.step_id} carries {plan.num_groups} KV-cache groups' tables, "
                    f"the runner has {len(self.kv_groups)} groups"
                )
            caches = self.kv_pool.kv_caches
            meta.groups = {
                g.window: group_metadata(meta, plan, i, g, caches) for i, g in enumerate(self.kv_groups)
            }
        if self.recurrent is not None:
            meta.recurrent = self.recurrent.rows(plan, len(self.kv_groups))
        return meta

    @torch.inference_mode()
    def execute(
        self,
        plan: StepPlan,
        rows: Sequence[SamplingRow],
        prompt_logprobs: dict[int, tuple[int, Sequence[int]]] | None = None,
        token_bitmask: Any = None,
    ) -> RunnerOutput:
        """Run one step plan: `forward` then `sample`. `rows[i]` is the sequence of logits row i;
        `prompt_logprobs` maps a seq id to (top-k, prompt token ids) for the sequences whose prompt
        logprobs are wanted; `token_bitmask` (bitmask, row indices) limits those rows to the tokens a
        grammar allows."""
        return self.sample(plan, rows, self.forward(plan, prompt_logprobs, rows=rows), token_bitmask)

    @torch.inference_mode()
    def forward(
        self,
        plan: StepPlan,
        prompt_logprobs: dict[int, tuple[int, Sequence[int]]] | None = None,
        *,
        before_forward: Callable[[StepPlan, np.ndarray | None], None] | None = None,
        rows: Sequence[SamplingRow] | None = None,
    ) -> Forward:
        """The part of a step every tensor-parallel rank runs: block ops, the forward, the logits.
        `before_forward(plan, extra logits rows)` runs first (a tensor-parallel driver broadcasts the
        plan there). `rows` (rank 0): the sampled sequences' rows, for a draft model's sampled drafts."""
        plp = self.prompt_logprobs_plan(plan, prompt_logprobs)
        extra = plp.indices if plp is not None else None
        if before_forward is not None:
            before_forward(plan, extra)
        self.step_rows = rows
        try:
            logits = self.execute_model(plan, extra)
        finally:
            self.step_rows = None
        return Forward(logits, plp, self.last_hidden)

    @torch.inference_mode()
    def execute_model(self, plan: StepPlan, extra_logits_indices: np.ndarray | None = None) -> Tensor | None:
        """Block ops, the forward, and the logits of `plan.logits_indices` then `extra_logits_indices`.

        Every tensor-parallel rank runs this with the same plan (its collectives must line up); the
        logits come back on rank 0 only (None elsewhere, and when the plan asks for none)."""
        pool = self.kv_pool
        assert pool is not None, "init_kv_cache() first"
        pool.apply_plan_ops(plan)
        drafter = self.drafter
        if drafter is not None:
            drafter.apply_plan_ops(plan)
        logits: Tensor | None = None
        self.last_hidden = None
        num_tokens = int(plan.num_tokens)
        mirror = self._bt_view if self._bt_device is not None else None
        # Every plan with changed rows, empty ones included, or the mirror drifts from the view.
        if num_tokens > 0 or (mirror is not None and len(plan.changed_rows)):
            seq_lens = plan.seq_lens
            num_reqs = len(seq_lens)
            max_query_len = int(plan.num_scheduled_tokens.max()) if num_reqs else 0
            max_seq_len = int(seq_lens.max()) if num_reqs else 0
            graph = None
            mm = self._mm_step(plan) if self.encoder_cache is not None and num_tokens > 0 else None
            if (
                num_tokens == num_reqs
                and self.cuda_graphs is not None
                and mm is None
                and not self.model.uses_mrope
            ):
                graph = self.cuda_graphs.lookup(num_reqs, max_query_len, max_seq_len, pool.kv_caches)
            inputs = self.step_buffers.pack(
                plan,
                extra_logits_indices=extra_logits_indices,
                mirror_rows=mirror,
                graph_size=graph[0] if graph is not None else None,
            )
            if inputs.changed_rows is not None:
                assert self._bt_device is not None and inputs.changed_row_data is not None
                self._bt_device.index_copy_(0, inputs.changed_rows, inputs.changed_row_data)
            self.last_drafts = None
            self.last_draft_probs = None
            meta: AttentionMetadata | None = None
            if drafter is not None and num_tokens > 0 and drafter.runs(plan):
                # built once: a draft model's forward over the step and the target's below share it (and
                # the per-step index plans the attention backend caches on it)
                meta = self._attn_metadata(plan, inputs, max_query_len, max_seq_len)
                self._propose(drafter, plan, inputs, meta)
            if num_tokens > 0:
                if graph is not None:
                    hidden = self._replay(graph, inputs, num_reqs)
                else:
                    if meta is None:
                        meta = self._attn_metadata(plan, inputs, max_query_len, max_seq_len)
                    ctx = ForwardContext(attn_metadata=meta, kv_caches=pool.kv_caches, backend=self.backend)
                    positions = self.step_positions(plan, inputs.positions)
                    if mm is not None:
                        hidden = self._forward_mm(inputs, positions, ctx, mm)
                    else:
                        hidden = self.model(inputs.input_ids, positions, ctx)
                    if self.recurrent is not None:  # a fork copies the state its step computed
                        self.recurrent.apply_copies(plan, len(self.kv_groups))
                self.last_hidden = hidden  # the final hidden states, for embedding requests (rank 0 reads)
                if inputs.logits_indices is not None:
                    rows = (
                        hidden
                        if inputs.logits_are_all_rows
                        else hidden.index_select(0, inputs.logits_indices)
                    )
                    logits = self.model.compute_logits(rows)
        pool.apply_plan_shrink(plan)
        if drafter is not None:
            drafter.apply_plan_shrink(plan)
        return logits

    def _propose(self, drafter: Drafter, plan: StepPlan, inputs: StepInputs, meta: AttentionMetadata) -> None:
        """The drafter's drafts of this step into `inputs` and `last_drafts`; under tensor parallelism rank 0
        broadcasts them to the other ranks, whose drafter receives them."""
        assert self.kv_pool is not None
        step = StepContext(
            plan=plan,
            inputs=inputs,
            attn_metadata=meta,
            build_attn_metadata=self._attn_metadata,
            kv_caches=self.kv_pool.kv_caches,
            block_table_view=self._bt_view,
            block_table_mirrored=self._bt_device is not None,
            rows=self.step_rows,
        )
        proposal = drafter.propose(step)
        self.last_drafts, self.last_draft_probs = proposal.token_ids, proposal.probs
        if self.tp.size > 1 and self.tp.is_driver and plan.has_drafts:
            self.tp.broadcast_cpu(torch.from_numpy(np.ascontiguousarray(self.last_drafts, dtype=np.int64)))

    def _replay(self, graph: tuple[int, int], inputs: StepInputs, num_reqs: int) -> Tensor:
        """A decode step by graph replay: its inputs are already in the graph's static buffers; only the
        block table rows are gathered into the graph's table (on the device)."""
        graphs = self.cuda_graphs
        size = graph[0]
        if inputs.block_table_rows is not None:
            assert self._bt_device is not None
            table = graphs.block_tables[:size, : self._bt_device.shape[1]]
            if table.is_contiguous():
                torch.index_select(self._bt_device, 0, inputs.block_table_rows, out=table)
            else:
                table.copy_(self._bt_device.index_select(0, inputs.block_table_rows))
        else:
            assert inputs.block_tables is not None
            graphs.block_tables[:num_reqs, : inputs.block_tables.shape[1]].copy_(inputs.block_tables)
        return graphs.replay(graph)[:num_reqs]
