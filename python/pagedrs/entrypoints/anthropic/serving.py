"""POST /v1/messages and /v1/messages/count_tokens over the chat engine path.

A Messages request is translated once into the chat request it means (`protocol`), prepared by the chat
endpoint (chat template with the tools, sampling parameters, tool-choice grammar, the reasoning and tool
parsers) and run on the engine; the reply's parser events become Anthropic content blocks (`blocks`), in
Anthropic's stream event order when streamed: `message_start`, per block `content_block_start` /
`content_block_delta`s / `content_block_stop`, `message_delta` (stop reason, output tokens), `message_stop`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from pagedrs.engine.async_engine import RequestStream
from pagedrs.entrypoints.anthropic.blocks import BlockWriter, stop_reason
from pagedrs.entrypoints.anthropic.errors import anthropic_error_body
from pagedrs.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagedrs.entrypoints.openai.chat.serving import ChatPrepared, OpenAIServingChat
from pagedrs.entrypoints.openai.error_mapping import to_api_error
from pagedrs.entrypoints.openai.errors import APIError
from pagedrs.entrypoints.openai.serving_base import merge_streams, random_id


def event(name: str, data: dict[str, Any]) -> str:
    """One server-sent event as Anthropic's API sends them (`event:` names the data's type)."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict[str, Any]:
    """Anthropic's usage: `input_tokens` are the prompt tokens after the cached prefix, which
    `cache_read_input_tokens` counts (their sum is the whole prompt)."""
    return {
        "input_tokens": prompt_tokens - cached,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def count_tokens(self, req: CountTokensRequest) -> dict[str, Any]:
        prep = await self.chat.prepare(req.chat_request())
        return {"input_tokens": len(prep.prompt_ids)}

    async def create(
        self, req: MessagesRequest, raw_request: Request | None = None
    ) -> dict[str, Any] | AsyncIterator[str]:
        prep = await self.chat.prepare(req.to_chat())
        message_id = random_id("msg")
        streams = await self.chat.submit_all(
            message_id, [prep.prompt], prep.params, names=prep.names, lora_request=prep.lora_request
        )
        if req.stream:
            return self._stream(req, message_id, prep, streams[0])
        try:
            (out,) = await self.chat.until_disconnect(raw_request, self.chat.collect(streams))
        finally:
            self.chat.release_all(streams)
        (choice,) = out.outputs
        reader = prep.plan.reader(prep.prompt_text)
        writer = BlockWriter()
        writer.feed(reader.feed(choice.text))
        writer.feed(reader.finish())
        writer.close()
        reason, sequence = stop_reason(
            choice.finish_reason, choice.stop_reason, req.stop_sequences or [], writer.num_tool_calls
        )
        return self._message(message_id, prep, writer.blocks, reason, sequence) | {
            "usage": usage(len(prep.prompt_ids), len(choice.token_ids), out.num_cached_tokens or 0)
        }

    @staticmethod
    def _message(
        message_id: str,
        prep: ChatPrepared,
        blocks: list[dict[str, Any]],
        reason: str | None,
        sequence: str | None,
    ) -> dict[str, Any]:
        return {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": prep.model,
            "content": blocks,
            "stop_reason": reason,
            "stop_sequence": sequence,
        }

    async def _stream(
        self, req: MessagesRequest, message_id: str, prep: ChatPrepared, stream: RequestStream
    ) -> AsyncIterator[str]:
        reader = prep.plan.reader(prep.prompt_text)
        writer = BlockWriter()
        output_tokens, cached, started = 0, 0, False
        try:
            async for _, out in merge_streams([stream]):
                cached = max(cached, out.num_cached_tokens or 0)
                if not started:  # the first output carries the prefix-cache hit
                    start = self._message(message_id, prep, [], None, None)
                    start["usage"] = usage(len(prep.prompt_ids), 0, cached)
                    yield event("message_start", {"type": "message_start", "message": start})
                    started = True
                (choice,) = out.outputs
                output_tokens += len(choice.token_ids)
                events = reader.feed(choice.text)
                if choice.finish_reason is not None:
                    events += reader.finish()
                for data in writer.feed(events):
                    yield event(data["type"], data)
                if choice.finish_reason is not None:
                    for data in writer.close():
                        yield event(data["type"], data)
                    reason, sequence = stop_reason(
                        choice.finish_reason,
                        choice.stop_reason,
                        req.stop_sequences or [],
                        writer.num_tool_calls,
                    )
                    delta = {"stop_reason": reason, "stop_sequence": sequence}
                    tail = {
                        "type": "message_delta",
                        "delta": delta,
                        "usage": {"output_tokens": output_tokens},
                    }
                    yield event("message_delta", tail)
                    yield event("message_stop", {"type": "message_stop"})
        except Exception as exc:  # after the stream started: Anthropic's error event
            err = exc if isinstance(exc, APIError) else to_api_error(exc)
            yield event("error", anthropic_error_body(err.status, err.message))
        finally:
            self.chat.release_all([stream])


__all__ = ["AnthropicServingMessages"]
