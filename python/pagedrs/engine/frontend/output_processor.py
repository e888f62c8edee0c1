"""OutputProcessor: the frontend half of a step. Turns each `EngineCoreOutputs` message into
`RequestOutput`s: incremental detokenization, stop strings (a hit finishes the sample here and asks the
core to abort it), logprobs with their token texts, request metrics, and the output kinds (cumulative,
delta, final only). Only requests that produced something are touched; no per-step copies of whole lists
for delta or final-only requests.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedrs.engine.core.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason
from pagedrs.engine.frontend.sequence import Request, SampleState, check_stop_strings, make_logprob_dict
from pagedrs.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagedrs.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["OutputProcessor", "ProcessedOutputs", "RequestObserver"]


class RequestObserver(Protocol):
    """Receives per-request timings (e.g. Prometheus histograms), each with the engine core (data-parallel
    replica) that served the request: its index, 0 with one core, None where the caller has no cores."""

    def on_first_token(self, ttft_s: float, engine: int | None) -> None: ...
    def on_tokens(self, itl_s: float, num_tokens: int, engine: int | None) -> None: ...
    def on_finished(self, reason: str, e2e_s: float, engine: int | None) -> None: ...


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput | EmbeddingRequestOutput] = field(default_factory=list)
    abort_seqs: list[tuple[str, int]] = field(default_factory=list)  # stop strings hit: tell the core
    errors: dict[str, str] = field(default_factory=dict)  # request id -> why the core dropped it


class OutputProcessor:
    def __init__(self, tokenizer: Any, observer: RequestObserver | None = None) -> None:
        self.tokenizer = tokenizer
        self.observer = observer
        self.requests: dict[str, Request] = {}
        self.pooling: dict[str, tuple[str | None, list[int]]] = {}  # embedding requests: (prompt, ids)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        engine: int | None = None,
    ) -> Request:
        """`engine`: the core (data-parallel replica) it was routed to (its metrics carry that label)."""
        req = Request(request_id, prompt, prompt_token_ids, params, arrival_time, self.tokenizer)
        req.engine = engine
        self.requests[request_id] = req
        return req

    def add_pooling_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self.pooling[request_id] = (prompt, prompt_token_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.pooling)

    def num_unfinished(self) -> int:
        return len(self.requests) + len(self.pooling)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in self.pooling

    def discard(self, request_id: str) -> None:
        """Forget a request the core refused (no output is made for it)."""
        self.requests.pop(request_id, None)
        self.pooling.pop(request_id, None)

    def abort_requests(self, request_ids: Iterable[str], reason: str = "abort") -> list[RequestOutput]:
        """Finish requests here (the caller tells the core); their final outputs."""
        outs: list[RequestOutput] = []
        now = time.time()
        for rid in request_ids:
            self.pooling.pop(rid, None)
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            changed = [s for s in req.seqs if not s.finished]
            for s in changed:
                s.finish_reason = reason
            req.num_unfinished = 0
            req.metrics.finished_time = now
            if self.observer is not None:
                self.observer.on_finished(reason, now - req.metrics.arrival_time, req.engine)
            outs.append(req.to_output(changed))
        return outs

    def process_outputs(self, msg: EngineCoreOutputs) -> ProcessedOutputs:
        result = ProcessedOutputs()
        now = time.time()
        touched: dict[str, tuple[Request, list[SampleState]]] = {}
        for o in msg.outputs:
            if o.request_id in self.pooling:
                self._pooling_output(o, result)
                continue
            req = self.requests.get(o.request_id)
            if req is None:  # aborted or finished here already
                continue
            if o.error is not None:
                result.errors[o.request_id] = o.error
                result.outputs.extend(self.abort_requests([o.request_id]))
                continue
            if o.num_cached_tokens is not None:
                req.num_cached_tokens = o.num_cached_tokens
            if o.first_scheduled_time is not None:
                req.metrics.first_scheduled_time = o.first_scheduled_time
                req.metrics.time_in_queue = o.first_scheduled_time - req.metrics.arrival_time
            if o.prompt_logprobs is not None:
                self._prompt_logprobs(req, o)
            seq = req.seqs[o.index]
            if seq.finished or not (o.new_token_ids or o.finish_reason is not None):
                continue
            if self._update_seq(seq, o, result):
                req.num_unfinished -= 1
            entry = touched.get(o.request_id)
            if entry is None:
                touched[o.request_id] = (req, [seq])
            else:
                entry[1].append(seq)
        for req, changed in touched.values():
            self._observe(req, changed, now)
            if req.finished:
                del self.requests[req.request_id]
                req.metrics.finished_time = now
            elif req.output_kind == RequestOutputKind.FINAL_ONLY:
                continue
            result.outputs.append(req.to_output(changed))
        return result

    def _pooling_output(self, o: EngineCoreOutput, result: ProcessedOutputs) -> None:
        if o.error is not None:
            result.errors[o.request_id] = o.error
            del self.pooling[o.request_id]
        elif o.embedding is not None:
            prompt, ids = self.pooling.pop(o.request_id)
            result.outputs.append(
                EmbeddingRequestOutput(o.request_id, ids, EmbeddingOutput(o.embedding), True, prompt)
            )
        elif o.finish_reason is not None:  # finished without a vector: aborted in the core
            del self.pooling[o.request_id]

    def _update_seq(self, seq: SampleState, o: EngineCoreOutput, result: ProcessedOutputs) -> bool:
        """Apply one core output to a sequence; True when it finished."""
        reason: str | None = o.finish_reason.value if o.finish_reason is not None else None
        stop_reason: int | str | None = o.stop_reason
        if o.new_logprobs is not None and seq.logprobs is not None:
            k = seq.params.logprobs or 0
            lp = o.new_logprobs
            for j in range(len(lp.ranks)):
                seq.add_logprobs(lp.token_ids[j], lp.logprobs[j], lp.ranks[j], k, self.tokenizer)
        if o.new_token_ids:
            det = seq.detokenizer
            stop_terminated = reason == FinishReason.STOP.value
            ids, lps = o.new_token_ids, o.new_token_logprobs
            stop = seq.params.stop if det is not None and not stop_terminated else None
            # Several tokens in one step (speculative decoding) are checked one at a time: a stop string an
            # early one completes drops the ones after it, as if they had come one a step.
            pieces = [ids[j : j + 1] for j in range(len(ids))] if stop and len(ids) > 1 else [ids]
            kept = 0
            for piece in pieces:
                seq.output_token_ids.extend(piece)
                kept += len(piece)
                if det is not None and (not stop_terminated or seq.params.include_stop_str_in_output):
                    new_chars = det.add(piece)
                    if stop and len(seq.output_token_ids) > seq.params.min_tokens:
                        hit = check_stop_strings(
                            det.text, new_chars, stop, seq.params.include_stop_str_in_output
                        )
                        if hit is not None:
                            seq.text_cut = hit[1] if hit[1] != -1 else None
                            if reason is None:
                                result.abort_seqs.append((seq.request.request_id, seq.index))
                            reason, stop_reason = FinishReason.STOP.value, hit[0]
                            break
            if seq.cumulative_logprob is not None and len(lps) == len(ids):
                seq.cumulative_logprob += sum(lps[:kept])
            else:
                seq.cumulative_logprob = None  # a core that did not send them: unknown, not wrong
        if reason is None:
            return False
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        return True

    def _prompt_logprobs(self, req: Request, o: EngineCoreOutput) -> None:
        chunk = o.prompt_logprobs
        assert chunk is not None
        if req.prompt_logprobs is None:
            return
        k = req.params.prompt_logprobs or 0
        for j in range(len(chunk.ranks)):
            pos = chunk.start + j
            if req.prompt_logprobs[pos] is None:  # a recomputed prefix is not recorded twice
                req.prompt_logprobs[pos] = make_logprob_dict(
                    chunk.token_ids[j], chunk.logprobs[j], chunk.ranks[j], k, self.tokenizer
                )

    def _observe(self, req: Request, changed: list[SampleState], now: float) -> None:
        m = req.metrics
        obs = self.observer
        if m.first_token_time is None:
            m.first_token_time = now
            if obs is not None:
                obs.on_first_token(now - m.arrival_time, req.engine)
        elif obs is not None:
            obs.on_tokens(now - m.last_token_time, 1, req.engine)
        m.last_token_time = now
        if req.finished and obs is not None:
            reasons = [s.finish_reason for s in req.seqs if s.finish_reason]
            obs.on_finished(reasons[0] if reasons else "stop", now - m.arrival_time, req.engine)
