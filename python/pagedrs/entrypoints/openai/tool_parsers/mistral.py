"""Mistral tool calls: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (tokenizer v3) or
``[TOOL_CALLS]f[ARGS]{...}`` (v11 and later), after optional text (vLLM's mistral parser). The marker
is a special token: this parser asks for special tokens to be kept in the text."""

from __future__ import annotations

import re

from pagedrs.entrypoints.openai.tool_parsers.base import ToolParser, held_prefix
from pagedrs.entrypoints.openai.tool_parsers.events import IdFactory
from pagedrs.entrypoints.openai.tool_parsers.json_calls import JsonCallReader, Status, ValueScanner

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_WS = " \t\r\n"
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def __init__(self, new_id: IdFactory | None = None, max_calls: int | None = None) -> None:
        super().__init__(new_id, max_calls)
        self._state = "content"
        self._raw = ""  # the markup of the call being read, given back if it is not one
        self._reader: JsonCallReader | None = None
        self._scanner: ValueScanner | None = None

    def _fail(self, extra: str = "") -> bool:
        self._content(self._raw + extra)
        self._raw = ""
        self._state = "content"
        return True

    def _advance(self, final: bool) -> bool:
        """One transition of the streaming state machine (content -> marker -> calls -> after). Long
        because every state's branch is here, read top to bottom as the text arrives."""
        state = self._state
        if state == "content":
            i = self._buf.find(MARKER)
            if i < 0:
                keep = 0 if final else held_prefix(self._buf, MARKER)
                self._content(self._consume(len(self._buf) - keep))
                return False
            self._content(self._consume(i))
            self._raw = self._consume(len(MARKER))
            self._state = "after_marker"
            return True
        if state == "after_marker":
            body = self._buf.lstrip(_WS)
            if not body:
                return self._fail(self._consume(len(self._buf))) if final else False
            self._raw += self._consume(len(self._buf) - len(body))
            if body.startswith("["):
                self._raw += self._consume(1)
                self._state = "item"
                self._reader = JsonCallReader(self)
            else:
                self._state = "name"
            return True
        if state == "item":
            assert self._reader is not None
            status = self._reader.advance(final)
            if status is Status.MORE:
                return False
            if status is Status.FAIL:
                return self._fail(self._reader.raw)
            self._raw = ""
            self._state = "item_sep"
            return True
        if state == "item_sep":
            body = self._buf.lstrip(_WS)
            if not body and not final:
                return False
            self._consume(len(self._buf) - len(body))
            if body.startswith(","):
                self._consume(1)
                self._reader = JsonCallReader(self)
                self._state = "item"
            else:
                if body.startswith("]"):
                    self._consume(1)
                self._state = "content"
            return True
        if state == "name":
            m = _NAME.match(self._buf)
            assert m is not None
            rest = self._buf[m.end() :]
            if rest.startswith(ARGS) and m.end() > 0:
                name = self._consume(m.end())
                self._consume(len(ARGS))
                self._raw = ""
                self._start_call(name)
                self._state = "args"
                return True
            if rest and not ARGS.startswith(rest[: len(ARGS)]) or final:
                return self._fail()
            return False
        # "args": a JSON value, streamed as it comes
        if self._scanner is None:
            body = self._buf.lstrip(_WS)
            if not body:
                if final:
                    self._state = "content"
                    return True
                return False
            self._consume(len(self._buf) - len(body))
            self._scanner = ValueScanner(body[0])
        end = self._scanner.scan(self._buf)
        self._args(self._consume(len(self._buf) if end is None else end))
        if end is None and not final:
            return False
        self._scanner = None
        self._state = "content"
        return True
