"""EngineCore: the step. schedule() [Rust] -> execute() [the executor] -> update() [Rust].

It takes validated, tokenized `EngineCoreRequest`s and gives back one `EngineCoreOutputs` per step: each
sequence's new token ids (and logprobs), finish reasons from the scheduler (eos, stop token ids, lengths),
and the step's stats. Text, stop strings and `RequestOutput`s belong to the frontend (`OutputProcessor`);
the same core runs in-process under `LLMEngine` and in its own process behind the server (`proc`).
Beside the step, each in its own module: the outputs (`step_outputs`), pooling (`pooling`), grammar
admission (`grammar_queue`), LoRA slots and parking (`lora_queue`), liquid moves (`executor/liquid/control`,
between steps), the batch picture (`metrics`), the utility methods a frontend calls (`utilities`).
Loading the model and starting the ranks is `executor.build`'s.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedrs import _core
from pagedrs.config import EngineConfig
from pagedrs.engine.core.grammar_queue import GrammarQueue, compiled_grammar
from pagedrs.engine.core.kv_events import KVEventsTap
from pagedrs.engine.core.lora_queue import LoRAQueue
from pagedrs.engine.core.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    Ready,
)
from pagedrs.engine.core.pooling import pool_step
from pagedrs.engine.core.prefix_hashes import lora_salt_of
from pagedrs.engine.core.requests import CoreRequest, CoreSeq
from pagedrs.engine.core.step_outputs import StepOutputs
from pagedrs.engine.core.utilities import CoreUtilitiesMixin
from pagedrs.executor import ExecutorDeadError, UniProcExecutor
from pagedrs.executor.build import load_engine
from pagedrs.executor.liquid.control import LiquidControl
from pagedrs.executor.liquid.executor import LiquidExecutor
from pagedrs.executor.startup_log import log_engine_ready
from pagedrs.loader import LoadedModel
from pagedrs.lora.manager import LoRAManager
from pagedrs.metrics import StatLogger, token_boxes, visualize_batch
from pagedrs.multimodal.admission import ImageAdmission
from pagedrs.runner.kv_disk import DiskTierLink
from pagedrs.runner.outputs import RunnerOutput
from pagedrs.spec_decode.policy import can_speculate
from pagedrs.spec_decode.policy import spec_scheduler_args as _spec_scheduler_args
from pagedrs.structured_outputs import StructuredOutputManager

if TYPE_CHECKING:
    from pagedrs.launch_config import LaunchConfig

__all__ = ["CoreSeq", "EngineCore"]

logger = logging.getLogger("pagedrs.engine")


class EngineCore(CoreUtilitiesMixin):
    """Scheduler + executor for one engine; one thread drives it."""

    def __init__(
        self, config: EngineConfig, loaded: LoadedModel, executor: UniProcExecutor, *, max_logprobs: int = 20
    ) -> None:
        """`executor` runs `loaded` (rank 0's shard under tensor parallelism); the core owns it from here."""
        self.config = config
        self.model_name = config.model.model or os.path.splitext(os.path.basename(loaded.model_path))[0]
        if config.model.served_model_name:
            self.model_name = config.model.served_model_name
        self.max_model_len = config.scheduler.max_model_len
        self.max_logprobs = max_logprobs
        self.vocab_size = int(getattr(loaded.hf_config, "vocab_size", 0) or 0)
        self.device = config.device.device
        head = getattr(loaded.model, "lm_head", None)
        self.embedding_size = int(getattr(head, "embedding_dim", 0) or 0)  # the pooled hidden state's width
        self.eos_token_ids = loaded.eos_token_ids
        self.executor = executor
        kv = executor.init_kv_cache()
        self._kv_block_bytes = kv.bytes_per_block
        sched = config.scheduler
        self.scheduler = _core.Scheduler(
            num_blocks=kv.num_blocks,
            block_size=config.cache.block_size,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_num_seqs=sched.max_num_seqs,
            max_model_len=sched.max_model_len,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            enable_chunked_prefill=sched.enable_chunked_prefill,
            num_swap_blocks=kv.num_swap_blocks,
            num_tier_blocks=kv.num_tier_blocks,
            vocab_size=self.vocab_size or None,
            **_spec_scheduler_args(config),
        )
        executor.attach_block_table(self.scheduler.block_table_view())
        for group in kv.groups:  # the layers whose blocks live in pools of their own (`runner.kv_groups`)
            self.scheduler.add_window_group(group.window, group.num_blocks)
        if kv.recurrent_slots:  # the linear-attention layers' state slots (`runner.recurrent`)
            self.scheduler.add_recurrent_group(kv.recurrent_slots, kv.recurrent_snapshots)
        self._kv_spec = kv
        self._kv_pool_names = self.kv_pool_names(kv.has_full_layers)
        # Prefix-cache events for routers (`kv_events`): recorded by the scheduler only when consumed.
        self._kv_events = KVEventsTap.open(config.kv_events, self.scheduler, self.device, self._kv_pool_names)
        self._disk = DiskTierLink.open(config, loaded.model_path, executor, self.scheduler)  # `kv_disk`
        if self._kv_events is not None and self._disk is not None:
            self._kv_events.attach_disk(self._disk.disk)
        # LoRA deltas hook into the model's linear layers, eager steps (`lora_config`); under tensor
        # parallelism the other ranks follow the slots through the executor's step channel.
        self.lora: LoRAManager | None = None
        if config.lora is not None:
            tp = executor.tensor_parallel_size > 1
            self.lora = LoRAManager(loaded.model, config.lora, self.device, broadcast=tp)
            executor.attach_lora(self.lora)
        self._loras = LoRAQueue(self.lora)
        self._shut_down = False
        atomic = bool(getattr(loaded.model, "mm_bidirectional", False))
        self._images = ImageAdmission(
            executor,
            self.scheduler,
            self.vocab_size,
            atomic=atomic,
            encoder_budget=sched.max_num_encoder_input_tokens,
        )
        self.liquid_control: LiquidControl | None = None
        if isinstance(executor, LiquidExecutor):
            self.liquid_control = LiquidControl(executor, self.scheduler, config.parallel, self._keep_step)
        self._requests: dict[str, CoreRequest] = {}
        # Requests not yet scheduled, and those still collecting prompt logprobs (a decode step loops over neither)
        self._unscheduled: set[str] = set()
        self._wanting_prompt_logprobs: set[str] = set()
        self._num_pooling = 0  # embedding requests in flight
        self._tokenizer = loaded.tokenizer
        self._token_text: dict[int, str] = {}  # token id -> text, for the token-box picture
        self._grammars = GrammarQueue(loaded.tokenizer, self.vocab_size)
        self._num_structured = 0  # requests with a grammar in the scheduler
        self._seqs: dict[int, CoreSeq] = {}
        self._seq_counter = itertools.count()
        self._pending: list[EngineCoreOutput] = []  # error outputs not yet sent (failed steps, rejects)
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._num_steps = 0
        self._last_step_time = 0.0
        self._last_batch = 0
        obs = config.observability
        self.stat_logger = StatLogger(obs.stats_log_interval) if obs.log_stats else None
        log_engine_ready(self, kv)

    @classmethod
    def from_config(cls, launch: LaunchConfig) -> tuple[EngineCore, LoadedModel]:
        """(core, loaded model) from the resolved config (vLLM's `EngineCore(vllm_config)`); the tokenizer
        in `loaded` is for the in-process frontend."""
        config, loaded, executor = load_engine(launch)
        try:
            return cls(config, loaded, executor, max_logprobs=launch.max_logprobs), loaded
        except BaseException:
            executor.shutdown()
            raise

    def check_health(self) -> None:
        """Raise `ExecutorDeadError` once a step can no longer run (a tensor-parallel rank died)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, free the model and the KV pool; the core takes no more steps."""
        self.executor.shutdown()
        if self._kv_events is not None:
            self._kv_events.close()
        self._shut_down = True

    def ready_info(self) -> Ready:
        return Ready(
            model_name=self.model_name,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=list(self.eos_token_ids),
            max_logprobs=self.max_logprobs,
            num_blocks=int(self.scheduler.num_blocks),
            block_size=int(self.scheduler.block_size),
            pid=os.getpid(),
            embedding_size=self.embedding_size,
            task=self.config.model.task,
        )

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a validated request; ValueError (state unchanged) if the scheduler rejects it. A request
        with structured outputs waits (outside the scheduler) until its grammar is compiled."""
        if self.has_request(req.request_id):
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self._loras.check(req)  # ValueError (LoRA off, bad folder, rank) before anything is queued
        so = req.params.structured_outputs
        if so is None:
            self._add_now(req, None)
            return
        fut = self._grammars.compile(so)
        if fut.done():
            self._add_now(req, compiled_grammar(fut))
        else:
            self._grammars.park(req, fut)

    def _admit_compiled(self) -> None:
        """Requests whose grammar finished compiling join the scheduler (errors are reported)."""
        for req, fut in self._grammars.take_ready(idle=not self._requests):
            try:
                self._add_now(req, compiled_grammar(fut))
            except ValueError as exc:
                self.reject(req.request_id, str(exc))

    def _admit_lora_parked(self) -> None:
        """Parked LoRA requests whose adapter now finds a slot join the scheduler, in arrival order."""
        for req, compiled in self._loras.take_parked():
            try:
                self._add_now(req, compiled)
            except ValueError as exc:
                self.reject(req.request_id, str(exc))

    def _add_now(self, req: EngineCoreRequest, compiled: Any) -> None:
        params = req.params
        if req.pooling is not None:  # the engine's default pooling fills what the request left unset
            model_cfg = self.config.model
            req.pooling = req.pooling.resolved(model_cfg.pooling_type, model_cfg.normalize)
        seq_ids = [next(self._seq_counter) for _ in range(params.n)]
        prompt = req.prompt_token_ids
        seqs = [
            CoreSeq(sid, i, req.request_id, params.child(i), prompt, self.device, self.scheduler)
            for i, sid in enumerate(seq_ids)
        ]
        if not self._loras.activate(req, compiled, seq_ids):
            return  # parked until its adapter finds a slot
        lora = req.lora_request
        if self._kv_events is not None:
            self._kv_events.note_lora(lora)
        try:
            mrope = (req.mrope_positions, req.mrope_delta) if req.mrope_positions is not None else None
            sched_ids = self._images.admit(seq_ids, prompt, req.mm_items, mrope) if req.mm_items else prompt
            self.scheduler.add_request(
                seq_ids,
                np.asarray(sched_ids, dtype=np.int64),
                max_tokens=req.max_tokens,
                min_tokens=params.min_tokens,
                eos_token_ids=self.eos_token_ids,
                stop_token_ids=params.stop_token_ids or (),
                ignore_eos=params.ignore_eos,
                priority=req.priority,
                # Mean and first-token pooling need every position's hidden state: no cached prefix.
                skip_prefix_cache=params.prompt_logprobs is not None
                or (req.pooling is not None and req.pooling.pooling_type != "last"),
                # An adapter's KV differs from the base model's: its blocks hash under its own key.
                cache_salt=lora_salt_of(lora),
                speculate=self.config.speculative is not None
                and can_speculate(params, lora is not None or req.pooling is not None),
            )  # raises InvalidRequestError (a ValueError) before any state changes here
        except BaseException:
            self._loras.release(req.request_id)
            if req.mm_items:
                self._images.release(seq_ids)
            raise
        if self._disk is not None:  # the disk tier's blocks of this prompt into the host tier first
            self._disk.promote(seq_ids[0], prompt)
        for s in seqs:
            self._seqs[s.seq_id] = s
            if compiled is not None:
                s.matcher = StructuredOutputManager.matcher(compiled)
        self._requests[req.request_id] = CoreRequest(
            req.request_id, seqs, params.prompt_logprobs, req.pooling, has_images=bool(req.mm_items)
        )
        self._unscheduled.add(req.request_id)
        if params.prompt_logprobs is not None:
            self._wanting_prompt_logprobs.add(req.request_id)
        if req.pooling is not None:
            self._num_pooling += 1
        if compiled is not None:
            self._num_structured += 1

    def reject(self, request_id: str, error: str) -> None:
        """Report a request the core could not take (sent with the next step message)."""
        self._pending.append(EngineCoreOutput(request_id, 0, finish_reason=FinishReason.ABORT, error=error))

    def abort(self, request_ids: Iterable[str], seqs: Sequence[tuple[str, int]] = ()) -> None:
        """Free whole requests, or single samples (request id, index); unknown ids are ignored."""
        request_ids = list(request_ids)
        self._loras.drop(request_ids)
        for rid in request_ids:
            req = self._drop(rid)
            if req is not None:
                self.scheduler.abort(sorted(req.live))
                for s in req.seqs:
                    self._seqs.pop(s.seq_id, None)
        for rid, index in seqs:
            r = self._requests.get(rid)
            if r is None or not 0 <= index < len(r.seqs):
                continue
            sid = r.seqs[index].seq_id
            if sid in r.live:
                self.scheduler.abort([sid])
                self._finish_seq(r, sid)

    def _finish_seq(self, req: CoreRequest, seq_id: int) -> None:
        req.live.discard(seq_id)
        self._seqs.pop(seq_id, None)
        if not req.live:
            self._drop(req.request_id)

    def _drop(self, request_id: str) -> CoreRequest | None:
        self._grammars.drop(request_id)
        req = self._requests.pop(request_id, None)
        self._loras.release(request_id)
        self._unscheduled.discard(request_id)
        self._wanting_prompt_logprobs.discard(request_id)
        if req is not None and req.pooling is not None:
            self._num_pooling -= 1
        if req is not None and req.has_images:
            self._images.release([s.seq_id for s in req.seqs])
        if req is not None and req.seqs[0].matcher is not None:
            self._num_structured -= 1
        return req

    def _request_of(self, seq_id: int) -> CoreRequest | None:
        seq = self._seqs.get(seq_id)
        return self._requests.get(seq.request_id) if seq is not None else None

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(len(self._grammars)) or bool(len(self._loras))

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests or request_id in self._grammars or request_id in self._loras

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests) + len(self._grammars) + len(self._loras)

    def take_pending(self) -> list[EngineCoreOutput]:
        out, self._pending = self._pending, []
        return out

    # ---- the step ----------------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """Between steps: grammars that finished compiling join, the liquid policy may move; then one
        schedule -> execute -> update. A step that raises aborts the requests it held (their error
        outputs wait in `take_pending()`), closes its plan and re-raises; the core keeps serving. A Rust
        panic (or a scheduler poisoned by one) is different: the engine is dead (`ExecutorDeadError`),
        never silently recovered."""
        try:
            if self._shut_down:
                raise RuntimeError("this engine was shut down")
            self.executor.check_health()  # a dead tensor-parallel group fails here, before any scheduling
            if self.liquid_control is not None:
                self.liquid_control.tick(self._waiting_prompt_tokens())
            if len(self._grammars):
                self._admit_compiled()
            if len(self._loras):
                self._admit_lora_parked()
            out = self._step()
            if self._kv_events is not None:  # after any step run between steps (a liquid shrink)
                out.kv_events = self._kv_events.take_step()
            return out
        except _core.SchedulerPoisonedError as exc:
            raise ExecutorDeadError(f"engine dead: {exc}") from exc
        except BaseException as exc:
            if type(exc).__name__ == "PanicException":  # pyo3's: a Rust panic in the scheduler
                raise ExecutorDeadError(f"engine dead: the scheduler panicked: {exc}") from exc
            raise

    def _step(self) -> EngineCoreOutputs:
        start = time.perf_counter()
        self._images.sync()
        plan = self.scheduler.schedule()
        self._num_steps += 1
        self._log_batch(plan)
        outs = StepOutputs(self._seqs, self.take_pending())
        self._mark_scheduled(plan, outs)
        rows = [self._seqs[sid] for sid in plan.sampled_seq_ids.tolist()]
        try:
            self._loras.prepare(plan)
            out = self.executor.execute(
                plan, rows, self._prompt_logprobs_wanted(plan), self._grammar_masks(rows)
            )
        except Exception as exc:
            self._fail_plan(plan, exc)
            raise
        self._update(plan, rows, out, outs)
        self._last_step_time = time.perf_counter() - start
        if self.config.speculative is not None:
            self.scheduler.observe_step_time(self._last_step_time)
        self._last_batch = len(rows)
        stats = self.get_stats()
        if self.stat_logger is not None:
            self.stat_logger.maybe_log(stats)
        return EngineCoreOutputs(outs.outputs, stats, time.time())

    def _keep_step(self) -> None:
        """A step run between steps (a liquid shrink): its outputs go out with the next step's."""
        outputs = self._step().outputs  # it takes the pending outputs itself: extend the list after it
        self._pending.extend(outputs)

    def _update(
        self, plan: _core.StepPlan, rows: list[CoreSeq], out: RunnerOutput, outs: StepOutputs
    ) -> None:
        """The sampled tokens into the scheduler (stop checks, frees) and the step's outputs."""
        pooled = pool_step(plan, out.hidden, self._request_of) if self._num_pooling else {}
        kept = None
        if out.token_counts is not None:
            finished, kept = self.scheduler.update_spec(plan, out.sampled_token_ids, out.token_counts)
        else:
            finished = self.scheduler.update(plan, out.sampled_token_ids)
        self._prompt_tokens_total += int(plan.num_prefill_tokens)
        self._generation_tokens_total += len(rows) if kept is None else int(kept.sum())
        outs.prompt_logprobs(out)
        for seq, toks in outs.sampled(rows, out, pooled, kept):
            if seq.matcher is not None:
                for tok in toks:
                    if not seq.matcher.accept_token(tok):
                        logger.warning(
                            "request %s: token %d does not follow its grammar", seq.request_id, tok
                        )
            req = self._requests.get(seq.request_id)
            if req is not None and req.prompt_logprobs is not None:
                req.prompt_logprobs = None  # the prompt is done: its logprobs are complete
                self._wanting_prompt_logprobs.discard(req.request_id)
        for sid, reason, stop_tok in finished:
            done = self._seqs.get(int(sid))
            if done is None:
                continue
            o = outs.for_seq(done.seq_id)
            o.finish_reason = FinishReason(reason.value)
            o.stop_reason = stop_tok
            req = self._requests.get(done.request_id)
            if req is not None:
                self._finish_seq(req, done.seq_id)

    def _grammar_masks(self, rows: list[CoreSeq]) -> Any:
        """The grammar bitmasks of the constrained rows, built on the host in a helper thread while the
        model runs (the sampler waits for it); None when no request has a constraint."""
        if not self._num_structured:
            return None
        return self._grammars.manager.bitmask_async([s.matcher for s in rows])

    def _waiting_prompt_tokens(self) -> int:
        return sum(len(r.seqs[0].prompt_token_ids) for r in self._requests.values() if r.unscheduled)

    def _log_batch(self, plan: _core.StepPlan) -> None:
        obs = self.config.observability
        if not obs.enable_log_batch_visualization:
            return
        if obs.batch_visualization_style == "boxes" and self._tokenizer is not None:
            picture = token_boxes(
                plan, self._seqs, self._tokenizer, self._token_text, self.config.scheduler.max_num_seqs
            )
            logger.info("step %d\n%s", self._num_steps, picture)
        else:
            logger.info(visualize_batch(plan, self._num_steps, self.config.scheduler.max_num_batched_tokens))

    def _mark_scheduled(self, plan: _core.StepPlan, outs: StepOutputs) -> None:
        """Requests scheduled for the first time: their prefix-cache hits and first scheduled time."""
        if not self._unscheduled:
            return
        now = time.time()
        for sid in plan.req_ids.tolist():
            seq = self._seqs.get(sid)
            if seq is None or seq.index != 0:
                continue
            req = self._requests[seq.request_id]
            if not req.unscheduled:
                continue
            req.unscheduled = False
            self._unscheduled.discard(req.request_id)
            outs.first_scheduled(seq, int(self.scheduler.num_cached_tokens(sid)), now)

    def _prompt_logprobs_wanted(self, plan: _core.StepPlan) -> dict[int, tuple[int, Sequence[int]]] | None:
        if not self._wanting_prompt_logprobs:
            return None
        wanted: dict[int, tuple[int, Sequence[int]]] = {}
        for sid in plan.req_ids.tolist():
            seq = self._seqs.get(sid)
            if seq is None or seq.index != 0:
                continue
            k = self._requests[seq.request_id].prompt_logprobs
            if k is not None:
                wanted[sid] = (k, seq.prompt_token_ids)
        return wanted or None

    def _fail_plan(self, plan: _core.StepPlan, exc: BaseException) -> None:
        """Abort the requests a failed step held and close its plan (aborted rows are skipped by update)."""
        seq_ids = plan.req_ids.tolist() + plan.sampled_seq_ids.tolist()
        failed = sorted({self._seqs[s].request_id for s in seq_ids if s in self._seqs})
        self.abort(failed)
        self.scheduler.update(plan, np.zeros(len(plan.logits_indices), dtype=np.int64))
        for rid in failed:
            self.reject(rid, f"engine step {self._num_steps} failed: {type(exc).__name__}: {exc}")
        logger.error("step %d failed; aborted requests %s", self._num_steps, failed)
