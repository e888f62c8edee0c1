"""An assistant reply as Anthropic content blocks, built from the output parsers' events.

The same `BlockWriter` serves both responses: a stream sends its events (`content_block_start`, `..._delta`,
`content_block_stop`) as they come; a non-streamed reply takes the blocks it has folded. So the two agree
for every output, as the chat endpoint's streamed and whole replies do (see `tool_parsers.events`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from pagedrs.entrypoints.openai.tool_parsers.events import (
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolArgsDelta,
    ToolCallStart,
)


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool_use block's `input`: the call's JSON arguments as an object ({} when they are not one)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class BlockWriter:
    """Content blocks in order: a new block starts when the kind of event changes (thinking, text, each
    tool call); empty text never opens a block."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open: tuple[str, int] | None = None  # (kind, tool call index) of the block being written
        self._args: list[str] = []  # per block: a tool_use block's arguments text
        self.num_tool_calls = 0

    def feed(self, events: Iterable[Event]) -> list[dict[str, Any]]:
        """The stream events for `events`, and the blocks updated."""
        out: list[dict[str, Any]] = []
        for ev in events:
            if isinstance(ev, (ContentDelta, ReasoningDelta)):
                if not ev.text:
                    continue
                kind = "text" if isinstance(ev, ContentDelta) else "thinking"
                if self._open is None or self._open[0] != kind:
                    out += self._start(
                        {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {})
                    )
                    self._open = (kind, -1)
                self.blocks[-1][kind] += ev.text
                delta = {"type": f"{kind}_delta", kind: ev.text}
                out.append({"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta})
            elif isinstance(ev, ToolCallStart):
                out += self._start({"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
                self._open = ("tool_use", ev.index)
                self.num_tool_calls += 1
            elif isinstance(ev, ToolArgsDelta) and ev.text:
                index = self._tool_block(ev.index)
                self._args[index] += ev.text
                delta = {"type": "input_json_delta", "partial_json": ev.text}
                out.append({"type": "content_block_delta", "index": index, "delta": delta})
        return out

    def close(self) -> list[dict[str, Any]]:
        """The last block's stop event (none when no block was written); tool inputs parsed."""
        for block, args in zip(self.blocks, self._args, strict=True):
            if block["type"] == "tool_use":
                block["input"] = tool_input(args)
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self.close() if self._open is not None else []
        self.blocks.append(block)
        self._args.append("")
        return out + [
            {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}
        ]

    def _tool_block(self, call_index: int) -> int:
        seen = -1
        for i, block in enumerate(self.blocks):
            if block["type"] == "tool_use":
                seen += 1
                if seen == call_index:
                    return i
        raise ValueError(f"arguments for tool call {call_index} before its start")


def stop_reason(
    finish_reason: str | None, engine_stop: int | str | None, stops: list[str], num_calls: int
) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for the engine's finish."""
    if num_calls:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(engine_stop, str) and engine_stop in stops:
        return "stop_sequence", engine_stop
    return "end_turn", None


__all__ = ["BlockWriter", "stop_reason", "tool_input"]
