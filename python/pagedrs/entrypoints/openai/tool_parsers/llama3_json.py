"""Llama 3.1/3.2 JSON tool calls: the reply is ``{"name": "f", "parameters": {...}}`` (optionally after
``<|python_tag|>``), several separated by ``;`` (vLLM's llama3_json parser). A reply that does not
start with a call is text."""

from __future__ import annotations

from pagedrs.entrypoints.openai.tool_parsers.base import ToolParser
from pagedrs.entrypoints.openai.tool_parsers.events import IdFactory
from pagedrs.entrypoints.openai.tool_parsers.json_calls import JsonCallReader, Status

PYTHON_TAG = "<|python_tag|>"
_WS = " \t\r\n"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self, new_id: IdFactory | None = None, max_calls: int | None = None) -> None:
        super().__init__(new_id, max_calls)
        self._state = "start"
        self._lead = ""  # text before the first call, given back if there is none
        self._reader: JsonCallReader | None = None

    def _advance(self, final: bool) -> bool:
        if self._state == "start":
            body = self._buf.lstrip(_WS)
            if not body and not final:
                return False
            if body.startswith(PYTHON_TAG) and not self._lead:
                self._lead = self._consume(len(self._buf) - len(body) + len(PYTHON_TAG))
                return True
            if not final and not self._lead and PYTHON_TAG.startswith(body):
                return False
            self._lead += self._consume(len(self._buf) - len(body))
            self._state = "call" if body.startswith("{") else "text"
            if self._state == "text":
                self._content(self._lead)
            self._reader = JsonCallReader(self)
            return True
        if self._state == "call":
            assert self._reader is not None
            status = self._reader.advance(final)
            if status is Status.MORE:
                return False
            if status is Status.FAIL:
                self._content(self._lead + self._reader.raw)
                self._state = "text"
            else:
                self._lead = ""
                self._state = "sep"
            return True
        if self._state == "sep":
            body = self._buf.lstrip(_WS)
            if not body and not final:
                return False
            if body.startswith(";"):
                self._lead = self._consume(len(self._buf) - len(body) + 1)
                self._reader = JsonCallReader(self)
                self._state = "call"
                return True
            self._state = "text"
            return True
        self._content(self._consume(len(self._buf)))
        return False
