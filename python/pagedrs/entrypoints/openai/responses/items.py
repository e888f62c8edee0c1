"""A reply's parser events as Responses output items, and the stream events that build them.

One `OutputItems` consumes the same events (`tool_parsers.events`) for a stream and for a whole
reply: a stream sends the Responses events it returns (OpenAI's response.output_item.added,
response.content_part.added, response.output_text.delta, ... response.output_item.done), a
non-streamed response keeps only `items`; both end with the same items.

Logprobs (`include: ["message.output_text.logprobs"]`) are given by token with `add_logprobs` and go to
the next text delta of the message; any left when the reply ends (tokens whose text was held back, or
that came after the message's last text) go to the message at `close`. So a message's logprobs are
those of every sampled token of the reply, reasoning and tool-call tokens included (vLLM's rule), the
same whether streamed or not; `response.output_text.done` carries them all.
"""

from __future__ import annotations

import copy
import secrets
from typing import Any

from pagedrs.entrypoints.openai.tool_parsers import (
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolArgsDelta,
    ToolCallStart,
)

StreamEvent = dict[str, Any]


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class OutputItems:
    def __init__(self, logprobs: bool = False) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: int | None = None  # the output index of the item still growing
        self._calls: dict[int, int] = {}  # parser call index -> output index
        self._logprobs = logprobs
        self._pending: list[dict[str, Any]] = []  # token logprobs not yet given to a text delta

    def add_logprobs(self, entries: list[dict[str, Any]]) -> None:
        """Token logprobs ({token, logprob, bytes, top_logprobs}, as chat's) of the tokens fed next."""
        if self._logprobs:
            self._pending += entries

    def add(self, events: list[Event]) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        for ev in events:
            if isinstance(ev, ReasoningDelta):
                index = self._ensure("reasoning", out)
                self.items[index]["content"][0]["text"] += ev.text
                out.append(
                    {
                        "type": "response.reasoning_text.delta",
                        "item_id": self.items[index]["id"],
                        "output_index": index,
                        "content_index": 0,
                        "delta": ev.text,
                    }
                )
            elif isinstance(ev, ContentDelta):
                index = self._ensure("message", out)
                part = self.items[index]["content"][0]
                part["text"] += ev.text
                logprobs, self._pending = self._pending, []
                part["logprobs"] += logprobs
                out.append(
                    {
                        "type": "response.output_text.delta",
                        "item_id": self.items[index]["id"],
                        "output_index": index,
                        "content_index": 0,
                        "delta": ev.text,
                        "logprobs": copy.deepcopy(logprobs),
                    }
                )
            elif isinstance(ev, ToolCallStart):
                out += self._close()
                item = {
                    "type": "function_call",
                    "id": item_id("fc"),
                    "call_id": ev.id,
                    "name": ev.name,
                    "arguments": "",
                    "status": "in_progress",
                }
                out += self._open_item(item)
                self._calls[ev.index] = len(self.items) - 1
            elif isinstance(ev, ToolArgsDelta):
                index = self._calls[ev.index]
                self.items[index]["arguments"] += ev.text
                out.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": self.items[index]["id"],
                        "output_index": index,
                        "delta": ev.text,
                    }
                )
        return out

    def close(self, status: str = "completed") -> list[StreamEvent]:
        """Ends the growing item (`status`: "completed", or "incomplete" when the reply was cut); the
        logprobs still pending go to the reply's last message."""
        messages = [item for item in self.items if item["type"] == "message"]
        if self._pending and messages:
            messages[-1]["content"][0]["logprobs"] += self._pending
        self._pending = []
        return self._close(status)

    def _ensure(self, kind: str, out: list[StreamEvent]) -> int:
        if self._open is not None and self.items[self._open]["type"] == kind:
            return self._open
        out += self._close()
        if kind == "message":
            item: dict[str, Any] = {
                "type": "message",
                "id": item_id("msg"),
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {
                "type": "reasoning",
                "id": item_id("rs"),
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            part = {"type": "reasoning_text", "text": ""}
        out += self._open_item(item)
        index = len(self.items) - 1
        item["content"].append(part)
        out.append(
            {
                "type": "response.content_part.added",
                "item_id": item["id"],
                "output_index": index,
                "content_index": 0,
                "part": copy.deepcopy(part),
            }
        )
        return index

    def _open_item(self, item: dict[str, Any]) -> list[StreamEvent]:
        self.items.append(item)
        self._open = len(self.items) - 1
        return [
            {"type": "response.output_item.added", "output_index": self._open, "item": copy.deepcopy(item)}
        ]

    def _close(self, status: str = "completed") -> list[StreamEvent]:
        index, self._open = self._open, None
        if index is None:
            return []
        item = self.items[index]
        item["status"] = status
        out: list[StreamEvent] = []
        ref = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            out.append(
                {"type": "response.function_call_arguments.done", **ref, "arguments": item["arguments"]}
            )
        else:
            part = item["content"][0]
            done = (
                "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            )
            extra: dict[str, Any] = (
                {"logprobs": copy.deepcopy(part["logprobs"])} if item["type"] == "message" else {}
            )
            out.append({"type": done, **ref, "content_index": 0, "text": part["text"], **extra})
            out.append(
                {"type": "response.content_part.done", **ref, "content_index": 0, "part": copy.deepcopy(part)}
            )
        out.append({"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)})
        return out


def output_as_input(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as input items of the next turn (`previous_response_id`)."""
    out: list[dict[str, Any]] = []
    for item in items:
        if item["type"] == "message":
            text = "".join(p.get("text", "") for p in item["content"])
            out.append({"type": "message", "role": "assistant", "content": text})
        elif item["type"] == "function_call":
            out.append(
                {
                    "type": "function_call",
                    "call_id": item["call_id"],
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
    return out
