"""What the OpenAI-compatible API's bodies share (pydantic): the request base and the sampling fields of
completions and chat completions, the usage and error bodies, and the parsing of a request body, validated
once at the edge. Each API's own bodies are in its folder (``chat/protocol.py``, ``completions/``,
``embeddings/``, ``models/``, ``responses/``, ``batches/``).

The request and response models vLLM users import from ``vllm.entrypoints.openai.protocol`` are importable
from here too (``from pagedrs.entrypoints.openai.protocol import ChatCompletionRequest``), loaded from
their API's module on first use."""

from __future__ import annotations

import importlib
import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pagedrs.entrypoints.openai.errors import APIError, bad_request, from_validation_error

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


def as_prompts(x: list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """A non-empty list field of OpenAI's prompt shape: one token-id prompt, or a list of prompts."""
    if all(isinstance(t, int) for t in x):
        return [[int(t) for t in x if isinstance(t, int)]]
    return [t if isinstance(t, str) else list(t) for t in x if not isinstance(t, int)]


class ResponseBody(BaseModel):
    # A response body as /openapi.json documents it. Extra keys are allowed, so that fields other
    # endpoints add (tool calls, reasoning) do not make a documented body wrong.
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class ErrorDetail(ResponseBody):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseBody):
    """OpenAI's error shape, for every 4xx and 5xx."""

    error: ErrorDetail


class PromptTokensDetails(ResponseBody):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(ResponseBody):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


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


# The modules of each API's bodies, in the order a name is looked up (each lists its bodies in __all__).
API_PROTOCOLS = (
    "pagedrs.entrypoints.openai.chat.protocol",
    "pagedrs.entrypoints.openai.completions.protocol",
    "pagedrs.entrypoints.openai.embeddings.protocol",
    "pagedrs.entrypoints.openai.models.protocol",
    "pagedrs.entrypoints.openai.responses.protocol",
    "pagedrs.entrypoints.openai.batches.protocol",
)


def __getattr__(name: str) -> Any:
    """An API's body by name, as vLLM's protocol module has it, from the module that defines it (imported
    on first use: those modules import this one)."""
    if not name.startswith("__"):
        for module_name in API_PROTOCOLS:
            module = importlib.import_module(module_name)
            if name in getattr(module, "__all__", ()):
                return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_SEED",
    "APIError",
    "ErrorDetail",
    "ErrorResponse",
    "OpenAIModel",
    "PromptTokensDetails",
    "ResponseBody",
    "ResponseFormat",
    "SamplingFields",
    "StreamOptions",
    "TokenId",
    "UsageInfo",
    "as_prompts",
    "parse_body",
    "parse_json_object",
    "parse_request",
]
