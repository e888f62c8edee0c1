"""Tool calls as small models make them: a reply that is a bare JSON call object, or a list of them,
instead of the chat template's markup (Qwen2.5-Coder-0.5B answers a tools request with
``{"name": "get_weather", "arguments": {"city": "Paris"}}`` rather than ``<tool_call>...</tool_call>``).

`BareJsonCalls` wraps the template's parser. At the start of the reply's content (after any reasoning,
so a call right after ``</think>`` counts) it holds the text while it may still be such an object: optional
whitespace and a Markdown ```json fence, then a JSON value. When the value is complete and every object in
it names an offered tool with an object of `arguments` (or `parameters`), those are the calls; anything
else (plain text, JSON that names no offered tool) goes to the wrapped parser unchanged, so text never
becomes a call when no tool matches. The decision depends only on the text, not on where the stream was
cut, so the streamed and the whole reply agree.
"""

from __future__ import annotations

import json
from typing import Any

from pagedrs.entrypoints.openai.tool_parsers.base import ToolParser
from pagedrs.entrypoints.openai.tool_parsers.events import (
    Event,
    IdFactory,
    ToolArgsDelta,
    ToolCallStart,
    new_call_id,
)
from pagedrs.entrypoints.openai.tool_parsers.json_calls import ARGS_KEYS, ValueScanner

_WS = " \t\r\n"
FENCE = "```"


def bare_calls(value: Any, tool_names: frozenset[str]) -> list[tuple[str, dict[str, Any]]] | None:
    """(name, arguments) of each call `value` holds, or None unless every object is a call of an
    offered tool with object arguments."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in tool_names:
            return None
        keys = [k for k in ARGS_KEYS if k in item]
        args = item[keys[0]] if keys else {}
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict) or set(item) - {"name", "type", "id", *ARGS_KEYS}:
            return None
        calls.append((str(item["name"]), args))
    return calls or None


class BareJsonCalls(ToolParser):
    name = "bare_json"

    def __init__(
        self,
        inner: ToolParser,
        tool_names: frozenset[str],
        new_id: IdFactory | None = None,
        max_calls: int | None = None,
    ) -> None:
        super().__init__(new_id or new_call_id, max_calls)
        self._inner = inner
        self._names = tool_names
        self._held = ""  # the text held while it may be a bare call
        self._scanner: ValueScanner | None = None
        self._start = -1  # where the JSON value starts in `_held`
        self._scanned = 0
        self._end = -1  # where it ends, once the scanner found it
        self._deciding = True
        self._num_bare = 0
        self._after_bare = False  # whitespace right after the bare calls is not content

    def feed(self, text: str) -> list[Event]:
        if not self._deciding:
            return self._counted(self._rest(text))
        self._held += text
        return self._counted(self._decide(final=False))

    def finish(self) -> list[Event]:
        out = self._decide(final=True) if self._deciding else []
        return self._counted(out + self._pass(self._inner.finish()))

    def _counted(self, events: list[Event]) -> list[Event]:
        self.num_calls = self._num_bare + self._inner.num_calls  # bare calls, then the template's
        return events

    def _advance(self, final: bool) -> bool:  # feed/finish above do the work
        return False

    def _decide(self, final: bool) -> list[Event]:
        held = self._held
        if self._start < 0:
            body = held.lstrip(_WS)
            if body.startswith(FENCE):
                newline = body.find("\n")
                if newline < 0:
                    return self._give_up() if final else []
                fenced = body[newline + 1 :].lstrip(_WS)
                if fenced and fenced[0] in "{[":
                    self._start = len(held) - len(fenced)
                elif fenced or final:
                    return self._give_up()
                else:
                    return []
            elif body and body[0] in "{[":
                self._start = len(held) - len(body)
            elif not final and FENCE.startswith(body):
                return []  # nothing yet, or a fence that may be completing
            elif body or final:
                return self._give_up()
            else:
                return []
            self._scanner = ValueScanner(held[self._start])
            self._scanned = self._start
        assert self._scanner is not None
        if self._end < 0:
            found = self._scanner.scan(held[self._scanned :])
            if found is None:
                self._scanned = len(held)
                return self._give_up() if final else []
            self._end = found + self._scanned
        end = self._end
        try:
            calls = bare_calls(json.loads(held[self._start : end]), self._names)
        except json.JSONDecodeError:
            calls = None
        if calls is None:
            return self._give_up()
        rest = held[end:]
        if held[: self._start].lstrip(_WS).startswith(FENCE):
            closing = rest.lstrip(_WS)
            if closing.startswith(FENCE):
                rest = closing[len(FENCE) :]
            elif not final and FENCE.startswith(closing):
                return []  # the closing fence may be completing
        out: list[Event] = []
        for name, args in calls:
            index = self._num_bare
            self._num_bare += 1
            if self._emits(index):
                out.append(ToolCallStart(index, self._new_id(), name))
                out.append(ToolArgsDelta(index, json.dumps(args, ensure_ascii=False)))
        self._deciding = False
        self._held = ""
        self._after_bare = True
        return out + self._rest(rest)

    def _rest(self, text: str) -> list[Event]:
        """Text after the decision, to the template's parser (whitespace right after bare calls dropped)."""
        if self._after_bare:
            text = text.lstrip(_WS)
            self._after_bare = not text
        return self._pass(self._inner.feed(text)) if text else []

    def _give_up(self) -> list[Event]:
        """Not a bare call: everything held goes to the template's parser."""
        self._deciding = False
        held, self._held = self._held, ""
        return self._pass(self._inner.feed(held))

    def _pass(self, events: list[Event]) -> list[Event]:
        """The wrapped parser's events, its call indices after the bare calls'."""
        if not self._num_bare:
            return events
        out: list[Event] = []
        for ev in events:
            if isinstance(ev, ToolCallStart):
                index = ev.index + self._num_bare
                if self._emits(index):
                    out.append(ToolCallStart(index, ev.id, ev.name))
            elif isinstance(ev, ToolArgsDelta):
                index = ev.index + self._num_bare
                if self._emits(index):
                    out.append(ToolArgsDelta(index, ev.text))
            else:
                out.append(ev)
        return out


__all__ = ["BareJsonCalls", "bare_calls"]
