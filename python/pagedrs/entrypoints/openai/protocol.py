"""Request models of the OpenAI-compatible API (pydantic), validated once at the edge."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pagedrs.entrypoints.openai.errors import APIError, bad_request, from_validation_error
from pagedrs.entrypoints.openai.protocol_tools import (
    ChatTool,
    MessageToolCall,
    ToolChoice,
    check_tools,
    template_tool_calls,
)

MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP = 16
MAX_SEED = 2**63 - 1

TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
# What a beam search cannot follow: it ranks the model's own logprobs, one token per round.
BEAM_SEARCH_UNSUPPORTED = (
    "stop",
    "stop_token_ids",
    "min_tokens",
    "logit_bias",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "tools",
)


class OpenAIModel(BaseModel):
    # Unknown fields are ignored (as vLLM does); NaN and infinities are rejected; no coercion
    # ("5" is not a number, "yes" not a bool), as JSON types are what the API documents.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True, protected_namespaces=())


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: str = Field("response", max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=2**31 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(None, max_length=1024)
    # Structured outputs: OpenAI's response_format, and vLLM's extra body fields.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's beam search: n beams (best_of on completions, when larger), ranked with length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops or None

    def check_common(self) -> None:
        """Cross-field checks pydantic's per-field constraints cannot express."""
        if self.logit_bias:
            for key in self.logit_bias:
                if not (key.isascii() and key.strip().isdigit()):
                    raise bad_request(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if self.top_k == 0:
            self.top_k = -1
        if self.use_beam_search:
            self.check_beam_search()

    def check_beam_search(self) -> None:
        """Fields beam search cannot honour are refused, not ignored."""
        for name in BEAM_SEARCH_UNSUPPORTED:
            if getattr(self, name, None):
                raise bad_request(f"{name} is not supported with use_beam_search", param=name)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1, le=2**31 - 1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    def check(self) -> None:
        self.check_common()
        if self.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if self.use_beam_search:
            if self.best_of is not None and self.best_of < self.n:
                raise bad_request(
                    f"best_of ({self.best_of}) must be at least n ({self.n}) with use_beam_search",
                    param="best_of",
                )
        elif self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported", param="best_of")
        prompts = self.prompts()
        if not prompts:
            raise bad_request("prompt must not be empty", param="prompt")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise bad_request(
                    "prompt must not be empty", param="prompt" if len(prompts) == 1 else f"prompt[{i}]"
                )
        if len(prompts) * self.n > 1024:
            raise bad_request("too many choices: len(prompt) * n must be at most 1024", param="n")

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (strings or token id lists)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        return _as_prompts(p)


class EmbeddingRequest(OpenAIModel):
    """OpenAI's /v1/embeddings body (and vLLM's extras: pooling_type, normalize)."""

    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=2**31 - 1)
    user: str | None = None
    pooling_type: Literal["last", "mean", "cls", "first"] | None = None
    normalize: bool | None = None

    def check(self) -> None:
        inputs = self.inputs()
        if not inputs:
            raise bad_request("input must not be empty", param="input")
        if len(inputs) > 2048:
            raise bad_request(f"at most 2048 inputs per request, got {len(inputs)}", param="input")
        for i, x in enumerate(inputs):
            if len(x) == 0:
                raise bad_request(
                    "input must not be empty", param="input" if len(inputs) == 1 else f"input[{i}]"
                )

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str):
            return [x]
        if not x:
            return []
        return _as_prompts(x)


def _as_prompts(x: list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """A non-empty list field of OpenAI's prompt shape: one token-id prompt, or a list of prompts."""
    if all(isinstance(t, int) for t in x):
        return [[int(t) for t in x if isinstance(t, int)]]
    return [t if isinstance(t, str) else list(t) for t in x if not isinstance(t, int)]


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result's call
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=4096)
    max_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    max_completion_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    def check(self) -> None:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        self.resolved_tool_choice()

    def resolved_tool_choice(self) -> str:
        """The tool choice: none, auto, required or the named function (400 if tools disagree)."""
        return check_tools(self.tools, self.tool_choice)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            msg: dict[str, Any] = {"role": role, "content": m.text()}
            if m.tool_calls:
                msg["tool_calls"] = template_tool_calls(m.tool_calls)
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
            out.append(msg)
        return out


class BatchCreateRequest(OpenAIModel):
    input_file_id: str = Field(..., min_length=1, max_length=256)
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = None


class LiquidScaleRequest(OpenAIModel):
    """POST /v1/admin/liquid: exactly one of ``target`` (active ranks) or ``liquid_type`` (a named move)."""

    target: int | None = Field(default=None, ge=1, le=1 << 16)  # a power of two the engine checks
    liquid_type: str | None = Field(default=None, max_length=64)


class FileUploadForm(BaseModel):
    """POST /v1/files as multipart/form-data (documents the form; the route reads it itself)."""

    file: bytes = Field(..., json_schema_extra={"format": "binary"})
    purpose: Literal["batch"]


M = TypeVar("M", bound=BaseModel)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Decodes a request body; 400 for invalid JSON or a body that is not an object."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"Invalid JSON body: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(
            f"The request body must be a JSON object, got {type(body).__name__}", code="invalid_body"
        )
    return body


def parse_request(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None


def parse_body(model: type[M], raw: bytes) -> M:
    req = parse_request(model, parse_json_object(raw))
    check = getattr(req, "check", None)
    if check is not None:
        check()
    return req


__all__ = [
    "APIError",
    "BatchCreateRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "EmbeddingRequest",
    "FileUploadForm",
    "LiquidScaleRequest",
    "StreamOptions",
    "parse_body",
    "parse_json_object",
    "parse_request",
]
