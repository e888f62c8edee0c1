"""POST /v1/responses and the stored responses (retrieve, delete, cancel a background one).

A Responses request becomes the equivalent chat request (instructions, the conversation of input
items, tools, text.format), so the chat path checks it, renders it with the chat template, constrains
it and reads the reply (reasoning, tool calls); `OutputItems` turns the reader's events into output
items, streamed as OpenAI's Responses events or returned whole.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from pydantic import TypeAdapter, ValidationError
from starlette.requests import Request

from pagedrs.engine.async_engine import RequestStream
from pagedrs.entrypoints.openai.chat.protocol import ChatCompletionRequest
from pagedrs.entrypoints.openai.chat.serving import ChatPrepared, OpenAIServingChat
from pagedrs.entrypoints.openai.error_mapping import to_api_error
from pagedrs.entrypoints.openai.errors import APIError, bad_request, from_validation_error, not_found
from pagedrs.entrypoints.openai.logprobs import TokenText, chat_logprobs
from pagedrs.entrypoints.openai.protocol import parse_request
from pagedrs.entrypoints.openai.responses.items import OutputItems, StreamEvent, item_id, output_as_input
from pagedrs.entrypoints.openai.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ResponsesRequest,
    to_chat_messages,
)
from pagedrs.entrypoints.openai.responses.store import TERMINAL, ResponsesStore
from pagedrs.entrypoints.openai.serving_base import cached_tokens, merge_streams, now_s

logger = logging.getLogger("pagedrs.serving")

_ITEMS = TypeAdapter(list[InputItem])


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponsesStore, *, only_server: bool = True) -> None:
        """`only_server`: no other API server process shares the store, so a background response
        still unfinished in it was left by a previous process and has failed. With several
        processes, a background response runs in the one that took it; a cancel or delete through
        another marks it in the store, the owner sees that within `watch_interval` seconds and
        aborts its generation, and its result does not overwrite the mark."""
        self.chat = chat
        self.store = store
        self._token_text: TokenText | None = None  # token id -> text, kept across requests
        self.watch_interval = None if only_server else 0.25
        self._watcher: asyncio.Task[None] | None = None
        self._background: dict[str, asyncio.Task[None]] = {}
        if only_server:
            store.fail_unfinished("the server restarted before the response finished")

    # ------------------------------------------------------------------ create
    async def create(
        self, req: ResponsesRequest, raw_request: Request | None = None
    ) -> dict[str, Any] | AsyncIterator[str]:
        conversation = self._conversation(req)
        prep = await self._prepare(req, conversation)
        if req.truncation == "auto":
            prep = await self._truncate(req, conversation, prep)
        response = self._response(req, prep.model)
        # submitted before anything is stored, so a refused request is a 400 even in the background
        streams = await self.chat.submit_all(
            response["id"], [prep.prompt], prep.params, names=prep.names, lora_request=prep.lora_request
        )
        if req.background:
            response["status"] = "queued"
            try:
                self.store.create(response, conversation)
            except BaseException:  # not stored: nobody could collect or cancel it
                self.chat.release_all(streams)
                raise
            task = asyncio.ensure_future(self._run_background(response, prep, streams))
            self._background[response["id"]] = task
            task.add_done_callback(lambda _: self._background_done(response["id"], streams))
            if self.watch_interval is not None and (self._watcher is None or self._watcher.done()):
                self._watcher = asyncio.ensure_future(self._watch_store(self.watch_interval))
            return response
        if req.stream:
            return self._stream(response, prep, streams, conversation if req.store else None)
        try:
            outputs = await self.chat.until_disconnect(raw_request, self.chat.collect(streams))
        finally:
            self.chat.release_all(streams)
        self._finish(response, prep, outputs[0])
        if req.store:
            self.store.create(response, conversation)
        return response

    async def _prepare(self, req: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatPrepared:
        """The conversation as the equivalent chat request, checked and rendered."""
        try:
            items = _ITEMS.validate_python(conversation)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        chat_req = parse_request(
            ChatCompletionRequest, req.chat_fields(to_chat_messages(req.instructions, items))
        )
        chat_req.check()
        try:
            prep = await self.chat.prepare(chat_req)
        except APIError as exc:  # the chat path names the conversation `messages`; here it is `input`
            if exc.param == "messages":
                exc.param = "input"
            raise
        prep.names = {"prompt": "input", "max_tokens": "max_output_tokens"}
        return prep

    async def _truncate(
        self, req: ResponsesRequest, conversation: list[dict[str, Any]], prep: ChatPrepared
    ) -> ChatPrepared:
        """`truncation: "auto"`: while the rendered prompt leaves no room for max_output_tokens (or, if
        unset, one token), drop the conversation's oldest item, with the tool outputs and reasoning it
        leaves at the front (a tool output whose call is gone would break the chat template). The
        instructions and the newest item always stay; if that is still too long, the engine's
        context check answers 400 as with "disabled". The stored conversation stays whole."""
        room = self.chat.max_model_len - (req.max_output_tokens or 1)
        kept = conversation
        while len(prep.prompt_ids) > room and len(kept) > 1:
            kept = kept[1:]
            while len(kept) > 1 and kept[0].get("type") in ("function_call_output", "reasoning"):
                kept = kept[1:]
            prep = await self._prepare(req, kept)
        return prep

    def _conversation(self, req: ResponsesRequest) -> list[dict[str, Any]]:
        """The input items of the whole conversation: the previous response's, its output, then these."""
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            earlier = self.store.conversation(req.previous_response_id)
            if previous is None or earlier is None:
                raise not_found(
                    f"Previous response with id '{req.previous_response_id}' not found.",
                    param="previous_response_id",
                )
            history = earlier + output_as_input(previous.get("output") or [])
        new = [item.model_dump(by_alias=True, exclude_none=True) for item in req.input_items()]
        return history + new

    def _response(self, req: ResponsesRequest, model: str) -> dict[str, Any]:
        """OpenAI's response object, in progress (the request's settings echoed)."""
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text else {"type": "text"}
        choice = req.tool_choice
        return {
            "id": item_id("resp"),
            "object": "response",
            "created_at": now_s(),
            "status": "in_progress",
            "background": req.background,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": model,
            "output": [],
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": req.store,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "text": {"format": fmt},
            "tool_choice": choice.model_dump()
            if choice is not None and not isinstance(choice, str)
            else choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_p": req.top_p if req.top_p is not None else 1.0,
            "truncation": req.truncation,
            "usage": None,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    def _finish(self, response: dict[str, Any], prep: ChatPrepared, output: Any) -> None:
        """Fills a non-streamed response from the engine's final output."""
        c = output.outputs[0]
        reader = prep.plan.reader(prep.prompt_text)
        items = OutputItems(logprobs=prep.num_logprobs is not None)
        items.add_logprobs(self._logprobs(prep, c))
        items.add(reader.feed(c.text))
        items.add(reader.finish())
        items.close("incomplete" if c.finish_reason == "length" else "completed")
        self._complete(response, prep, items, c.finish_reason, len(c.token_ids), cached_tokens([output]))

    def _logprobs(self, prep: ChatPrepared, c: Any) -> list[dict[str, Any]]:
        """The token logprobs of a (delta) output as the Responses API gives them (chat's entries)."""
        if prep.num_logprobs is None or not c.token_ids:
            return []
        if self._token_text is None or self._token_text.tokenizer is not self.chat.tokenizer:
            self._token_text = TokenText(self.chat.tokenizer)
        return chat_logprobs(c.token_ids, c.logprobs, prep.num_logprobs, self._token_text)["content"]

    def _complete(
        self,
        response: dict[str, Any],
        prep: ChatPrepared,
        items: OutputItems,
        finish_reason: str | None,
        output_tokens: int,
        cached: int,
    ) -> None:
        response["output"] = items.items
        if finish_reason == "length":
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            response["status"] = "completed"
        prompt_tokens = len(prep.prompt_ids)
        # The parsers work on text, so the reasoning's tokens are counted by tokenizing its text
        # again (the block's tags not included): close to, not exactly, what was sampled.
        reasoning = "".join(i["content"][0]["text"] for i in items.items if i["type"] == "reasoning")
        reasoning_tokens = (
            len(self.chat.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        )
        response["usage"] = {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, output_tokens)},
            "total_tokens": prompt_tokens + output_tokens,
        }

    # ------------------------------------------------------------------ streaming
    async def _stream(
        self,
        response: dict[str, Any],
        prep: ChatPrepared,
        streams: list[RequestStream],
        conversation: list[dict[str, Any]] | None,
    ) -> AsyncIterator[str]:
        seq = 0

        def event(body: StreamEvent) -> str:
            nonlocal seq
            body["sequence_number"] = seq
            seq += 1
            return f"event: {body['type']}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

        if conversation is not None:
            self.store.create(response, conversation)
        done = False
        try:
            yield event({"type": "response.created", "response": dict(response)})
            yield event({"type": "response.in_progress", "response": dict(response)})
            reader = prep.plan.reader(prep.prompt_text)
            items = OutputItems(logprobs=prep.num_logprobs is not None)
            output_tokens, cached, finish_reason = 0, 0, None
            async for _, out in merge_streams(streams):
                cached = max(cached, out.num_cached_tokens or 0)
                for c in out.outputs:
                    output_tokens += len(c.token_ids)
                    items.add_logprobs(self._logprobs(prep, c))
                    events = reader.feed(c.text)
                    if c.finish_reason is not None:
                        finish_reason = c.finish_reason
                        events += reader.finish()
                    for body in items.add(events):
                        yield event(body)
            for body in items.close("incomplete" if finish_reason == "length" else "completed"):
                yield event(body)
            self._complete(response, prep, items, finish_reason, output_tokens, cached)
            done = True
            if conversation is not None:
                self.store.update(response)
            kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
            yield event({"type": kind, "response": response})
        except Exception as exc:  # after the stream started: a response.failed event
            err = to_api_error(exc)
            response["status"] = "failed"
            response["error"] = {"code": err.code or "server_error", "message": err.message}
            done = True
            if conversation is not None:
                self.store.update(response)
            yield event({"type": "response.failed", "response": response})
        finally:
            self.chat.release_all(streams)
            if not done and conversation is not None:  # the client went away
                response["status"] = "cancelled"
                self.store.update(response)

    # ------------------------------------------------------------------ background
    async def _run_background(
        self, response: dict[str, Any], prep: ChatPrepared, streams: list[RequestStream]
    ) -> None:
        try:
            response["status"] = "in_progress"
            self.store.update(response)
            outputs = await self.chat.collect(streams)
            self._finish(response, prep, outputs[0])
        except asyncio.CancelledError:
            response["status"] = "cancelled"
            self.store.update(response)
            raise
        except Exception as exc:  # the stored response carries the error
            err = to_api_error(exc)
            response["status"] = "failed"
            response["error"] = {"code": err.code or "server_error", "message": err.message}
        self.store.update(response)

    async def _watch_store(self, interval: float) -> None:
        """While this process runs background responses: cancel the task of each one that another
        API server process cancelled or deleted in the shared store (ends when none is left)."""
        while self._background:
            await asyncio.sleep(interval)
            try:
                ids = list(self._background)
                statuses = await asyncio.to_thread(self.store.statuses, ids)
            except Exception:  # a busy or closed store: try again next time
                logger.exception("checking the background responses for a cancel failed")
                continue
            for response_id in ids:
                task = self._background.get(response_id)
                if task is not None and statuses.get(response_id, "cancelled") == "cancelled":
                    task.cancel()

    def _background_done(self, response_id: str, streams: list[RequestStream]) -> None:
        """Runs once however the task ended (even cancelled before it started): its streams are released."""
        self._background.pop(response_id, None)
        self.chat.release_all(streams)

    # ------------------------------------------------------------------ stored
    def retrieve(self, response_id: str) -> dict[str, Any]:
        body = self.store.get(response_id)
        if body is None:
            raise not_found(f"Response with id '{response_id}' not found.", param="response_id")
        return body

    def input_items(
        self, response_id: str, limit: int = 20, order: str = "desc", after: str | None = None
    ) -> dict[str, Any]:
        """OpenAI's list of the items used to generate a response (the whole conversation), by page."""
        conversation = self.store.conversation(response_id)
        if conversation is None:
            raise not_found(f"Response with id '{response_id}' not found.", param="response_id")
        items: list[dict[str, Any]] = []
        for index, item in enumerate(_ITEMS.validate_python(conversation)):
            listed = _listed_item(item, response_id, index)
            if listed is not None:
                items.append(listed)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [x["id"] for x in items]
            if after not in ids:
                raise not_found(f"Item with id '{after}' not found.", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }

    def delete(self, response_id: str) -> dict[str, Any]:
        task = self._background.get(response_id)
        if task is not None:
            task.cancel()
        if not self.store.delete(response_id):
            raise not_found(f"Response with id '{response_id}' not found.", param="response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """Cancels a background response (as OpenAI: a finished one is returned as it is)."""
        body = self.retrieve(response_id)
        if not body.get("background"):
            raise bad_request("Only background responses can be cancelled.", param="response_id")
        if body["status"] in TERMINAL:
            return body
        task = self._background.get(response_id)
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        body["status"] = "cancelled"
        self.store.update(body)
        return self.retrieve(response_id)


def _listed_item(item: Any, response_id: str, index: int) -> dict[str, Any] | None:
    """A conversation item as OpenAI lists it: with an id (its own, else one stable per position)."""
    stable = f"{response_id.removeprefix('resp_')}{index:04d}"
    if isinstance(item, MessageItem):
        kind = "output_text" if item.role == "assistant" else "input_text"
        part: dict[str, Any] = {"type": kind, "text": item.text(f"input[{index}]")}
        if kind == "output_text":
            part["annotations"] = []
        return {
            "type": "message",
            "id": item.id or f"msg_{stable}",
            "role": item.role,
            "status": "completed",
            "content": [part],
        }
    if isinstance(item, FunctionCallItem):
        return {
            "type": "function_call",
            "id": item.id or f"fc_{stable}",
            "call_id": item.call_id,
            "name": item.name,
            "arguments": item.arguments,
            "status": "completed",
        }
    if isinstance(item, FunctionCallOutputItem):
        return {
            "type": "function_call_output",
            "id": item.id or f"fco_{stable}",
            "call_id": item.call_id,
            "output": item.text(),
            "status": "completed",
        }
    return None  # reasoning items are not given back
