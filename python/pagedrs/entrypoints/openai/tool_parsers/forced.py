"""Readers for the grammar-constrained outputs of `tool_choice` `required` and a named function (the
schemas vLLM uses): `required` is a JSON array of ``{"name": ..., "parameters": {...}}``; a named
choice is the function's arguments object itself."""

from __future__ import annotations

from pagedrs.entrypoints.openai.tool_parsers.base import ToolParser
from pagedrs.entrypoints.openai.tool_parsers.events import IdFactory
from pagedrs.entrypoints.openai.tool_parsers.json_calls import JsonCallReader, Status

_WS = " \t\r\n"


class NamedCallParser(ToolParser):
    """The whole reply is the arguments of `function_name`."""

    name = "named"

    def __init__(self, function_name: str, new_id: IdFactory | None = None) -> None:
        super().__init__(new_id, None)
        self._function = function_name

    def _advance(self, final: bool) -> bool:
        if self.num_calls == 0:
            self._start_call(self._function)
        self._args(self._consume(len(self._buf)))
        return False


class RequiredCallsParser(ToolParser):
    """A JSON array of call objects; anything else is text."""

    name = "required"

    def __init__(self, new_id: IdFactory | None = None, max_calls: int | None = None) -> None:
        super().__init__(new_id, max_calls)
        self._state = "open"
        self._reader: JsonCallReader | None = None
        self._raw = ""

    def _advance(self, final: bool) -> bool:
        body = self._buf.lstrip(_WS)
        if self._state in ("open", "sep") and not body and not final:
            return False
        if self._state == "open":
            self._raw = self._consume(len(self._buf) - len(body))
            if not body.startswith("["):
                self._state = "text"
                self._content(self._raw)
                return True
            self._raw += self._consume(1)
            self._reader = JsonCallReader(self)
            self._state = "item"
            return True
        if self._state == "item":
            assert self._reader is not None
            status = self._reader.advance(final)
            if status is Status.MORE:
                return False
            if status is Status.FAIL:
                self._content(self._raw + self._reader.raw)
                self._state = "text"
            else:
                self._raw = ""
                self._state = "sep"
            return True
        if self._state == "sep":
            self._consume(len(self._buf) - len(body))
            if body.startswith(","):
                self._raw = self._consume(1)
                self._reader = JsonCallReader(self)
                self._state = "item"
                return True
            if body.startswith("]"):
                self._consume(1)
            self._state = "text"
            return True
        self._content(self._consume(len(self._buf)))
        return False
