"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from pagedrs.engine.async_engine import RequestStream
from pagedrs.entrypoints.openai.completions.beam_search import beam_search_outputs, whole_response_stream
from pagedrs.entrypoints.openai.completions.protocol import CompletionRequest
from pagedrs.entrypoints.openai.logprobs import TokenText, completion_logprobs
from pagedrs.entrypoints.openai.serving_base import (
    SSE_DONE,
    OpenAIServing,
    cached_tokens,
    merge_streams,
    now_s,
    random_id,
    sse,
    sse_error,
    usage_info,
)
from pagedrs.outputs import CompletionOutput, RequestOutput
from pagedrs.sampling_params import SamplingParams


class OpenAIServingCompletion(OpenAIServing):
    async def prepare(self, req: CompletionRequest) -> tuple[str, list[list[int]], list[str], SamplingParams]:
        """Validates and tokenizes; returns (model, prompt ids, prompt texts, sampling params)."""
        model = self.resolve_model(req.model)[0]
        ids_list: list[list[int]] = []
        texts: list[str] = []
        for p in req.prompts():
            if isinstance(p, str):
                ids = await self.offload(self.tokenize, p, size=len(p))
                text = p
            else:
                ids, text = list(p), ""  # echoed text decoded once the engine has checked the ids
            ids_list.append(ids)
            texts.append(text)
        params = self.sampling_params(req, req.max_tokens, req.logprobs, stream=bool(req.stream))
        return model, ids_list, texts, params

    async def create(
        self, req: CompletionRequest, raw_request: Request | None = None
    ) -> dict[str, Any] | AsyncIterator[str]:
        """A response body, or an SSE text iterator when ``req.stream``."""
        model, ids_list, texts, params = await self.prepare(req)
        request_id = random_id("cmpl")
        if req.use_beam_search:
            body = await self._beam_search(req, raw_request, request_id, model, ids_list, texts)
            if req.stream:
                return whole_response_stream(
                    body, bool(req.stream_options and req.stream_options.include_usage)
                )
            return body
        lora = self.resolve_model(req.model)[1]  # the adapter `model` names (None: the base model)
        streams = await self.submit_all(request_id, ids_list, params, lora_request=lora)
        if req.echo:
            texts = [t or self.tokenizer.decode(ids) for t, ids in zip(texts, ids_list, strict=True)]
        if req.stream:
            return self._stream(req, request_id, model, ids_list, texts, streams)
        try:
            outputs = await self.until_disconnect(raw_request, self.collect(streams))
        finally:
            self.release_all(streams)
        return self._response(req, request_id, model, ids_list, texts, outputs)

    async def _beam_search(
        self,
        req: CompletionRequest,
        raw_request: Request | None,
        request_id: str,
        model: str,
        ids_list: list[list[int]],
        texts: list[str],
    ) -> dict[str, Any]:
        """The best n of best_of (default n) beams of each prompt as its choices (vLLM's use_beam_search)."""
        width = req.best_of if req.best_of is not None else req.n
        lora = self.resolve_model(req.model)[1]
        work = beam_search_outputs(self, request_id, req, ids_list, req.max_tokens, width, req.n, lora)
        outputs = await self.until_disconnect(raw_request, work)
        if req.echo:
            texts = [t or self.tokenizer.decode(ids) for t, ids in zip(texts, ids_list, strict=True)]
        return self._response(req, request_id, model, ids_list, texts, outputs)

    def _response(
        self,
        req: CompletionRequest,
        request_id: str,
        model: str,
        ids_list: list[list[int]],
        texts: list[str],
        outputs: list[RequestOutput],
    ) -> dict[str, Any]:
        text_of = TokenText(self.tokenizer)
        choices = []
        completion_tokens = 0
        for p_idx, out in enumerate(outputs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                prefix = texts[p_idx] if req.echo else ""
                logprobs = None
                if req.logprobs is not None:
                    logprobs = completion_logprobs(
                        c.token_ids, c.logprobs, req.logprobs, text_of, len(prefix)
                    )
                choices.append(
                    {
                        "index": p_idx * req.n + c.index,
                        "text": prefix + c.text,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                    }
                )
                completion_tokens += len(c.token_ids)
        prompt_tokens = sum(len(ids) for ids in ids_list)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": now_s(),
            "model": model,
            "choices": choices,
            "usage": usage_info(prompt_tokens, completion_tokens, cached_tokens(outputs)),
        }

    async def _stream(
        self,
        req: CompletionRequest,
        request_id: str,
        model: str,
        ids_list: list[list[int]],
        texts: list[str],
        streams: list[RequestStream],
    ) -> AsyncIterator[str]:
        head = {"id": request_id, "object": "text_completion", "created": now_s(), "model": model}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        state = _ChoiceStates(req, texts, TokenText(self.tokenizer))
        cached = [0] * len(ids_list)  # per prompt, from its request's outputs
        try:
            async for p_idx, out in merge_streams(streams):
                cached[p_idx] = max(cached[p_idx], out.num_cached_tokens or 0)
                # One read = every choice's news since the previous read, one event per choice.
                for c in out.outputs:  # delta outputs: new text, ids and logprobs only
                    choice = state.advance(p_idx, c)
                    if choice is not None:
                        yield sse({**head, "choices": [choice], **({"usage": None} if include_usage else {})})
            if include_usage:
                prompt_tokens = sum(len(ids) for ids in ids_list)
                usage = usage_info(prompt_tokens, sum(state.completion_tokens), sum(cached))
                yield sse({**head, "choices": [], "usage": usage})
        except Exception as exc:  # after the stream started: SSE error event
            yield sse_error(exc)
        finally:
            self.release_all(streams)
        yield SSE_DONE


class _ChoiceStates:
    """What a completion stream has sent for each choice (prompt-major: index p * n + c)."""

    def __init__(self, req: CompletionRequest, texts: list[str], text_of: TokenText) -> None:
        num_choices = len(texts) * req.n
        self.req = req
        self.texts = texts
        self.text_of = text_of
        self.finished = [False] * num_choices
        self.echoed = [not req.echo] * num_choices
        self.text_offsets = [0] * num_choices
        self.completion_tokens = [0] * num_choices

    def advance(self, p_idx: int, c: CompletionOutput) -> dict[str, Any] | None:
        """The choice's event for one delta output (the echoed prompt first), or None if nothing new."""
        req = self.req
        idx = p_idx * req.n + c.index
        if self.finished[idx]:
            return None
        done = c.finish_reason is not None
        delta, new_ids = c.text, c.token_ids
        self.completion_tokens[idx] += len(new_ids)
        if not self.echoed[idx]:
            delta = self.texts[p_idx] + delta
            self.echoed[idx] = True
        if not delta and not done and not (req.logprobs is not None and new_ids):
            return None
        logprobs = None
        if req.logprobs is not None:
            start = self.completion_tokens[idx] - len(new_ids)
            offset = self.text_offsets[idx] + (len(self.texts[p_idx]) if req.echo and start == 0 else 0)
            logprobs = completion_logprobs(new_ids, c.logprobs, req.logprobs, self.text_of, offset)
            self.text_offsets[idx] = offset + sum(len(t) for t in logprobs["tokens"])
        self.finished[idx] = done
        return {"index": idx, "text": delta, "logprobs": logprobs, "finish_reason": c.finish_reason}
