"""Anthropic Messages request bodies, and their translation to the chat request the engine path runs.

Shapes follow Anthropic's Messages API: `system` as text or text blocks, messages of `user` / `assistant`
turns whose content is text or a list of typed blocks (`text`, `tool_use`, `tool_result`, `thinking`),
`tools` with an `input_schema`, `tool_choice` of type auto / any / tool / none. Fields this server does not
use (`metadata`, `cache_control`, `service_tier`, ...) are accepted and ignored, as vLLM does.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagedrs.entrypoints.openai.chat.protocol import ChatCompletionRequest
from pagedrs.entrypoints.openai.errors import bad_request
from pagedrs.entrypoints.openai.protocol import parse_request


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True, protected_namespaces=())


class TextBlock(AnthropicModel):
    type: Literal["text"]
    text: str


class ImageBlock(AnthropicModel):
    type: Literal["image"]
    source: dict[str, Any]


class DocumentBlock(AnthropicModel):
    type: Literal["document"]
    source: dict[str, Any]


class ToolUseBlock(AnthropicModel):
    type: Literal["tool_use"]
    id: str = Field(..., min_length=1)
    name: str = Field(..., min_length=1)
    input: dict[str, Any]


class ToolResultBlock(AnthropicModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(..., min_length=1)
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content)


class ThinkingBlock(AnthropicModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(AnthropicModel):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock,
    Field(discriminator="type"),
]


BLOCK_TYPES = ("text", "image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking")


class Message(AnthropicModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: Any) -> Any:
        """An unknown block type is named (pydantic would report the `str` branch of the union)."""
        if isinstance(value, list):
            for j, block in enumerate(value):
                kind = block.get("type") if isinstance(block, dict) else None
                if kind not in BLOCK_TYPES:
                    raise ValueError(
                        f"content[{j}]: unknown content block type {kind!r}, expected one of {BLOCK_TYPES}"
                    )
        return value

    def blocks(self) -> list[Any]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class Tool(AnthropicModel):
    name: str = Field(..., min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom" or absent; server tools (web search, ...) are refused in check()


class ToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(AnthropicModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)


class OutputFormat(AnthropicModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(..., alias="schema")


class OutputConfig(AnthropicModel):
    """`output_config`: `format` (structured output, a JSON schema the reply follows, grammar-constrained);
    `effort` is accepted and ignored."""

    format: OutputFormat | None = None
    effort: str | None = None


class CountTokensRequest(AnthropicModel):
    """POST /v1/messages/count_tokens: the prompt part of a Messages request."""

    model: str | None = None
    messages: list[Message] = Field(..., min_length=1, max_length=4096)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    def check(self) -> None:
        for i, tool in enumerate(self.tools or []):
            if tool.type not in (None, "custom"):
                raise bad_request(
                    f"tools[{i}].type {tool.type!r}: only custom tools are served", f"tools[{i}].type"
                )
        choice = self.tool_choice
        if choice is not None and choice.type == "tool":
            names = {t.name for t in self.tools or []}
            if not choice.name or choice.name not in names:
                raise bad_request(
                    f"tool_choice.name {choice.name!r} names no tool in `tools`", param="tool_choice.name"
                )
        if choice is not None and choice.type in ("any", "tool") and not self.tools:
            raise bad_request(f"tool_choice {choice.type!r} needs `tools`", param="tool_choice")
        chat_messages(self)  # every block checked (400 naming it)

    def chat_request(self, **sampling: Any) -> ChatCompletionRequest:
        """The equivalent chat completion request (checked: a 400 names the offending field)."""
        body: dict[str, Any] = {"messages": chat_messages(self), **sampling}
        if self.model is not None:
            body["model"] = self.model
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description or "",
                        "parameters": t.input_schema,
                    },
                }
                for t in self.tools
            ]
            body |= _tool_choice(self.tool_choice)
        req = parse_request(ChatCompletionRequest, body)
        req.check()
        return req


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(..., ge=1, le=2**31 - 1)
    stop_sequences: list[str] | None = Field(None, max_length=64)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=2**31 - 1)
    stream: bool = False
    output_config: OutputConfig | None = None

    def check(self) -> None:
        super().check()
        if any(not s for s in self.stop_sequences or []):
            raise bad_request("stop_sequences may not contain an empty string", param="stop_sequences")

    def to_chat(self) -> ChatCompletionRequest:
        sampling: dict[str, Any] = {"max_tokens": self.max_tokens}
        if self.stop_sequences:
            sampling["stop"] = list(self.stop_sequences)
        for name in ("temperature", "top_p"):
            if getattr(self, name) is not None:
                sampling[name] = getattr(self, name)
        if self.top_k:  # Anthropic's 0 / absent: no top-k cut
            sampling["top_k"] = self.top_k
        if self.output_config is not None and self.output_config.format is not None:
            schema = self.output_config.format.schema_
            sampling["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": schema},
            }
        return self.chat_request(**sampling)


def _tool_choice(choice: ToolChoice | None) -> dict[str, Any]:
    """OpenAI's tool_choice (and parallel_tool_calls) for Anthropic's."""
    if choice is None:
        return {}
    mapped: Any = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
    if choice.type == "tool":
        mapped = {"type": "function", "function": {"name": choice.name}}
    return {"tool_choice": mapped, "parallel_tool_calls": not choice.disable_parallel_tool_use}


def _system_text(system: str | list[TextBlock] | None) -> str:
    if system is None:
        return ""
    return system if isinstance(system, str) else "".join(b.text for b in system)


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The chat messages of an Anthropic conversation: `system` first; an assistant turn's `tool_use`
    blocks become its tool calls; a user turn's `tool_result` blocks become tool messages (before the
    turn's text), each answering a `tool_use` of an earlier assistant turn (a 400 otherwise)."""
    out: list[dict[str, Any]] = []
    system = _system_text(req.system)
    if system:
        out.append({"role": "system", "content": system})
    calls: set[str] = set()
    for i, message in enumerate(req.messages):
        if message.role == "assistant":
            out.append(_assistant(message, i, calls))
        else:
            out += _user(message, i, calls)
    return out


def _refuse(block: Any, where: str) -> None:
    if isinstance(block, (ImageBlock, DocumentBlock)):
        raise bad_request(f"{where}: {block.type} blocks are not supported by this model", param=where)
    raise bad_request(f"{where}: a {block.type} block is not allowed in this turn", param=where)


def _assistant(message: Message, i: int, calls: set[str]) -> dict[str, Any]:
    text, tool_calls = "", []
    for j, block in enumerate(message.blocks()):
        if isinstance(block, TextBlock):
            text += block.text
        elif isinstance(block, ToolUseBlock):
            calls.add(block.id)
            arguments = json.dumps(block.input, ensure_ascii=False)
            tool_calls.append(
                {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}
            )
        elif not isinstance(
            block, (ThinkingBlock, RedactedThinkingBlock)
        ):  # earlier thinking is not replayed
            _refuse(block, f"messages[{i}].content[{j}]")
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def _user(message: Message, i: int, calls: set[str]) -> list[dict[str, Any]]:
    results, text = [], ""
    for j, block in enumerate(message.blocks()):
        where = f"messages[{i}].content[{j}]"
        if isinstance(block, TextBlock):
            text += block.text
        elif isinstance(block, ToolResultBlock):
            if block.tool_use_id not in calls:
                raise bad_request(
                    f"{where}: tool_result for tool_use_id {block.tool_use_id!r}, which no earlier "
                    "assistant tool_use block has",
                    param=f"{where}.tool_use_id",
                )
            content = ("Error: " if block.is_error else "") + block.text()
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        else:
            _refuse(block, where)
    return results + ([{"role": "user", "content": text}] if text or not results else [])


# ----------------------------------------------------------------------------- response bodies (documented)
class ResponseUsage(AnthropicModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessageResponse(AnthropicModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: ResponseUsage


class CountTokensResponse(AnthropicModel):
    input_tokens: int


class AnthropicErrorDetail(AnthropicModel):
    type: str
    message: str


class AnthropicErrorResponse(AnthropicModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


__all__ = [
    "AnthropicErrorResponse",
    "CountTokensRequest",
    "CountTokensResponse",
    "MessageResponse",
    "MessagesRequest",
    "chat_messages",
]
