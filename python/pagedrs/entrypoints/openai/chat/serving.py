"""POST /v1/chat/completions.

Each choice's text goes through one `ReplyReader` (reasoning parser, then tool-call parser): a stream
sends the reader's events as chat deltas; a non-streamed reply folds the same reader's events into one
message, so the two agree for every output (see `tool_parsers.events`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.requests import Request

from pagedrs.engine.async_engine import AsyncLLMEngine, RequestStream
from pagedrs.entrypoints.openai.chat.images import render_with_images
from pagedrs.entrypoints.openai.chat.output import OutputParsing, ReplyPlan
from pagedrs.entrypoints.openai.chat.protocol import ChatCompletionRequest
from pagedrs.entrypoints.openai.completions.beam_search import beam_search_outputs, whole_response_stream
from pagedrs.entrypoints.openai.errors import bad_request
from pagedrs.entrypoints.openai.logprobs import TokenText, chat_logprobs
from pagedrs.entrypoints.openai.models.serving import ServingModels
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
from pagedrs.entrypoints.openai.tool_parsers import ParsedMessage, chat_deltas
from pagedrs.lora_request import LoRARequest
from pagedrs.sampling_params import SamplingParams

# vLLM's answer to a chat request for a model whose tokenizer has no chat template, with the flag that fixes it
NO_CHAT_TEMPLATE = (
    "the model has no chat template, so chat requests cannot be rendered: start the server with "
    "--chat-template (a Jinja file or the template text), as vLLM; /v1/completions takes raw prompts"
)


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template`` as vLLM reads it: a file's text when `value` names a file, else the template
    itself when it looks like Jinja (ValueError otherwise, naming the value)."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a readable file nor a Jinja template")


def tokenizer_template(tokenizer: Any) -> str | None:
    """The tokenizer's own chat template (the default one of a named set), or None."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) and template else None


@dataclass
class ChatPrepared:
    """A checked chat request, ready for the engine."""

    model: str
    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams
    num_logprobs: int | None
    plan: ReplyPlan
    # the engine's field names as this endpoint spells them in a 400 (see OpenAIServing.submit)
    names: dict[str, str] = field(default_factory=dict)
    lora_request: LoRARequest | None = None  # the adapter `model` named (None: the base model)
    engine_prompt: Any = None  # a prompt with images: the ids and the processed images (`chat.images`)

    @property
    def prompt(self) -> Any:
        """What the engine is handed: the token ids, or the prompt carrying the images."""
        return self.engine_prompt if self.engine_prompt is not None else self.prompt_ids


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        engine: AsyncLLMEngine,
        served_model_names: Sequence[str],
        *,
        tokenizer: Any = None,
        parsing: OutputParsing | None = None,
        models: ServingModels | None = None,
        chat_template: str | None = None,
    ) -> None:
        """`chat_template`: ``--chat-template`` (a file or the text), used instead of the tokenizer's."""
        super().__init__(engine, served_model_names, tokenizer=tokenizer, models=models)
        self.template_override = load_chat_template(chat_template)
        self.chat_template = self.template_override or tokenizer_template(self.tokenizer)
        # `tool_choice` auto reads the format the flags name, else the one the chat template writes
        self.parsing = (parsing or OutputParsing()).with_template(self.chat_template)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[str, list[int]]:
        """The tokenizer's chat template (given the tools, as transformers' `apply_chat_template(tools=)`),
        rendered to text and tokenized without extra specials."""
        if self.chat_template is None:
            raise bad_request(NO_CHAT_TEMPLATE, param="messages")
        kwargs: dict[str, Any] = {"tools": tools} if tools else {}
        if self.template_override is not None:
            kwargs["chat_template"] = self.template_override
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
            if not isinstance(text, str):
                raise TypeError("chat template did not render to text")
            return text, list(self.tokenizer.encode(text, add_special_tokens=False))
        except Exception as exc:  # template errors are the caller's input
            raise bad_request(
                f"messages cannot be rendered with the chat template: {exc}", param="messages"
            ) from None

    async def prepare(self, req: ChatCompletionRequest) -> ChatPrepared:
        model, lora = self.resolve_model(req.model)
        plan = self.parsing.plan(req.tools, req.resolved_tool_choice(), req.parallel_tool_calls)
        messages = plan.chat_messages(req.chat_messages())
        engine_prompt = None
        if req.has_images():
            inputs = self.engine.input_processor
            if inputs.mm_processor is None:
                raise bad_request(
                    "this model takes no images (an image_url part was given)", param="messages"
                )
            if req.use_beam_search:
                raise bad_request("use_beam_search is not supported with images", param="use_beam_search")
            text, ids, engine_prompt = await self.offload(
                render_with_images,
                inputs,
                messages,
                req.add_generation_prompt,
                plan.template_tools(),
                size=1 << 20,
            )
        else:
            text, ids = await self.offload(
                self.render,
                messages,
                req.add_generation_prompt,
                plan.template_tools(),
                size=sum(len(m.get("content") or "") for m in messages),
            )
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, req.requested_max_tokens(), num_logprobs, stream=bool(req.stream))
        params.structured_outputs = plan.constraint(params.structured_outputs, text)
        if plan.keeps_special_tokens():
            params.skip_special_tokens = False
        names = {"prompt": "messages", "max_tokens": param}
        return ChatPrepared(model, ids, text, params, num_logprobs, plan, names, lora, engine_prompt)

    async def create(
        self, req: ChatCompletionRequest, raw_request: Request | None = None
    ) -> dict[str, Any] | AsyncIterator[str]:
        prep = await self.prepare(req)
        request_id = random_id("chatcmpl")
        if req.use_beam_search:  # n beams, each one choice (vLLM's use_beam_search)
            max_tokens = req.requested_max_tokens()
            work = beam_search_outputs(
                self,
                request_id,
                req,
                [prep.prompt_ids],
                max_tokens,
                req.n,
                req.n,
                prep.lora_request,
                prep.names,
            )
            outputs = await self.until_disconnect(raw_request, work)
        else:
            streams = await self.submit_all(
                request_id, [prep.prompt], prep.params, names=prep.names, lora_request=prep.lora_request
            )
            if req.stream:
                return self._stream(req, request_id, prep, streams)
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
            if prep.num_logprobs is not None:
                logprobs = chat_logprobs(c.token_ids, c.logprobs, prep.num_logprobs, text_of)
            message, num_calls = self.message(prep, c.text)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": prep.plan.finish_reason(c.finish_reason, num_calls),
                }
            )
            completion_tokens += len(c.token_ids)
        body = {
            "id": request_id,
            "object": "chat.completion",
            "created": now_s(),
            "model": prep.model,
            "choices": choices,
            "usage": usage_info(len(prep.prompt_ids), completion_tokens, cached_tokens(outputs)),
        }
        if req.stream:  # a streamed beam search: the others returned their stream above
            return whole_response_stream(body, bool(req.stream_options and req.stream_options.include_usage))
        return body

    def message(self, prep: ChatPrepared, text: str) -> tuple[dict[str, Any], int]:
        """The assistant message of a whole reply (and its number of calls)."""
        reader = prep.plan.reader(prep.prompt_text)
        parsed = ParsedMessage().add(reader.feed(text)).add(reader.finish())
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content_or_none()}
        if self.parsing.reasoning_parser is not None:
            message["reasoning_content"] = parsed.reasoning or None
        if parsed.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
        return message, len(parsed.tool_calls)

    async def _stream(
        self,
        req: ChatCompletionRequest,
        request_id: str,
        prep: ChatPrepared,
        streams: list[RequestStream],
    ) -> AsyncIterator[str]:
        """The SSE chunks of a chat stream, in OpenAI's order (role, deltas, tool calls, finish, usage).
        Long because the per-choice state and the release of the streams share one try/finally."""
        created = now_s()
        n = req.n
        finished = [False] * n
        completion_tokens = [0] * n
        readers = [prep.plan.reader(prep.prompt_text) for _ in range(n)]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        text_of = TokenText(self.tokenizer)
        num_logprobs = prep.num_logprobs
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
                "model": prep.model,
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
                    reader = readers[idx]
                    deltas = chat_deltas(reader.feed(c.text))
                    if c.finish_reason is not None:
                        deltas += chat_deltas(reader.finish())
                    if logprobs is not None and not deltas:
                        deltas = [{}]
                    for j, delta in enumerate(deltas):
                        yield chunk(idx, delta, None, logprobs if j == 0 else None)
                    if c.finish_reason is not None:
                        finished[idx] = True
                        yield chunk(idx, {}, prep.plan.finish_reason(c.finish_reason, reader.num_calls))
            if include_usage:
                total = sum(completion_tokens)
                yield sse(
                    {
                        "id": request_id,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": prep.model,
                        "choices": [],
                        "usage": usage_info(len(prep.prompt_ids), total, cached),
                    }
                )
        except Exception as exc:  # after the stream started: SSE error event
            yield sse_error(exc)
        finally:
            self.release_all(streams)
        yield SSE_DONE
