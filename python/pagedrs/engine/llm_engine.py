"""LLMEngine: tokenization, request validation, the step loop over the Rust scheduler, detokenization,
stop strings, outputs and statistics."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from pagedrs import _core
from pagedrs.config import EngineConfig
from pagedrs.engine.arg_utils import EngineArgs
from pagedrs.engine.sequence import Request, Sequence, check_stop_strings, make_logprob_dict
from pagedrs.metrics import EngineStats, StatLogger, visualize_batch
from pagedrs.outputs import RequestOutput
from pagedrs.sampling_params import SamplingParams
from pagedrs.worker.model_runner import ModelRunner, RunnerOutput

__all__ = ["EngineArgs", "LLMEngine"]

logger = logging.getLogger("pagedrs.engine")


def _eos_token_ids(tokenizer: Any, hf_config: Any, model_path: str) -> list[int]:
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


class LLMEngine:
    """The synchronous engine: `add_request`, then `step()` until `has_unfinished_requests()` is False."""

    def __init__(self, config: EngineConfig, loaded: Any, *, max_logprobs: int = 20) -> None:
        self.config = config
        self.model = loaded.model
        self.hf_config = loaded.hf_config
        self.tokenizer = loaded.tokenizer
        self.model_path = loaded.model_path
        self.model_name = config.model.model or os.path.splitext(os.path.basename(loaded.model_path))[0]
        self.max_model_len = config.scheduler.max_model_len
        self.max_logprobs = max_logprobs
        self.vocab_size = int(getattr(self.hf_config, "vocab_size", 0) or 0)
        self.device = config.device.device
        self.eos_token_ids = _eos_token_ids(self.tokenizer, self.hf_config, str(loaded.model_path))
        self.runner = ModelRunner(config, self.model, eos_token_ids=self.eos_token_ids)
        num_blocks = self.runner.determine_num_blocks()
        pool = self.runner.init_kv_cache(num_blocks)
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
        self._requests: dict[str, Request] = {}
        self._seqs: dict[int, Sequence] = {}
        self._unscheduled: dict[int, Request] = {}  # first seq id -> request not yet scheduled
        self._prompt_logprob_seqs: dict[int, tuple[int, list[int]]] = {}
        self._seq_counter = itertools.count()
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._num_steps = 0
        obs = config.observability
        self.stat_logger = StatLogger(obs.stats_log_interval) if obs.log_stats else None
        logger.info(
            "engine ready: model=%s device=%s dtype=%s max_model_len=%d kv blocks=%d x %d tokens (%.2f GiB), "
            "swap blocks=%d",
            self.model_name,
            self.device,
            self.runner.kv_dtype,
            self.max_model_len,
            num_blocks,
            config.cache.block_size,
            num_blocks * self.runner.bytes_per_block / (1 << 30),
            pool.num_swap_blocks,
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        from pagedrs.loader import load_model

        _, _, device_cfg, _ = args.early_configs()  # bad arguments fail before any weight is read
        if device_cfg.num_threads is not None and device_cfg.device.type == "cpu":
            torch.set_num_threads(device_cfg.num_threads)
        loaded = load_model(args.model, dtype=args.dtype, device=device_cfg.device, tokenizer=args.tokenizer)
        model_max = int(
            getattr(loaded.model, "max_position", None)
            or getattr(loaded.hf_config, "max_position_embeddings", None)
            or 2048
        )
        config = args.create_engine_config(model_max)
        return cls(config, loaded, max_logprobs=args.max_logprobs)

    # ---- requests ----------------------------------------------------------------------------------
    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer of {self.model_name} has no chat template")
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        text: str | None = None
        ids: Any = None
        if isinstance(prompt, dict):
            text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            if text is None and ids is None:
                raise ValueError(
                    f"prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}"
                )
        elif isinstance(prompt, str):
            text = prompt
        else:
            ids = prompt
        if ids is None:
            if not isinstance(text, str):
                raise ValueError(
                    f"prompt must be a str, a list of token ids or a dict, got {type(text).__name__}"
                )
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give prompts as token ids")
            ids = self.tokenizer.encode(text)
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)) or not all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids
        ):
            raise ValueError(f"prompt_token_ids must be a list of ints, got {str(ids)[:80]}")
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        bad = [t for t in ids if t < 0 or (self.vocab_size and t >= self.vocab_size)]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of vocabulary (size {self.vocab_size})")
        return text, ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Validate and queue a request; ValueError on bad input (the engine state is left unchanged)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; with at least one output token that exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > self.max_logprobs:
                raise ValueError(f"{name} ({v}) is larger than max_logprobs ({self.max_logprobs})")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        seq_ids = [next(self._seq_counter) for _ in range(params.n)]
        req = Request(
            request_id, text, ids, params, time.time() if arrival_time is None else arrival_time, priority
        )
        # Built before the scheduler knows the request, so a failure here leaves no half-added state.
        req.seqs = [
            Sequence(sid, i, req, params.child(i), self.tokenizer, self.device)
            for i, sid in enumerate(seq_ids)
        ]
        self.scheduler.add_request(
            seq_ids,
            np.asarray(ids, dtype=np.int64),
            max_tokens=max_tokens,
            min_tokens=params.min_tokens,
            eos_token_ids=self.eos_token_ids,
            stop_token_ids=params.stop_token_ids or (),
            ignore_eos=params.ignore_eos,
            priority=priority,
            skip_prefix_cache=params.prompt_logprobs is not None,
        )  # raises InvalidRequestError (a ValueError) before any state changes here
        for seq in req.seqs:
            self._seqs[seq.seq_id] = seq
        req.num_unfinished = len(seq_ids)
        self._requests[request_id] = req
        self._unscheduled[seq_ids[0]] = req
        if params.prompt_logprobs is not None:
            self._prompt_logprob_seqs[seq_ids[0]] = (params.prompt_logprobs, ids)

    def abort_request(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """Abort requests in any state and free their blocks; returns their final outputs ("abort")."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        outputs = []
        for rid in ids:
            req = self._requests.pop(str(rid), None)
            if req is None:
                continue
            live = [s for s in req.seqs if not s.finished]
            self.scheduler.abort([s.seq_id for s in live])
            for s in live:
                s.finish_reason = "abort"
            req.num_unfinished = 0
            req.metrics.finished_time = time.time()
            self._forget(req)
            outputs.append(req.to_output())
        return outputs

    def _fail_plan(self, plan: Any) -> None:
        """A step that raised between schedule() and update(): abort the requests it held and close the plan
        (aborted rows are skipped), so the engine keeps serving every other request."""
        seq_ids = plan.req_ids.tolist() + plan.sampled_seq_ids.tolist()
        failed = {self._seqs[s].request.request_id for s in seq_ids if s in self._seqs}
        self.abort_request(failed)
        self.scheduler.update(plan, np.zeros(len(plan.logits_indices), dtype=np.int64))
        logger.error("step %d failed; aborted requests %s", self._num_steps, sorted(failed))

    def _forget(self, req: Request) -> None:
        for s in req.seqs:
            self._seqs.pop(s.seq_id, None)
            self._prompt_logprob_seqs.pop(s.seq_id, None)
            self._unscheduled.pop(s.seq_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one step; outputs (cumulative) of the requests that produced a token or
        finished in it."""
        return self._step(final_only=False)

    def _step(self, final_only: bool) -> list[RequestOutput]:
        if not self._requests:
            return []
        plan = self.scheduler.schedule()
        now = time.time()
        self._num_steps += 1
        if self._unscheduled:
            for sid in plan.req_ids.tolist():
                req = self._unscheduled.pop(sid, None)
                if req is not None:
                    req.metrics.first_scheduled_time = now
                    req.metrics.time_in_queue = now - req.metrics.arrival_time
                    req.num_cached_tokens = int(self.scheduler.num_cached_tokens(sid))
        if self.config.observability.enable_log_batch_visualization:
            logger.info(visualize_batch(plan, self._num_steps, self.config.scheduler.max_num_batched_tokens))
        rows = [self._seqs[sid] for sid in plan.sampled_seq_ids.tolist()]
        wanted = None
        if self._prompt_logprob_seqs:
            wanted = {
                s: self._prompt_logprob_seqs[s]
                for s in plan.req_ids.tolist()
                if s in self._prompt_logprob_seqs
            }
        try:
            out = self.runner.execute(plan, rows, wanted)
        except Exception:
            self._fail_plan(plan)
            raise
        finished = self.scheduler.update(plan, out.sampled_token_ids)
        self._prompt_tokens_total += int(plan.num_prefill_tokens)
        self._generation_tokens_total += len(rows)
        touched = self._process(rows, out, finished, time.time())
        if (
            self.stat_logger is not None
            and time.monotonic() - self.stat_logger.last_time >= self.stat_logger.interval
        ):
            self.stat_logger.log_now(self.get_stats())
        outputs = []
        for req in touched:
            if req.finished:
                self._requests.pop(req.request_id, None)
                self._forget(req)
            elif final_only:
                continue
            outputs.append(req.to_output())
        return outputs

    def _process(self, rows: list[Sequence], out: RunnerOutput, finished: list, now: float) -> list[Request]:
        fin = {int(sid): (reason, stop_tok) for sid, reason, stop_tok in finished}
        touched: dict[int, Request] = {}
        for sid, chunk in out.prompt_logprobs.items():
            req = self._seqs[sid].request
            assert req.prompt_logprobs is not None
            k = req.params.prompt_logprobs or 0
            for j in range(len(chunk.ranks)):
                pos = chunk.start + j
                if req.prompt_logprobs[pos] is None:  # a recomputed prefix is not recorded twice
                    req.prompt_logprobs[pos] = make_logprob_dict(
                        chunk.token_ids[j].tolist(),
                        chunk.logprobs[j].tolist(),
                        int(chunk.ranks[j]),
                        k,
                        self.tokenizer,
                    )
        tokens = out.sampled_token_ids.tolist()
        lp = out.logprobs
        to_abort: list[int] = []
        for i, seq in enumerate(rows):
            tok = tokens[i]
            seq.output_token_ids.append(tok)
            req = seq.request
            if seq.logprobs is not None and lp is not None:
                k = seq.params.logprobs or 0
                seq.add_logprobs(
                    lp.token_ids[i].tolist(), lp.logprobs[i].tolist(), int(lp.ranks[i]), k, self.tokenizer
                )
            f = fin.pop(seq.seq_id, None)
            stop_terminated = f is not None and f[0] == "stop"
            det = seq.detokenizer
            if det is not None and (not stop_terminated or seq.params.include_stop_str_in_output):
                new_chars = det.add((tok,))
                stop = seq.params.stop
                if not stop_terminated and stop and len(seq.output_token_ids) > seq.params.min_tokens:
                    hit = check_stop_strings(det.text, new_chars, stop, seq.params.include_stop_str_in_output)
                    if hit is not None:
                        seq.text_cut = hit[1] if hit[1] != -1 else None
                        if f is None:
                            to_abort.append(seq.seq_id)
                        f = ("stop", hit[0])
            if f is not None:
                seq.finish_reason = f[0]
                seq.stop_reason = f[1]
                req.num_unfinished -= 1
                if req.num_unfinished == 0:
                    req.metrics.finished_time = now
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
            touched[id(req)] = req
            if seq.seq_id in self._prompt_logprob_seqs:
                del self._prompt_logprob_seqs[seq.seq_id]  # prompt done: its logprobs are complete
        if to_abort:
            self.scheduler.abort(to_abort)
        for sid, (reason, stop_tok) in fin.items():  # finished without sampling this step
            seq = self._seqs.get(sid)
            if seq is None or seq.finished:
                continue
            seq.finish_reason, seq.stop_reason = reason, stop_tok
            seq.request.num_unfinished -= 1
            touched[id(seq.request)] = seq.request
        return list(touched.values())

    # ---- stats -------------------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        s = self.scheduler.stats()
        return EngineStats(
            num_running=int(s["num_running"]),
            num_waiting=int(s["num_waiting"]),
            num_swapped=int(s["num_swapped"]),
            kv_usage=float(s["kv_usage"]),
            prefix_cache_queries=int(s["prefix_cache_queries"]),
            prefix_cache_hits=int(s["prefix_cache_hits"]),
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            num_preemptions=int(s["num_preemptions"]),
            num_blocks=int(s["num_blocks"]),
            num_free_blocks=int(s["num_free_blocks"]),
            num_swap_blocks=int(s.get("num_swap_blocks", 0)),
            num_free_swap_blocks=int(s.get("num_free_swap_blocks", 0)),
            num_steps=self._num_steps,
        )
