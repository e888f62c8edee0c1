"""Response bodies of the OpenAI-compatible API (pydantic), as /openapi.json documents them; the request
bodies are in protocol.py. Extra keys are allowed, so that fields other endpoints add (tool calls,
reasoning) do not make a documented body wrong."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class ResponseBody(BaseModel):
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


class CompletionLogprobs(ResponseBody):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(ResponseBody):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(ResponseBody):
    """A /v1/completions body; each SSE event of a stream is one of these with the new text."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(ResponseBody):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(ResponseBody):
    content: list[ChatTokenLogprob] | None = None


class ChatFunctionCall(ResponseBody):
    name: str
    arguments: str  # JSON text


class ChatToolCall(ResponseBody):
    id: str
    type: Literal["function"]
    function: ChatFunctionCall


class ChatCompletionMessage(ResponseBody):
    role: Literal["assistant"]
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser
    tool_calls: list[ChatToolCall] | None = None


class ChatCompletionChoice(ResponseBody):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(ResponseBody):
    """A /v1/chat/completions body (a stream sends chat.completion.chunk events instead)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None


class EmbeddingData(ResponseBody):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # a base64 string with encoding_format "base64"


class EmbeddingResponse(ResponseBody):
    object: Literal["list"]
    id: str
    data: list[EmbeddingData]
    model: str
    usage: UsageInfo


class ModelCard(ResponseBody):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseBody):
    object: Literal["list"]
    data: list[ModelCard]


class FileObject(ResponseBody):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str | None = None
    status_details: str | None = None


class FileList(ResponseBody):
    object: Literal["list"]
    data: list[FileObject]
    has_more: bool = False


class FileDeleted(ResponseBody):
    id: str
    object: Literal["file"]
    deleted: bool


class BatchRequestCounts(ResponseBody):
    total: int
    completed: int
    failed: int


class BatchErrors(ResponseBody):
    object: Literal["list"]
    data: list[dict[str, Any]]


class BatchObject(ResponseBody):
    id: str
    object: Literal["batch"]
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts
    metadata: dict[str, str] | None = None


class BatchList(ResponseBody):
    object: Literal["list"]
    data: list[BatchObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


class LiquidScaleResponse(ResponseBody):
    object: Literal["liquid.result"]
    degree: int
    events: list[dict[str, Any]]


class VersionResponse(ResponseBody):
    version: str


__all__ = [
    "BatchErrors",
    "BatchList",
    "BatchObject",
    "BatchRequestCounts",
    "ChatCompletionChoice",
    "ChatCompletionMessage",
    "ChatCompletionResponse",
    "ChatLogprobs",
    "ChatTokenLogprob",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionResponse",
    "EmbeddingData",
    "EmbeddingResponse",
    "ErrorDetail",
    "ErrorResponse",
    "FileDeleted",
    "FileList",
    "FileObject",
    "LiquidScaleResponse",
    "ModelCard",
    "ModelList",
    "PromptTokensDetails",
    "ResponseBody",
    "TopLogprob",
    "UsageInfo",
    "VersionResponse",
]
