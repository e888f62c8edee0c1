"""How a chat reply is read: the server's parser flags, a request's tool choice, and the parser
pipeline (reasoning, then tool calls) whose events build both the streamed and the non-streamed reply.

Tool choice `auto` (OpenAI's default) needs no flag, as in llama.cpp's server: it reads the call format
``--tool-call-parser`` names, else the one the chat template writes (`template_tool_format`), else the
generic format (`tool_parsers.generic`: the tools described in a system message and the reply held by
the grammar engine to calls or a message). `required` and a named function need no parser: the grammar
engine constrains the reply to a JSON array of calls / the function's arguments, so they always parse
and validate against the function's schema; `none` renders no tools and reads no calls. With `auto`, a
tool marked `strict` (hermes format) makes the grammar hold every call the model opens to its
function's schema, the text around the calls staying free (an xgrammar structural tag).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Protocol

from pagedrs.entrypoints.openai.errors import bad_request
from pagedrs.entrypoints.openai.protocol_tools import ChatTool, named_schema, required_schema
from pagedrs.entrypoints.openai.reasoning import REASONING_PARSERS, ReasoningParser
from pagedrs.entrypoints.openai.tool_parsers import (
    GENERIC,
    TOOL_PARSERS,
    ContentDelta,
    Event,
    GenericToolParser,
    IdFactory,
    NamedCallParser,
    RequiredCallsParser,
    ToolParser,
    template_tool_format,
)
from pagedrs.entrypoints.openai.tool_parsers.bare_json import BareJsonCalls
from pagedrs.entrypoints.openai.tool_parsers.generic import (
    generic_history,
    generic_schema,
    generic_system_prompt,
    with_system,
)
from pagedrs.entrypoints.openai.tool_parsers.hermes import strict_calls_grammar
from pagedrs.structured_outputs import StructuredOutputsParams

HERMES_NAMES = frozenset(name for name, cls in TOOL_PARSERS.items() if cls.name == "hermes")


class ParserArgs(Protocol):
    tool_call_parser: str | None
    enable_auto_tool_choice: bool
    reasoning_parser: str | None


@dataclass(frozen=True)
class OutputParsing:
    """The serve flags ``--tool-call-parser``, ``--enable-auto-tool-choice`` (accepted as vLLM's; `auto`
    works without it), ``--reasoning-parser``, and the tool format the chat template writes."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    template_format: str | None = None  # see with_template

    @property
    def auto_format(self) -> str:
        """The format `auto` reads: the flag's, else the template's, else the generic one."""
        return self.tool_call_parser or self.template_format or GENERIC

    def with_template(self, template: str | None) -> OutputParsing:
        """These flags for a model whose chat template is `template` (its tool format detected)."""
        return replace(self, template_format=template_tool_format(template))

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"--tool-call-parser must be one of {sorted(TOOL_PARSERS)}, got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"--reasoning-parser must be one of {sorted(REASONING_PARSERS)}, got {self.reasoning_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")

    @classmethod
    def from_args(cls, args: object) -> OutputParsing:
        return cls(
            tool_call_parser=getattr(args, "tool_call_parser", None),
            enable_auto_tool_choice=bool(getattr(args, "enable_auto_tool_choice", False)),
            reasoning_parser=getattr(args, "reasoning_parser", None),
        )

    def plan(self, tools: list[ChatTool] | None, choice: str, parallel_tool_calls: bool = True) -> ReplyPlan:
        """A request's plan."""
        tools = list(tools or [])
        return ReplyPlan(self, tools if choice != "none" else [], choice, parallel_tool_calls)


@dataclass(frozen=True)
class ReplyPlan:
    parsing: OutputParsing
    tools: list[ChatTool]  # what the chat template is given
    choice: str  # "none", "auto", "required" or a function's name
    parallel_tool_calls: bool = True

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    @property
    def named(self) -> str | None:
        return self.choice if self.forced and self.choice != "required" else None

    @property
    def generic(self) -> bool:
        """The chat template knows no tool format (and no flag names one): the generic format."""
        return self.parsing.auto_format == GENERIC

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools or self.generic:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def chat_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages the chat template renders: in the generic format, the tool turns of the history
        as text and the tools described in the system message."""
        if not self.generic:
            return messages
        messages = generic_history(messages)
        if not self.tools:
            return messages
        tools = [t.function.model_dump(exclude_none=True) for t in self.tools]
        return with_system(messages, generic_system_prompt(tools, auto=self.choice == "auto"))

    def keeps_special_tokens(self) -> bool:
        """The mistral format's marker is a special token: keep it in the text."""
        cls = TOOL_PARSERS.get(self.parsing.auto_format)
        return self.choice == "auto" and bool(getattr(cls, "keeps_special_tokens", False))

    def constraint(
        self, requested: StructuredOutputsParams | None, prompt_text: str, param: str = "response_format"
    ) -> StructuredOutputsParams | None:
        """The grammar for the reply: a forced tool choice's schema, else the request's own; after the
        reasoning block when a reasoning parser is on."""
        if self.forced:
            if requested is not None:
                raise bad_request(
                    f"tool_choice {self.choice!r} cannot be combined with {param}", param="tool_choice"
                )
            schema = (
                named_schema(self.tools, self.choice)
                if self.named is not None
                else required_schema(self.tools, self.parallel_tool_calls)
            )
            requested = StructuredOutputsParams(json=schema)
            try:
                requested.validate()
            except ValueError as exc:
                raise bad_request(
                    f"tool parameters are not a usable JSON schema: {exc}", param="tools"
                ) from None
        elif self.choice == "auto" and self.tools and self.generic:
            requested = self._generic_reply(requested, param)
        elif requested is None and self.strict_auto():
            requested = self._strict_calls()
        reasoning = self.reasoning(prompt_text)
        if reasoning is None or requested is None:
            return requested
        return reasoning.after_reasoning(requested, prompt_text)

    def strict_auto(self) -> bool:
        """`auto` with a tool marked `strict` (OpenAI: its arguments must follow its schema), in the
        hermes format: the grammar holds each call the model opens to its function's schema."""
        return (
            self.choice == "auto"
            and any(t.function.strict for t in self.tools)
            and self.parsing.auto_format in HERMES_NAMES
        )

    def _generic_reply(
        self, requested: StructuredOutputsParams | None, param: str
    ) -> StructuredOutputsParams:
        """The generic format's grammar: calls, or a response (following the request's own JSON schema
        when it has one, as llama.cpp's generic handler)."""
        response: dict[str, Any] | None = None
        if requested is not None:
            if requested.json is not None:
                response = json.loads(requested.json) if isinstance(requested.json, str) else requested.json
            elif requested.json_object:
                response = {"type": "object"}
            else:
                raise bad_request(
                    f"tool_choice 'auto' with tools cannot be combined with a {requested.kind} {param} "
                    "on a model whose chat template has no tool format",
                    param="tool_choice",
                )
        tools = [(t.function.name, t.function.parameters_schema()) for t in self.tools]
        # as text: the grammar keeps the keys in this order ("name" first, so a call streams at once)
        schema = json.dumps(generic_schema(tools, self.parallel_tool_calls, response))
        out = StructuredOutputsParams(json=schema)
        try:
            out.validate()
        except ValueError as exc:
            raise bad_request(f"tool parameters are not a usable JSON schema: {exc}", param="tools") from None
        return out

    def _strict_calls(self) -> StructuredOutputsParams:
        tools = [
            (t.function.name, t.function.parameters_schema() if t.function.strict else {"type": "object"})
            for t in self.tools
        ]
        try:
            return StructuredOutputsParams(grammar=strict_calls_grammar(tools, self.parallel_tool_calls))
        except (RuntimeError, ValueError) as exc:
            raise bad_request(f"tool parameters are not a usable JSON schema: {exc}", param="tools") from None

    def reasoning(self, prompt_text: str = "") -> ReasoningParser | None:
        name = self.parsing.reasoning_parser
        return REASONING_PARSERS[name](prompt_text) if name is not None else None

    def tool_parser(self, new_id: IdFactory | None = None) -> ToolParser | None:
        max_calls = None if self.parallel_tool_calls else 1
        if self.named is not None:
            return NamedCallParser(self.named, new_id)
        if self.choice == "required":
            return RequiredCallsParser(new_id, max_calls)
        if self.choice == "auto" and self.tools:
            if self.generic:
                return GenericToolParser(new_id, max_calls)
            inner = TOOL_PARSERS[self.parsing.auto_format](new_id, max_calls)
            names = frozenset(t.function.name for t in self.tools)
            return BareJsonCalls(inner, names, new_id, max_calls)  # small models' bare JSON calls too
        return None

    def reader(self, prompt_text: str, new_id: IdFactory | None = None) -> ReplyReader:
        return ReplyReader(self.reasoning(prompt_text), self.tool_parser(new_id))

    def finish_reason(self, engine_reason: str | None, num_calls: int) -> str | None:
        """OpenAI's: "tool_calls" when the model called tools and stopped by itself; a named choice
        keeps "stop" (as OpenAI and vLLM)."""
        if engine_reason == "stop" and num_calls and self.named is None:
            return "tool_calls"
        return engine_reason


class ReplyReader:
    """Reasoning parser, then tool-call parser, over one reply's text deltas."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    @property
    def num_calls(self) -> int:
        return self._tools.num_calls if self._tools is not None else 0

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = (
            self._reasoning.feed(text) if self._reasoning is not None else [ContentDelta(text)]
        )
        return self._to_tools(events)

    def finish(self) -> list[Event]:
        events = self._reasoning.finish() if self._reasoning is not None else []
        out = self._to_tools(events)
        if self._tools is not None:
            out += self._tools.finish()
        return out

    def _to_tools(self, events: list[Event]) -> list[Event]:
        if self._tools is None:
            return [e for e in events if not isinstance(e, ContentDelta) or e.text]
        out: list[Event] = []
        for e in events:
            out += self._tools.feed(e.text) if isinstance(e, ContentDelta) else [e]
        return out
