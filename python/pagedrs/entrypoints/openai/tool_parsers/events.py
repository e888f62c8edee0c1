"""What the output parsers emit, and the two things built from it: the non-streamed message and the
streamed chat deltas.

A parser (tool calls, reasoning) is one incremental state machine per format: it consumes text deltas
and emits events. The streamed response sends the events as they come; the non-streamed response runs
the same machine over the whole text and folds the events into one message. A parser's decisions depend
only on the text it has seen, never on where the deltas were cut, so both responses are the same.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    """A call's id and function name; always before its argument fragments."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolArgsDelta:
    index: int
    text: str


Event = ContentDelta | ReasoningDelta | ToolCallStart | ToolArgsDelta

IdFactory = Callable[[], str]


def new_call_id() -> str:
    """OpenAI's tool call id shape (``call_`` + 24 characters)."""
    return "call_" + secrets.token_hex(12)


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ParsedMessage:
    """The fold of a parser's events: what a non-streamed assistant message carries."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, events: Iterable[Event]) -> ParsedMessage:
        for ev in events:
            if isinstance(ev, ContentDelta):
                self.content += ev.text
            elif isinstance(ev, ReasoningDelta):
                self.reasoning += ev.text
            elif isinstance(ev, ToolCallStart):
                self.tool_calls.append(ToolCall(ev.id, ev.name))
            else:
                self.tool_calls[ev.index].arguments += ev.text
        return self

    def content_or_none(self) -> str | None:
        """OpenAI's message: `content` is null when the model only called tools."""
        if self.content == "" and self.tool_calls:
            return None
        return self.content


def chat_deltas(events: Iterable[Event]) -> list[dict[str, Any]]:
    """OpenAI's chat.completion.chunk `delta` objects for one step's events: adjacent text of the
    same kind is merged; a call's first delta carries its index, id, type and function name, later
    ones its index and an argument fragment."""
    out: list[dict[str, Any]] = []
    for ev in events:
        last = out[-1] if out else None
        if isinstance(ev, ContentDelta):
            if last is not None and set(last) == {"content"}:
                last["content"] += ev.text
            elif ev.text:
                out.append({"content": ev.text})
        elif isinstance(ev, ReasoningDelta):
            if last is not None and set(last) == {"reasoning_content"}:
                last["reasoning_content"] += ev.text
            elif ev.text:
                out.append({"reasoning_content": ev.text})
        elif isinstance(ev, ToolCallStart):
            call = {
                "index": ev.index,
                "id": ev.id,
                "type": "function",
                "function": {"name": ev.name, "arguments": ""},
            }
            out.append({"tool_calls": [call]})
        else:
            prev = last["tool_calls"][0] if last is not None and set(last) == {"tool_calls"} else None
            if prev is not None and prev["index"] == ev.index:
                prev["function"]["arguments"] += ev.text
            elif ev.text:
                out.append({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]})
    return out
