"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from pagedrs.entrypoints.openai.errors import bad_request
from pagedrs.entrypoints.openai.logprobs import TokenText, chat_logprobs
from pagedrs.entrypoints.openai.protocol import ChatCompletionRequest
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


class OpenAIServingChat(OpenAIServing):
    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        """The tokenizer's chat template, rendered to text and tokenized without extra specials."""
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            if not isinstance(text, str):
                raise TypeError("chat template did not render to text")
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        except Exception as exc:  # noqa: BLE001 - template errors are the caller's input
            raise bad_request(
                f"messages cannot be rendered with the chat template: {exc}", param="messages"
            ) from None

    async def prepare(self, req: ChatCompletionRequest) -> tuple[str, list[int], Any, int | None]:
        model = self.check_model(req.model)
        messages = req.chat_messages()
        ids = await self.offload(
            self.apply_chat_template,
            messages,
            req.add_generation_prompt,
            size=sum(len(m["content"]) for m in messages),
        )
        requested = req.requested_max_tokens()
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.resolve_max_tokens(len(ids), requested, param, "messages")
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, num_logprobs, stream=bool(req.stream))
        return model, ids, params, num_logprobs

    async def create(
        self, req: ChatCompletionRequest, raw_request: Request | None = None
    ) -> dict[str, Any] | AsyncIterator[str]:
        model, ids, params, num_logprobs = await self.prepare(req)
        request_id = random_id("chatcmpl")
        streams = await self.submit_all(request_id, [ids], params)
        if req.stream:
            return self._stream(req, request_id, model, ids, streams, num_logprobs)
        try:
            outputs = await self.until_disconnect(raw_request, self.collect(streams))
        finally:
            self.release_all(streams)
        out = outputs[0]
        text_of = TokenText(self.tokenizer)
        choices = []
        completion_tokens = 0
        for c in sorted(out.outputs, key=lambda c: c.index):
            logprobs = None
            if num_logprobs is not None:
                logprobs = chat_logprobs(c.token_ids, c.logprobs, num_logprobs, text_of)
            choices.append(
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                }
            )
            completion_tokens += len(c.token_ids)
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": now_s(),
            "model": model,
            "choices": choices,
            "usage": usage_info(len(ids), completion_tokens, cached_tokens(outputs)),
        }

    async def _stream(
        self,
        req: ChatCompletionRequest,
        request_id: str,
        model: str,
        ids: list[int],
        streams: list[Any],
        num_logprobs: int | None,
    ) -> AsyncIterator[str]:
        created = now_s()
        n = req.n
        finished = [False] * n
        completion_tokens = [0] * n
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        text_of = TokenText(self.tokenizer)
        cached = 0  # prompt tokens served by the prefix cache

        def chunk(
            index: int,
            delta: dict[str, Any],
            finish_reason: str | None,
            logprobs: dict[str, Any] | None = None,
        ) -> str:
            body: dict[str, Any] = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [
                    {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
                ],
            }
            if include_usage:
                body["usage"] = None
            return sse(body)

        try:
            for i in range(n):
                yield chunk(i, {"role": "assistant", "content": ""}, None)
            async for _, out in merge_streams(streams):
                cached = max(cached, out.num_cached_tokens or 0)
                for c in out.outputs:  # delta outputs: new text, ids and logprobs only
                    idx = c.index
                    if finished[idx]:
                        continue
                    completion_tokens[idx] += len(c.token_ids)
                    logprobs = None
                    if num_logprobs is not None and c.token_ids:
                        logprobs = chat_logprobs(c.token_ids, c.logprobs, num_logprobs, text_of)
                    if c.text or logprobs is not None:
                        yield chunk(idx, {"content": c.text}, None, logprobs)
                    if c.finish_reason is not None:
                        finished[idx] = True
                        yield chunk(idx, {}, c.finish_reason)
            if include_usage:
                total = sum(completion_tokens)
                yield sse(
                    {
                        "id": request_id,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": usage_info(len(ids), total, cached),
                    }
                )
        except Exception as exc:  # noqa: BLE001 - after the stream started: SSE error event
            yield sse_error(exc)
        finally:
            self.release_all(streams)
        yield SSE_DONE
