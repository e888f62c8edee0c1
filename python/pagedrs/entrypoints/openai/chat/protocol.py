"""/v1/chat/completions: the request body (pydantic, validated once at the edge) and the response bodies
/openapi.json documents."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from pagedrs.entrypoints.openai.errors import bad_request
from pagedrs.entrypoints.openai.protocol import (
    MAX_LOGPROBS,
    OpenAIModel,
    ResponseBody,
    SamplingFields,
    UsageInfo,
)
from pagedrs.entrypoints.openai.protocol_tools import (
    ChatTool,
    MessageToolCall,
    ToolChoice,
    check_tools,
    template_tool_calls,
)


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ImageURL(OpenAIModel):
    url: str = Field(..., min_length=1)  # data:, http(s):// or (with --allowed-local-media-path) file://
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(OpenAIModel):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result's call
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(isinstance(p, ImagePart) for p in self.content)

    def template_content(self) -> str | list[dict[str, Any]]:
        """The content as the chat template takes it: text, or (a message with images) the parts in order,
        for the model's processor template."""
        if not self.has_images():
            return self.text()
        assert isinstance(self.content, list)
        return [p.model_dump(exclude_none=True) for p in self.content]


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

    def has_images(self) -> bool:
        return any(m.has_images() for m in self.messages)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            msg: dict[str, Any] = {"role": role, "content": m.template_content()}
            if m.tool_calls:
                msg["tool_calls"] = template_tool_calls(m.tool_calls)
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
            out.append(msg)
        return out


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


__all__ = [
    "ChatCompletionChoice",
    "ChatCompletionMessage",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatFunctionCall",
    "ChatLogprobs",
    "ChatMessage",
    "ChatTokenLogprob",
    "ChatToolCall",
    "TextPart",
    "TopLogprob",
]
