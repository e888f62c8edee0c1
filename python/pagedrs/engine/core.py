"""EngineCore: the step and nothing else. schedule() [Rust] -> execute() [model runner] -> update() [Rust].

It takes validated, tokenized `EngineCoreRequest`s and gives back one `EngineCoreOutputs` per step: each
sequence's new token ids (and logprobs), finish reasons from the scheduler (eos, stop token ids, lengths),
and the step's stats. Text, stop strings and `RequestOutput`s belong to the frontend (`OutputProcessor`);
the same core runs in-process under `LLMEngine` and in its own process behind the server (`core_proc`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from pagedrs import __version__, _core
from pagedrs.config import EngineConfig
from pagedrs.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    PromptLogprobsMsg,
    Ready,
    SampleLogprobsMsg,
)
from pagedrs.executor import ExecutorDeadError, TPExecutor, UniProcExecutor
from pagedrs.executor.liquid_executor import LiquidExecutor
from pagedrs.executor.liquid_policy import LiquidAutoPolicy
from pagedrs.executor.start import start_workers, stop_workers
from pagedrs.executor.worker import cpu_threads_per_rank
from pagedrs.metrics import EngineStats, StatLogger, visualize_batch, visualize_batch_boxes
from pagedrs.sampling_params import SamplingParams
from pagedrs.structured_outputs import StructuredOutputManager
from pagedrs.worker.model_runner import ModelRunner

__all__ = ["CoreSeq", "EngineCore"]

logger = logging.getLogger("pagedrs.engine")


def eos_token_ids(tokenizer: Any, hf_config: Any, model_path: str) -> list[int]:
    """The tokenizer's eos plus the config's and generation_config.json's (e.g. Llama 3's <|eot_id|>)."""
    ids: set[int] = set()
    gen_eos = None
    if os.path.isfile(os.path.join(model_path, "generation_config.json")):
        try:
            import transformers

            gen_eos = transformers.GenerationConfig.from_pretrained(model_path).eos_token_id
        except (OSError, ValueError):
            gen_eos = None
    for src in (getattr(tokenizer, "eos_token_id", None), getattr(hf_config, "eos_token_id", None), gen_eos):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(x) for x in src)
    return sorted(ids)


class CoreSeq:
    """One of a request's n samples as the sampler sees it (`SamplingRow`)."""

    __slots__ = (
        "seq_id",
        "index",
        "request_id",
        "params",
        "generator",
        "prompt_token_ids",
        "output_token_ids",
        "is_simple_greedy",
        "num_logprobs",
        "matcher",
    )

    def __init__(
        self, seq_id: int, index: int, request_id: str, params: SamplingParams, prompt: list[int], dev: Any
    ) -> None:
        self.seq_id = seq_id
        self.index = index
        self.request_id = request_id
        self.params = params
        self.generator: torch.Generator | None = None
        if params.seed is not None and params.temperature > 0:
            self.generator = torch.Generator(device=dev)
            self.generator.manual_seed(params.seed)
        self.prompt_token_ids = prompt
        self.matcher: Any = None  # a grammar matcher (structured outputs)
        self.output_token_ids: list[int] = []  # for penalties
        self.num_logprobs = params.logprobs
        self.is_simple_greedy = (
            params.temperature == 0.0
            and not params.needs_penalties
            and not params.logit_bias
            and params.min_tokens == 0
            and params.logprobs is None
        )


class _CoreRequest:
    __slots__ = (
        "request_id",
        "seqs",
        "prompt_logprobs",
        "unscheduled",
        "live",
        "pooling",
        "pool_acc",
        "pool_n",
    )

    def __init__(
        self, request_id: str, seqs: list[CoreSeq], prompt_logprobs: int | None, pooling: Any = None
    ) -> None:
        self.request_id = request_id
        self.seqs = seqs
        self.prompt_logprobs = prompt_logprobs  # top-k wanted, until the prompt is done
        self.unscheduled = True
        self.live = {s.seq_id for s in seqs}
        self.pooling = pooling  # PoolingParams of an embedding request
        self.pool_acc: torch.Tensor | None = None  # mean: sum of positions [0, pool_n); first: position 0
        self.pool_n = 0


class EngineCore:
    """Scheduler + model runner for one engine; one thread drives it."""

    # Methods a frontend may call through `UtilityCall` (name -> bound method is looked up here only).
    UTILITY_METHODS = frozenset(
        {"get_stats", "resize", "reset_prefix_cache", "ping", "liquid", "liquid_degree"}
    )

    def __init__(
        self, config: EngineConfig, loaded: Any, *, max_logprobs: int = 20, workers: Any = None
    ) -> None:
        """`workers`: the started ranks 1..N-1 of a tensor-parallel group (`loaded` is rank 0's shard)."""
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
        self.eos_token_ids = eos_token_ids(loaded.tokenizer, loaded.hf_config, str(loaded.model_path))
        tp = workers.tp if workers is not None else None
        self.runner = ModelRunner(config, loaded.model, eos_token_ids=self.eos_token_ids, tp=tp)
        self.executor: UniProcExecutor
        if workers is None:
            self.executor = UniProcExecutor(self.runner)
        elif workers.world is not None:
            self.executor = LiquidExecutor(self.runner, workers)
        else:
            self.executor = TPExecutor(self.runner, workers)
        pool = self.executor.init_kv_cache()
        num_blocks = pool.num_blocks
        sched = config.scheduler
        self.scheduler = _core.Scheduler(
            num_blocks=num_blocks,
            block_size=config.cache.block_size,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_num_seqs=sched.max_num_seqs,
            max_model_len=sched.max_model_len,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            enable_chunked_prefill=sched.enable_chunked_prefill,
            num_swap_blocks=pool.num_swap_blocks,
            vocab_size=self.vocab_size or None,
        )
        self.runner.attach_block_table(self.scheduler.block_table_view())
        par = config.parallel
        self._shut_down = False
        self._in_liquid = False
        self.liquid_policy: LiquidAutoPolicy | None = None
        if par.liquid_auto and isinstance(self.executor, LiquidExecutor):
            self.liquid_policy = LiquidAutoPolicy(
                self.executor.max_degree,
                par.liquid_auto_window,
                par.liquid_scale_out_threshold,
                par.liquid_scale_in_threshold,
            )
        self._requests: dict[str, _CoreRequest] = {}
        # Requests not yet scheduled, and those still collecting prompt logprobs: a steady decode step
        # loops over neither (no per-request Python when both are empty).
        self._unscheduled: set[str] = set()
        self._wanting_prompt_logprobs: set[str] = set()
        self._num_pooling = 0  # embedding requests in flight
        self._tokenizer = loaded.tokenizer
        self._token_text: dict[int, str] = {}  # token id -> text, for the token-box picture
        self._structured: StructuredOutputManager | None = None
        self._num_structured = 0  # requests with a grammar in the scheduler
        # Structured-output requests whose grammar is still compiling: request id -> (request, future)
        self._awaiting_grammar: dict[str, tuple[EngineCoreRequest, Any]] = {}
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
        if self.device.type == "cuda":
            logger.info("# GPU blocks: %d, # CPU blocks: %d", num_blocks, pool.num_swap_blocks)
        else:
            logger.info("# CPU blocks: %d (device pool), # swap blocks: %d", num_blocks, pool.num_swap_blocks)
        logger.info(
            "engine ready: model=%s device=%s tp=%d dtype=%s max_model_len=%d kv blocks=%d x %d tokens "
            "(%.2f GiB per rank), swap blocks=%d",
            self.model_name,
            self.device,
            self.executor.tensor_parallel_size,
            self.runner.kv_dtype,
            self.max_model_len,
            num_blocks,
            config.cache.block_size,
            num_blocks * self.runner.bytes_per_block / (1 << 30),
            pool.num_swap_blocks,
        )

    @classmethod
    def from_engine_args(cls, args: Any) -> tuple[EngineCore, Any]:
        """(core, loaded model); the tokenizer in `loaded` is for the in-process frontend."""
        from pagedrs.loader import load_model

        _, _, device_cfg, _ = args.early_configs()  # bad arguments fail before any weight is read
        parallel = args.parallel_config()
        ranks = len(parallel.liquid_gpu_range or ()) or parallel.tensor_parallel_size
        if device_cfg.device.type == "cpu" and (device_cfg.num_threads is not None or ranks > 1):
            torch.set_num_threads(cpu_threads_per_rank(device_cfg.num_threads, ranks))
        logger.info(
            "Initializing an LLM engine (pagedrs v%s) with config: %s", __version__, args.config_line()
        )
        workers = start_workers(args, device_cfg.device) if ranks > 1 else None
        try:
            loaded = load_model(
                args.model,
                dtype=args.dtype,
                device=device_cfg.device,
                tokenizer=args.tokenizer,
                tp=workers.tp if workers is not None else None,
                with_tokenizer=not args.skip_tokenizer_init,
                opts=args.load_options(),
            )
            weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
            logger.info("Loading model weights took %.4f GB", weights / (1 << 30))
            config = args.create_engine_config(loaded.max_len)
            return cls(config, loaded, max_logprobs=args.max_logprobs, workers=workers), loaded
        except BaseException:
            if workers is not None:
                stop_workers(workers)
            raise

    def check_health(self) -> None:
        """Raise `ExecutorDeadError` once a step can no longer run (a tensor-parallel rank died)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and free the model and the KV pool (device memory); the core
        takes no more steps."""
        self.executor.shutdown()
        self.runner.kv_pool = None
        self.runner.model = None
        self.runner.cuda_graphs = None
        self._shut_down = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

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
        if req.request_id in self._requests or req.request_id in self._awaiting_grammar:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        so = req.params.structured_outputs
        if so is not None:
            fut = self._structured_manager().compile(so)
            if not fut.done():
                self._awaiting_grammar[req.request_id] = (req, fut)
                return
            self._add_compiled(req, fut)
            return
        self._add_now(req, None)

    def _structured_manager(self) -> StructuredOutputManager:
        if self._structured is None:
            self._structured = StructuredOutputManager(self._tokenizer, self.vocab_size)
        return self._structured

    def _add_compiled(self, req: EngineCoreRequest, fut: Any) -> None:
        try:
            compiled = fut.result()
        except Exception as exc:  # noqa: BLE001 - the constraint is the caller's
            raise ValueError(f"structured outputs: cannot compile the constraint: {exc}") from None
        self._add_now(req, compiled)

    def _admit_compiled(self) -> None:
        """Requests whose grammar finished compiling join the scheduler (errors are reported)."""
        if not self._requests and self._awaiting_grammar:  # nothing else to run: wait a little for one
            concurrent.futures.wait([f for _, f in self._awaiting_grammar.values()], timeout=0.05)
        for rid, (req, fut) in list(self._awaiting_grammar.items()):
            if not fut.done():
                continue
            del self._awaiting_grammar[rid]
            try:
                self._add_compiled(req, fut)
            except ValueError as exc:
                self.reject(rid, str(exc))

    def _add_now(self, req: EngineCoreRequest, compiled: Any) -> None:
        params = req.params
        if req.pooling is not None:  # the engine's default pooling fills what the request left unset
            model_cfg = self.config.model
            req.pooling = req.pooling.resolved(model_cfg.pooling_type, model_cfg.normalize)
        seq_ids = [next(self._seq_counter) for _ in range(params.n)]
        prompt = req.prompt_token_ids
        seqs = [
            CoreSeq(sid, i, req.request_id, params.child(i), prompt, self.device)
            for i, sid in enumerate(seq_ids)
        ]
        self.scheduler.add_request(
            seq_ids,
            np.asarray(prompt, dtype=np.int64),
            max_tokens=req.max_tokens,
            min_tokens=params.min_tokens,
            eos_token_ids=self.eos_token_ids,
            stop_token_ids=params.stop_token_ids or (),
            ignore_eos=params.ignore_eos,
            priority=req.priority,
            # Mean and first-token pooling need every position's hidden state: no cached prefix.
            skip_prefix_cache=params.prompt_logprobs is not None
            or (req.pooling is not None and req.pooling.pooling_type != "last"),
        )  # raises InvalidRequestError (a ValueError) before any state changes here
        for s in seqs:
            self._seqs[s.seq_id] = s
            if compiled is not None:
                s.matcher = StructuredOutputManager.matcher(compiled)
        self._requests[req.request_id] = _CoreRequest(
            req.request_id, seqs, params.prompt_logprobs, req.pooling
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
        for rid in request_ids:
            req = self._drop(rid)
            if req is not None:
                self.scheduler.abort(sorted(req.live))
                for s in req.seqs:
                    self._seqs.pop(s.seq_id, None)
        for rid, index in seqs:
            req = self._requests.get(rid)
            if req is None or not 0 <= index < len(req.seqs):
                continue
            sid = req.seqs[index].seq_id
            if sid in req.live:
                self.scheduler.abort([sid])
                self._finish_seq(req, sid)

    def _finish_seq(self, req: _CoreRequest, seq_id: int) -> None:
        req.live.discard(seq_id)
        self._seqs.pop(seq_id, None)
        if not req.live:
            self._drop(req.request_id)

    def _drop(self, request_id: str) -> _CoreRequest | None:
        self._awaiting_grammar.pop(request_id, None)
        req = self._requests.pop(request_id, None)
        self._unscheduled.discard(request_id)
        self._wanting_prompt_logprobs.discard(request_id)
        if req is not None and req.pooling is not None:
            self._num_pooling -= 1
        if req is not None and req.seqs[0].matcher is not None:
            self._num_structured -= 1
        return req

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._awaiting_grammar)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests or request_id in self._awaiting_grammar

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests) + len(self._awaiting_grammar)

    def take_pending(self) -> list[EngineCoreOutput]:
        out, self._pending = self._pending, []
        return out

    # ---- the step ----------------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """schedule -> execute -> update. A step that raises aborts the requests it held (their error
        outputs wait in `take_pending()`), closes its plan and re-raises; the core keeps serving. A Rust
        panic (or a scheduler poisoned by one) is different: the engine is dead (`ExecutorDeadError`),
        never silently recovered."""
        try:
            return self._step()
        except _core.SchedulerPoisonedError as exc:
            raise ExecutorDeadError(f"engine dead: {exc}") from exc
        except BaseException as exc:
            if type(exc).__name__ == "PanicException":  # pyo3's: a Rust panic in the scheduler
                raise ExecutorDeadError(f"engine dead: the scheduler panicked: {exc}") from exc
            raise

    def _step(self) -> EngineCoreOutputs:
        start = time.perf_counter()
        if self._shut_down:
            raise RuntimeError("this engine was shut down")
        self.executor.check_health()  # a dead tensor-parallel group fails here, before anything is scheduled
        self.liquid_tick()
        if self._awaiting_grammar:
            self._admit_compiled()
        plan: _core.StepPlan = self.scheduler.schedule()
        self._num_steps += 1
        outputs: list[EngineCoreOutput] = self.take_pending()
        obs = self.config.observability
        if obs.enable_log_batch_visualization:
            if obs.batch_visualization_style == "boxes" and self._tokenizer is not None:
                logger.info("step %d\n%s", self._num_steps, self._token_boxes(plan))
            else:
                logger.info(
                    visualize_batch(plan, self._num_steps, self.config.scheduler.max_num_batched_tokens)
                )
        newly = self._mark_scheduled(plan, outputs)
        rows = [self._seqs[sid] for sid in plan.sampled_seq_ids.tolist()]
        wanted = self._prompt_logprobs_wanted(plan)
        masks = None
        if self._num_structured:  # requests without constraints pay nothing
            assert self._structured is not None
            # Built on the host while the model runs; the sampler waits for it.
            masks = self._structured.bitmask_async([s.matcher for s in rows])
        try:
            out = self.executor.execute(plan, rows, wanted, masks)
        except Exception as exc:
            self._fail_plan(plan, exc)
            raise
        pooled = self._pool(plan) if self._num_pooling else {}
        finished = self.scheduler.update(plan, out.sampled_token_ids)
        self._prompt_tokens_total += int(plan.num_prefill_tokens)
        self._generation_tokens_total += len(rows)
        by_seq: dict[int, EngineCoreOutput] = dict(newly)
        for sid, chunk in out.prompt_logprobs.items():
            o = self._output_for(by_seq, outputs, sid)
            o.prompt_logprobs = PromptLogprobsMsg(
                chunk.start, chunk.token_ids.tolist(), chunk.logprobs.tolist(), chunk.ranks.tolist()
            )
        tokens = out.sampled_token_ids.tolist()
        token_lps = out.sampled_logprobs.tolist() if out.sampled_logprobs is not None else None
        lp = out.logprobs
        lp_ids = lp_vals = lp_ranks = None
        for i, seq in enumerate(rows):
            tok = tokens[i]
            o = self._output_for(by_seq, outputs, seq.seq_id)
            if seq.seq_id in pooled:  # an embedding request's last prompt step: its vector, no token
                o.embedding = pooled[seq.seq_id]
                continue
            seq.output_token_ids.append(tok)
            if seq.matcher is not None and not seq.matcher.accept_token(tok):
                logger.warning("request %s: token %d does not follow its grammar", seq.request_id, tok)
            o.new_token_ids = [tok]
            if token_lps is not None:
                o.new_token_logprobs = [token_lps[i]]
            if seq.num_logprobs is not None and lp is not None:
                if lp_ids is None:
                    lp_ids, lp_vals, lp_ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
                k = 1 + seq.num_logprobs
                o.new_logprobs = SampleLogprobsMsg([lp_ids[i][:k]], [lp_vals[i][:k]], [int(lp_ranks[i])])
            req = self._requests.get(seq.request_id)
            if req is not None and req.prompt_logprobs is not None:
                req.prompt_logprobs = None  # the prompt is done: its logprobs are complete
                self._wanting_prompt_logprobs.discard(req.request_id)
        for sid, reason, stop_tok in finished:
            seq = self._seqs.get(int(sid))
            if seq is None:
                continue
            o = self._output_for(by_seq, outputs, seq.seq_id)
            o.finish_reason = FinishReason(reason.value)
            o.stop_reason = stop_tok
            req = self._requests.get(seq.request_id)
            if req is not None:
                self._finish_seq(req, seq.seq_id)
        self._last_step_time = time.perf_counter() - start
        self._last_batch = len(rows)
        stats = self.get_stats()
        if self.stat_logger is not None:
            self.stat_logger.maybe_log(stats)
        return EngineCoreOutputs(outputs, stats, time.time())

    def _output_for(
        self, by_seq: dict[int, EngineCoreOutput], outputs: list[EngineCoreOutput], seq_id: int
    ) -> EngineCoreOutput:
        o = by_seq.get(seq_id)
        if o is None:
            seq = self._seqs[seq_id]
            o = EngineCoreOutput(seq.request_id, seq.index)
            by_seq[seq_id] = o
            outputs.append(o)
        return o

    def _mark_scheduled(
        self, plan: _core.StepPlan, outputs: list[EngineCoreOutput]
    ) -> list[tuple[int, EngineCoreOutput]]:
        """Requests scheduled for the first time: their prefix-cache hits and first scheduled time."""
        newly: list[tuple[int, EngineCoreOutput]] = []
        if not self._unscheduled:
            return newly
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
            o = EngineCoreOutput(
                seq.request_id,
                0,
                num_cached_tokens=int(self.scheduler.num_cached_tokens(sid)),
                first_scheduled_time=now,
            )
            outputs.append(o)
            newly.append((sid, o))
        return newly

    def _prompt_logprobs_wanted(self, plan: _core.StepPlan) -> dict[int, tuple[int, list[int]]] | None:
        wanted: dict[int, tuple[int, list[int]]] = {}
        if not self._wanting_prompt_logprobs:
            return None
        for sid in plan.req_ids.tolist():
            seq = self._seqs.get(sid)
            if seq is None or seq.index != 0:
                continue
            k = self._requests[seq.request_id].prompt_logprobs
            if k is not None:
                wanted[sid] = (k, seq.prompt_token_ids)
        return wanted or None

    def _token_boxes(self, plan: _core.StepPlan) -> str:
        """Seed 003's picture: each request in this step, its tokens so far (prompt then output) as boxes."""
        cache = self._token_text
        columns: list[list[str]] = []
        for sid in plan.req_ids.tolist():
            seq = self._seqs.get(sid)
            if seq is None:
                continue
            texts = []
            for t in [*seq.prompt_token_ids, *seq.output_token_ids]:
                if t not in cache:
                    cache[t] = self._tokenizer.decode([t]).strip() or repr(self._tokenizer.decode([t]))[1:-1]
                texts.append(cache[t])
            columns.append(texts)
        return visualize_batch_boxes(columns, self.config.scheduler.max_num_seqs if columns else 0)

    def _pool(self, plan: _core.StepPlan) -> dict[int, list[float]]:
        """Embedding requests in this plan: accumulate what their pooling needs from this step's hidden
        states; the finished vector of each whose prompt ends in this step (seq id -> vector)."""
        hidden = self.runner.last_hidden
        done: dict[int, list[float]] = {}
        if hidden is None:
            return done
        qsl = plan.query_start_loc.tolist()
        computed = plan.num_computed_tokens.tolist()
        sched = plan.num_scheduled_tokens.tolist()
        prompt = plan.num_prompt_tokens.tolist()
        for b, sid in enumerate(plan.req_ids.tolist()):
            seq = self._seqs.get(sid)
            req = self._requests.get(seq.request_id) if seq is not None else None
            if req is None or req.pooling is None:
                continue
            c, n, p, start = computed[b], sched[b], prompt[b], qsl[b]
            kind = req.pooling.pooling_type
            if kind == "mean":
                lo, hi = max(req.pool_n, c), c + n  # positions recomputed after a preemption count once
                if hi > lo:
                    part = hidden[start + lo - c : start + hi - c].float().sum(dim=0)
                    req.pool_acc = part if req.pool_acc is None else req.pool_acc + part
                    req.pool_n = hi
            elif kind in ("cls", "first") and c == 0:
                req.pool_acc = hidden[start].float()
            if c + n < p:
                continue
            if kind == "last":
                vec = hidden[start + n - 1].float()
            elif kind == "mean":
                assert req.pool_acc is not None
                vec = req.pool_acc / p
            else:
                assert req.pool_acc is not None
                vec = req.pool_acc
            vec = vec.cpu()
            if req.pooling.dimensions is not None:
                vec = vec[: req.pooling.dimensions]
            if req.pooling.normalize:
                vec = torch.nn.functional.normalize(vec, dim=0)
            done[sid] = vec.tolist()
        return done

    def _fail_plan(self, plan: _core.StepPlan, exc: BaseException) -> None:
        """Abort the requests a failed step held and close its plan (aborted rows are skipped by update)."""
        seq_ids = plan.req_ids.tolist() + plan.sampled_seq_ids.tolist()
        failed = sorted({self._seqs[s].request_id for s in seq_ids if s in self._seqs})
        self.abort(failed)
        self.scheduler.update(plan, np.zeros(len(plan.logits_indices), dtype=np.int64))
        for rid in failed:
            self.reject(rid, f"engine step {self._num_steps} failed: {type(exc).__name__}: {exc}")
        logger.error("step %d failed; aborted requests %s", self._num_steps, failed)

    # ---- utilities ---------------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        s = self.scheduler.stats()
        return EngineStats(
            num_running=int(s.num_running),
            num_waiting=int(s.num_waiting),
            num_swapped=int(s.num_swapped),
            kv_usage=float(s.kv_usage),
            prefix_cache_queries=int(s.prefix_cache_queries),
            prefix_cache_hits=int(s.prefix_cache_hits),
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            num_preemptions=int(s.num_preemptions),
            num_blocks=int(s.num_blocks),
            num_free_blocks=int(s.num_free_blocks),
            num_swap_blocks=s.num_swap_blocks,
            num_free_swap_blocks=s.num_free_swap_blocks,
            num_steps=self._num_steps,
            step_time_s=self._last_step_time,
            batch_size=self._last_batch,
        )

    def resize(self, num_blocks: int) -> int:
        """Resize the KV pool (the next step's plan moves and truncates blocks); returns the new count."""
        self.scheduler.resize(int(num_blocks))
        return int(self.scheduler.num_blocks)

    def liquid_degree(self) -> int:
        """Active ranks under liquid scaling (1 without it)."""
        return int(getattr(self.executor, "degree", 1))

    def liquid(self, target: int) -> list[dict[str, Any]]:
        """Move to `target` active ranks (a power of two within liquid_gpu_range), one doubling or halving
        at a time, between steps: running and waiting requests carry on. The pool grows after each
        scale-out and shrinks before each scale-in (ValueError with the numbers when the live blocks do
        not fit; the engine keeps serving at the degree it reached). Returns one record per event."""
        ex = self.executor
        if not isinstance(ex, LiquidExecutor):
            raise ValueError("liquid scaling needs an engine started with liquid_gpu_range=[...]")
        target = int(target)
        if target < 1 or target & (target - 1) or target > ex.max_degree:
            raise ValueError(
                f"liquid target must be a power of two from 1 to {ex.max_degree} active ranks, got {target}"
            )
        events: list[dict[str, Any]] = []
        self._in_liquid = True
        try:
            self._liquid_moves(ex, target, events)
        finally:
            self._in_liquid = False
        return events

    def _liquid_moves(self, ex: LiquidExecutor, target: int, events: list[dict[str, Any]]) -> None:
        while ex.degree != target:
            before = int(self.scheduler.num_blocks)
            if target > ex.degree:
                stats = ex.scale_once(ex.degree * 2)
                grown = ex.target_blocks(ex.degree)
                if grown > self.scheduler.num_blocks:
                    self.scheduler.resize(grown)  # the next plan grows the pool on every active rank
            else:
                dst = ex.degree // 2
                shrunk = ex.target_blocks(dst)
                if shrunk < self.scheduler.num_blocks:
                    self.scheduler.resize(shrunk)  # ResizeError (a ValueError) names both numbers
                    self._apply_block_ops()
                stats = ex.scale_once(dst)
            stats.num_blocks_before = before
            stats.num_blocks_after = int(self.scheduler.num_blocks)
            logger.info("%s", ex.describe(stats))
            events.append(dataclasses.asdict(stats))

    def liquid_tick(self) -> None:
        """Feed the automatic liquid policy one sample of the concurrent cache usage and act on it
        (between steps; never inside a move)."""
        policy = self.liquid_policy
        if policy is None or self._in_liquid:
            return
        s = self.scheduler.stats()
        total = int(s.num_blocks)
        used = total - int(s.num_free_blocks)
        waiting = sum(len(r.seqs[0].prompt_token_ids) for r in self._requests.values() if r.unscheduled)
        policy.observe((used + waiting / self.scheduler.block_size) / max(total, 1))
        ex = self.executor
        assert isinstance(ex, LiquidExecutor)
        decision = policy.decide(ex.degree, used, ex.target_blocks)
        if decision is None:
            return
        target, why = decision
        logger.info("liquid auto: %s", why)
        try:
            self.liquid(target)
        except ValueError as exc:
            logger.warning("liquid auto: the move to %d ranks did not happen: %s", target, exc)
        finally:
            policy.reset()

    def _apply_block_ops(self) -> None:
        """Run one step now so its plan applies a pending resize on every rank; its outputs go out with
        the next step's."""
        out = self.step()
        self._pending.extend(out.outputs)

    def reset_prefix_cache(self) -> bool:
        return bool(self.scheduler.reset_prefix_cache())

    def ping(self) -> str:
        return "pong"

    def call_utility(self, method: str, args: Sequence[Any]) -> Any:
        if method not in self.UTILITY_METHODS:
            raise ValueError(f"unknown utility method {method!r}; one of {sorted(self.UTILITY_METHODS)}")
        return getattr(self, method)(*args)
