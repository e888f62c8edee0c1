"""What completions and chat completions share: model names, prompt checks, sampling params,
submitting to the engine, collecting outputs, streaming text deltas, client disconnects."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request

from pagedrs.engine.async_engine import AsyncLLMEngine, RequestStream
from pagedrs.engine.frontend.input_processor import InputError
from pagedrs.entrypoints.openai.error_mapping import to_api_error
from pagedrs.entrypoints.openai.errors import APIError, bad_request, not_found
from pagedrs.entrypoints.openai.protocol import SamplingFields
from pagedrs.lora_request import LoRARequest
from pagedrs.pooling_params import PoolingParams
from pagedrs.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("pagedrs.serving")

if TYPE_CHECKING:
    from pagedrs.entrypoints.openai.models.serving import ServingModels

T = TypeVar("T")

_INLINE_CHARS = 8192  # longer texts are tokenized off the event loop


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


def sse_error(exc: BaseException) -> str:
    err = exc if isinstance(exc, APIError) else to_api_error(exc)
    return sse(err.body())


SSE_DONE = "data: [DONE]\n\n"


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        served_model_names: Sequence[str],
        *,
        tokenizer: Any = None,
        models: ServingModels | None = None,
    ) -> None:
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.models = models  # the LoRA adapters served by name (None: the base model only)
        self.max_model_len = engine.max_model_len
        tok = tokenizer if tokenizer is not None else engine.get_tokenizer()
        # The server tokenizes on the event loop while the engine thread detokenizes: give the
        # server its own copy so the two never share a Rust tokenizer object.
        try:
            self.tokenizer = copy.deepcopy(tok)
        except Exception:  # fall back to sharing
            self.tokenizer = tok
        # The model's vocabulary (embedding rows) bounds token ids; the tokenizer's when unknown.
        self.vocab_size = int(engine.vocab_size or len(self.tokenizer))

    # ----------------------------------------------------------- checks
    def check_model(self, name: str | None) -> str:
        if name is None or name in self.served_model_names:
            return self.served_model_names[0]
        raise not_found(f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def resolve_model(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """(the model name a response reports, the LoRA adapter `name` selects or None), as vLLM's
        completions and chat take an adapter's name as `model`; 404 for an unknown name."""
        if self.models is None:
            return self.check_model(name), None
        return self.models.resolve(name)

    def tokenize(self, text: str) -> list[int]:
        try:
            return list(self.tokenizer.encode(text))
        except Exception as exc:  # undecodable input (lone surrogates, ...)
            raise bad_request(f"prompt cannot be tokenized: {exc}", param="prompt") from None

    async def offload(self, fn: Callable[..., T], *args: Any, size: int = 0) -> T:
        """Runs tokenizer work inline when small, in a worker thread when it could stall the loop."""
        if size < _INLINE_CHARS:
            return fn(*args)
        return await asyncio.to_thread(fn, *args)

    def sampling_params(
        self, req: SamplingFields, max_tokens: int | None, logprobs: int | None, stream: bool = False
    ) -> SamplingParams:
        """The request's sampling fields as SamplingParams (whose own checks name the field). What depends on
        the prompt or the model (token ids in range, prompt + max_tokens within max_model_len, None = what
        the context leaves, min_tokens <= max_tokens) is checked once, by the engine's InputProcessor, when
        the request is submitted."""
        kwargs: dict[str, Any] = {
            "n": req.n,
            "max_tokens": max_tokens,
            "min_tokens": req.min_tokens,
            "ignore_eos": req.ignore_eos,
            # streams read deltas (merged when the reader is slow); others only the final output
            "output_kind": RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        }
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "seed",
        ):
            value = getattr(req, name)
            if value is not None:
                kwargs[name] = value
        if req.stop:
            kwargs["stop"] = list(req.stop)
        if req.stop_token_ids:
            kwargs["stop_token_ids"] = list(req.stop_token_ids)
        if logprobs is not None:
            kwargs["logprobs"] = logprobs
        if req.logit_bias:
            kwargs["logit_bias"] = {int(k): float(v) for k, v in req.logit_bias.items()}
        structured = structured_outputs(req)
        if structured is not None:
            kwargs["structured_outputs"] = structured
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc), param=_param_in_message(str(exc), kwargs)) from None

    # ----------------------------------------------------------- engine
    async def submit(
        self,
        request_id: str,
        prompt_ids: list[int] | dict[str, Any],
        params: SamplingParams | PoolingParams,
        names: Mapping[str, str] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Hands the request to the engine, whose InputProcessor validates it; its InputError becomes a 400
        naming the field as this endpoint spells it (`names`: engine field -> request field, e.g.
        {"prompt": "messages"})."""
        try:
            return await self.engine.add_request(request_id, prompt_ids, params, lora_request=lora_request)
        except InputError as exc:
            param = (names or {}).get(exc.param, exc.param) if exc.param else None
            raise bad_request(str(exc), param=param, code=exc.code) from None
        except Exception as exc:  # mapped to an HTTP status
            raise to_api_error(exc) from None

    async def submit_all(
        self,
        base_id: str,
        prompts: Sequence[list[int] | dict[str, Any]],
        params: SamplingParams | PoolingParams,
        prompt_param: str = "prompt",
        names: Mapping[str, str] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestStream]:
        """One request per prompt (all aborted if one is refused); a refused prompt of several is named
        `prompt_param[i]`."""
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                where = prompt_param if len(prompts) == 1 else f"{prompt_param}[{i}]"
                fields = {"prompt": where, prompt_param: where, **(names or {})}
                streams.append(await self.submit(f"{base_id}-{i}", ids, params, fields, lora_request))
        except BaseException:
            self.release_all(streams)
            raise
        return streams

    def release_all(self, streams: Sequence[RequestStream]) -> None:
        for s in streams:
            self.engine.release(s)

    async def collect(self, streams: Sequence[RequestStream]) -> list[Any]:
        """The final output of each stream (raises APIError if one fails)."""

        async def last(stream: RequestStream) -> Any:
            final = None
            async for out in stream:
                final = out
            return final

        try:
            return list(await asyncio.gather(*(last(s) for s in streams)))
        except Exception as exc:
            raise to_api_error(exc) from None

    async def until_disconnect(self, raw_request: Request | None, work: Awaitable[T]) -> T:
        """Runs ``work``; cancels it (which aborts its requests) if the client disconnects."""
        task = asyncio.ensure_future(work)
        if raw_request is None:
            return await task
        watcher = asyncio.ensure_future(_wait_disconnect(raw_request))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            watcher.cancel()
        if task in done:
            return task.result()
        task.cancel()
        raise ClientDisconnected()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def structured_outputs(req: SamplingFields) -> Any:
    """The request's constraint (response_format or one of vLLM's guided_* fields) as
    StructuredOutputsParams, checked: 400 naming the field when invalid or when two are given."""
    from pagedrs.structured_outputs import StructuredOutputsParams

    given: list[tuple[str, dict[str, Any]]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request("response_format json_schema needs json_schema.schema", param="response_format")
        given.append(("response_format", {"json": rf.json_schema.schema_}))
    for field_name, kind in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(req, field_name)
        if value is not None:
            given.append((field_name, {kind: value}))
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(n for n, _ in given)
        raise bad_request(f"give one structured output constraint, got {names}", param=given[1][0])
    param, spec = given[0]
    try:
        params = StructuredOutputsParams(**spec)
        params.validate()
    except ValueError as exc:
        raise bad_request(str(exc), param=param) from None
    return params


def _param_in_message(message: str, kwargs: dict[str, Any]) -> str | None:
    """The field a SamplingParams error names: its messages start with it ("min_tokens must be ...")."""
    first = message.split(" ", 1)[0].rstrip(":,")
    if first in kwargs:
        return first
    return next((name for name in kwargs if re.search(rf"\b{re.escape(name)}\b", message)), None)


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """Yields (stream index, output) from several streams as outputs arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done_marker = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as exc:  # forwarded to the consumer
            await queue.put((i, exc))
        await queue.put((i, done_marker))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done_marker:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def now_s() -> int:
    return int(time.time())


def cached_tokens(outputs: Sequence[Any]) -> int:
    """Prompt tokens the prefix cache served, over the outputs' requests (``num_cached_tokens``)."""
    return sum(getattr(out, "num_cached_tokens", None) or 0 for out in outputs if out is not None)


def usage_info(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    """OpenAI's ``usage``, with ``prompt_tokens_details.cached_tokens`` from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


__all__ = [
    "ClientDisconnected",
    "OpenAIServing",
    "SSE_DONE",
    "cached_tokens",
    "merge_streams",
    "random_id",
    "sse",
    "sse_error",
    "usage_info",
]
