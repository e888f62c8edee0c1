"""Hermes / Qwen2.5 tool calls: ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, any
number of them, with text around (vLLM's hermes parser)."""

from __future__ import annotations

import json
from typing import Any

from pagedrs.entrypoints.openai.tool_parsers.base import ToolParser, held_prefix
from pagedrs.entrypoints.openai.tool_parsers.events import IdFactory
from pagedrs.entrypoints.openai.tool_parsers.json_calls import JsonCallReader, Status

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self, new_id: IdFactory | None = None, max_calls: int | None = None) -> None:
        super().__init__(new_id, max_calls)
        self._state = "content"
        self._reader: JsonCallReader | None = None

    def _advance(self, final: bool) -> bool:
        if self._state == "content":
            i = self._buf.find(START)
            if i < 0:
                keep = 0 if final else held_prefix(self._buf, START)
                self._content(self._consume(len(self._buf) - keep))
                return False
            self._content(self._consume(i))
            self._consume(len(START))
            self._reader = JsonCallReader(self)
            self._state = "call"
            return True
        if self._state == "call":
            assert self._reader is not None
            status = self._reader.advance(final)
            if status is Status.MORE:
                return False
            if status is Status.FAIL:  # not a call: the tag and what followed are text
                self._content(START + self._reader.raw)
            self._state = "content" if status is Status.FAIL else "close"
            return True
        # "close": the call's closing tag, if it is there
        body = self._buf.lstrip(" \t\r\n")
        if body.startswith(END):
            self._consume(len(self._buf) - len(body) + len(END))
        elif not final and (not body or END.startswith(body)):
            return False
        self._state = "content"
        return True


def strict_calls_grammar(tools: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
    """For `tool_choice` auto with `strict` tools: free text until the model opens ``<tool_call>``,
    then a call in this parser's format whose arguments follow the named function's schema (an
    xgrammar structural tag, as EBNF). `tools`: (name, parameters schema) of every tool."""
    import xgrammar as xgr

    tags = [
        {
            "type": "tag",
            "begin": f'{START}\n{{"name": {json.dumps(name)}, "arguments": ',
            "content": {"type": "json_schema", "json_schema": schema},
            "end": f"}}\n{END}",
        }
        for name, schema in tools
    ]
    fmt = {"type": "triggered_tags", "triggers": [START], "tags": tags, "stop_after_first": not parallel}
    return str(xgr.Grammar.from_structural_tag({"type": "structural_tag", "format": fmt}))
