"""The body of POST /v1/responses (OpenAI's Responses API) and its input items, as pydantic models;
`to_chat_messages` turns a conversation of input items into chat messages for the chat template."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from pagedrs.entrypoints.openai.errors import bad_request
from pagedrs.entrypoints.openai.protocol_tools import FUNCTION_NAME


class ResponsesModel(BaseModel):
    # Unknown fields ignored (OpenAI adds fields often), no coercion: as protocol.OpenAIModel.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True, protected_namespaces=())


class ContentPart(ResponsesModel):
    type: str
    text: str | None = None
    image_url: str | None = None  # an input_image part: a data:, http(s):// or file:// URL


class MessageItem(ResponsesModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    def text(self, where: str) -> str:
        if isinstance(self.content, str):
            return self.content
        out = []
        for i, part in enumerate(self.content):
            if part.type == "input_image":
                continue  # images go to the model as chat image parts (`chat_content`)
            if part.type not in ("input_text", "output_text", "text") or part.text is None:
                raise bad_request(
                    f"content parts of type {part.type!r} are not supported", param=f"{where}.content[{i}]"
                )
            out.append(part.text)
        return "".join(out)

    def chat_content(self, where: str) -> str | list[dict[str, Any]]:
        """The content as a chat message's: text, or (with `input_image` parts) text and image_url parts
        in order."""
        if isinstance(self.content, str) or all(p.type != "input_image" for p in self.content):
            return self.text(where)
        self.text(where)  # the other parts' checks
        parts: list[dict[str, Any]] = []
        for i, part in enumerate(self.content):
            if part.type != "input_image":
                parts.append({"type": "text", "text": part.text})
            elif not part.image_url:
                raise bad_request(
                    "an input_image part needs image_url (file_id is not supported)",
                    param=f"{where}.content[{i}].image_url",
                )
            else:
                parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
        return parts


class FunctionCallItem(ResponsesModel):
    type: Literal["function_call"]
    call_id: str = Field(..., min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(ResponsesModel):
    type: Literal["function_call_output"]
    call_id: str = Field(..., min_length=1)
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.text or "" for p in self.output)


class ReasoningItem(ResponsesModel):
    """A previous turn's reasoning: not given back to the model (as OpenAI's reasoning models)."""

    type: Literal["reasoning"]
    id: str | None = None


_ITEM_TAGS = {
    "message": "MessageItem",
    "function_call": "FunctionCallItem",
    "function_call_output": "FunctionCallOutputItem",
    "reasoning": "ReasoningItem",
}


def _item_tag(data: Any) -> str | None:
    kind = data.get("type") if isinstance(data, dict) else getattr(data, "type", None)
    return _ITEM_TAGS.get(kind) if isinstance(kind, str) else None


# Tagged by class name, so a 400's param names the item's field ("input[0].call_id"), not the tag.
InputItem = Annotated[
    Annotated[MessageItem, Tag("MessageItem")]
    | Annotated[FunctionCallItem, Tag("FunctionCallItem")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")]
    | Annotated[ReasoningItem, Tag("ReasoningItem")],
    Discriminator(_item_tag),
]


class FunctionTool(ResponsesModel):
    type: Literal["function"]
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(ResponsesModel):
    type: Literal["function"]
    name: str


class TextFormat(ResponsesModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(ResponsesModel):
    format: TextFormat = Field(default_factory=lambda: TextFormat.model_validate({"type": "text"}))


# OpenAI's values of `include`. Only the logprobs change what is returned here: the others add to item
# types this server never produces (search, code and computer calls, input images), and reasoning is
# kept in clear text, so there is nothing encrypted to add.
IncludeValue = Literal[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
]


class ResponsesRequest(ResponsesModel):
    model: str | None = None
    input: list[InputItem] | str  # the list first: its errors name the item (pydantic reports in this order)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)  # vLLM's extra
    include: list[IncludeValue] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # "disabled": a conversation longer than the context is a 400; "auto": its oldest items are dropped.
    truncation: Literal["auto", "disabled"] = "disabled"

    @model_validator(mode="before")
    @classmethod
    def _message_type(cls, data: Any) -> Any:
        """An input item with a role and no type is a message (OpenAI's easy input message)."""
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            items = [
                {**x, "type": "message"} if isinstance(x, dict) and "type" not in x and "role" in x else x
                for x in data["input"]
            ]
            data = {**data, "input": items}
        return data

    def check(self) -> None:
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise bad_request("input must not be empty", param="input")
        if self.background and not self.store:
            raise bad_request("background responses need store to be true", param="background")
        if self.background and self.stream:
            raise bad_request("background responses cannot be streamed here", param="stream")
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
            raise bad_request("text.format json_schema needs a schema", param="text.format.schema")

    @property
    def wants_logprobs(self) -> bool:
        return self.include is not None and "message.output_text.logprobs" in self.include

    def input_items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def chat_fields(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The equivalent /v1/chat/completions body (so one path checks and runs both)."""
        body: dict[str, Any] = {"messages": messages, "stream": self.stream}
        if self.model is not None:
            body["model"] = self.model
        for name in ("temperature", "top_p", "seed", "user"):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if self.wants_logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = self.top_logprobs or 0
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                for t in self.tools
            ]
            body["parallel_tool_calls"] = self.parallel_tool_calls
        if self.tool_choice is not None:
            choice = self.tool_choice
            body["tool_choice"] = (
                {"type": "function", "function": {"name": choice.name}}
                if isinstance(choice, FunctionChoice)
                else choice
            )
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict},
            }
        return body


def to_chat_messages(
    instructions: str | None,
    items: list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem],
) -> list[dict[str, Any]]:
    """Input items as chat messages: instructions first as a system message, consecutive function
    calls as one assistant message with tool_calls, each output as a `tool` message."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.chat_content(f"input[{i}]")})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    if not out:
        raise bad_request("input has no messages", param="input")
    return out


class ResponseObject(BaseModel):
    """OpenAI's response object, as /openapi.json documents what /v1/responses returns (the
    serving code builds it; extra keys allowed)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    previous_response_id: str | None = None
    background: bool = False
    store: bool = True


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool


class ResponseItemList(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


__all__ = [
    "ContentPart",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "FunctionChoice",
    "FunctionTool",
    "IncludeValue",
    "InputItem",
    "MessageItem",
    "ReasoningItem",
    "ResponseDeleted",
    "ResponseItemList",
    "ResponseObject",
    "ResponsesModel",
    "ResponsesRequest",
    "TextConfig",
    "TextFormat",
    "to_chat_messages",
]
