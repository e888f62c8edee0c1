"""Tool calling in chat requests (OpenAI's shapes): function tools, `tool_choice`, the calls an
assistant message carries and `role: "tool"` results."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedrs.entrypoints.openai.errors import bad_request

FUNCTION_NAME = r"^[A-Za-z0-9_\-.]{1,64}$"  # OpenAI's rule for function names
MAX_TOOLS = 128


class ToolModel(BaseModel):
    # Unknown fields ignored (as vLLM does), no coercion: as protocol.OpenAIModel.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True, protected_namespaces=())


class FunctionDefinition(ToolModel):
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: any object
    strict: bool | None = None

    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object"}


class ChatTool(ToolModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(ToolModel):
    name: str = Field(..., min_length=1)


class NamedToolChoice(ToolModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(ToolModel):
    name: str
    arguments: str  # JSON text, as the model produced it


class MessageToolCall(ToolModel):
    """A call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def check_tools(
    tools: list[ChatTool] | None, tool_choice: ToolChoice | None
) -> Literal["none", "auto", "required"] | str:
    """The effective choice (a function's name for a named one), checked as OpenAI does: 400 for a
    choice without tools, or a named function that is not among them."""
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise bad_request("tool_choice is only allowed when tools are specified", param="tool_choice")
        return "none"
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}", param="tools")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", param="tools")
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, NamedToolChoice):
        if tool_choice.function.name not in names:
            raise bad_request(
                f"tool_choice names function `{tool_choice.function.name}`, which is not in tools",
                param="tool_choice",
            )
        return tool_choice.function.name
    return tool_choice


def template_tool_calls(calls: list[MessageToolCall]) -> list[dict[str, Any]]:
    """A history message's calls as chat templates read them: arguments as an object (Qwen2.5's and
    Llama 3.1's templates serialize them themselves), as vLLM passes them."""
    out = []
    for i, c in enumerate(calls):
        try:
            arguments: Any = json.loads(c.function.arguments) if c.function.arguments.strip() else {}
        except ValueError:
            raise bad_request(
                "tool call arguments must be JSON", param=f"tool_calls[{i}].function.arguments"
            ) from None
        out.append(
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": arguments}}
        )
    return out


def required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """`tool_choice: "required"` as vLLM constrains it: an array of at least one call object, each a
    tool's name and its parameters (at most one call without parallel_tool_calls)."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": t.function.parameters_schema(),
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_schema(tools: list[ChatTool], name: str) -> dict[str, Any]:
    """A named `tool_choice`: the reply is that function's arguments."""
    return next(t.function.parameters_schema() for t in tools if t.function.name == name)
