"""Reading JSON call objects (``{"name": "f", "arguments": {...}}``) incrementally, streaming the
arguments' text as it arrives: the reader shared by the hermes, llama3_json and mistral parsers and by
the grammar-forced `required` output."""

from __future__ import annotations

import enum
import json

from pagedrs.entrypoints.openai.tool_parsers.base import ToolParser

_WS = " \t\r\n"
NAME_KEYS = frozenset({"name"})
ARGS_KEYS = frozenset({"arguments", "parameters"})  # llama3 and vLLM's `required` use "parameters"


class Status(enum.Enum):
    MORE = "more"  # needs more text
    DONE = "done"  # the object ended (or, once committed, the text ended)
    FAIL = "fail"  # not a call object: the caller treats the text as content


class ValueScanner:
    """Finds where a JSON value ends (strings and nesting tracked; scalars end at a delimiter)."""

    def __init__(self, first: str) -> None:
        self.kind = "container" if first in "{[" else "string" if first == '"' else "scalar"
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.started = False

    def scan(self, text: str) -> int | None:
        """Consumes `text`; the index just past the value's end when it ends there, else None."""
        for i, ch in enumerate(text):
            if not self.started:
                self.started = True
                if self.kind == "container":
                    self.depth = 1
                elif self.kind == "string":
                    self.in_str = True
                continue
            if self.kind == "scalar":
                if ch in _WS or ch in ",}]":
                    return i
                continue
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                    if self.kind == "string":
                        return i + 1
                continue
            if ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class JsonCallReader:
    """One call object read from `parser`'s buffer: the call starts (id and name emitted) as soon as
    the name is known and the arguments begin, then argument text streams as it comes. Keys may come
    in any order (arguments first are held until the name is read)."""

    def __init__(self, parser: ToolParser) -> None:
        self.p = parser
        self.raw = ""  # consumed text, given back as content if this is not a call
        self.phase = "open"
        self.key: str | None = None
        self.name: str | None = None
        self.held_args: str | None = None  # arguments read before the name
        self.committed = False
        self.scanner: ValueScanner | None = None
        self.value_text = ""  # a value read whole (name, arguments held or not streamed)
        self.args_seen = False
        self.mode = "skip"  # what the current value is: name, stream, emit, hold, skip

    def _eat(self, n: int) -> str:
        text = self.p._consume(n)
        self.raw += text
        return text

    def _skip_ws(self) -> bool:
        """Consumes leading whitespace; True when a non-whitespace character follows."""
        buf = self.p._buf
        n = len(buf) - len(buf.lstrip(_WS))
        if n:
            self._eat(n)
        return bool(self.p._buf)

    def advance(self, final: bool) -> Status:
        while True:
            status = self._step(final)
            if status is not None:
                return status

    def _end(self, final: bool) -> Status:
        """The buffer ran out: wait, or at the end of the text keep a started call (truncated)."""
        if not final:
            return Status.MORE
        return Status.DONE if self.committed else Status.FAIL

    def _step(self, final: bool) -> Status | None:
        if self.phase == "value":
            return self._value(final)
        if not self._skip_ws():
            return self._end(final)
        ch = self.p._buf[0]
        if self.phase == "open":
            if ch != "{":
                return Status.FAIL
            self._eat(1)
            self.phase = "key"
        elif self.phase == "key":
            if ch == "}" and self.key is None:
                self._eat(1)
                return self._close()
            if ch != '"':
                return self._fail_or_done()
            text = self._string()
            if text is None:
                return self._end(final)
            try:
                key = json.loads(text)
            except ValueError:
                return self._fail_or_done()
            if not isinstance(key, str):
                return self._fail_or_done()
            self.key = key
            self.phase = "colon"
        elif self.phase == "colon":
            if ch != ":":
                return self._fail_or_done()
            self._eat(1)
            self.phase = "value"
        else:  # "sep"
            if ch == ",":
                self._eat(1)
                self.phase = "key"
            elif ch == "}":
                self._eat(1)
                return self._close()
            else:
                return self._fail_or_done()
        return None

    def _fail_or_done(self) -> Status:
        return Status.DONE if self.committed else Status.FAIL

    def _close(self) -> Status:
        if self.committed:
            return Status.DONE
        if self.name is None:
            return Status.FAIL
        self.p._start_call(self.name)
        self.committed = True
        self.p._args(self.held_args if self.held_args is not None else "{}")
        return Status.DONE

    def _string(self) -> str | None:
        """A whole JSON string token at the buffer's start (consumed), or None while incomplete."""
        end = ValueScanner('"').scan(self.p._buf)
        return None if end is None else self._eat(end)

    def _value(self, final: bool) -> Status | None:
        if self.scanner is None:
            if not self._skip_ws():
                return self._end(final)
            self.scanner = ValueScanner(self.p._buf[0])
            self.value_text = ""
            if self.key in ARGS_KEYS and not self.args_seen:
                self.args_seen = True
                if self.name is not None:
                    self.p._start_call(self.name)
                    self.committed = True
                    self.mode = "stream" if self.scanner.kind == "container" else "emit"
                else:
                    self.mode = "hold"
            elif self.key in NAME_KEYS and self.name is None:
                self.mode = "name"
            else:
                self.mode = "skip"
        buf = self.p._buf
        end = self.scanner.scan(buf)
        complete = end is not None or (final and self.scanner.kind == "scalar")
        taken = self._eat(len(buf) if end is None else end)
        if self.mode == "stream":
            self.p._args(taken)
        else:
            self.value_text += taken
        if not complete:
            if not final:
                return Status.MORE
            if self.mode == "emit":  # the text ended inside the arguments: keep what came
                self.p._args(self.value_text)
            return self._fail_or_done()
        self.scanner = None
        self.phase = "sep"
        if self.mode == "name":
            try:
                name = json.loads(self.value_text)
            except ValueError:
                return self._fail_or_done()
            if not isinstance(name, str) or not name:
                return self._fail_or_done()
            self.name = name
        elif self.mode == "emit":
            self.p._args(_arguments_text(self.value_text))
        elif self.mode == "hold":
            self.held_args = _arguments_text(self.value_text)
        return None


def _arguments_text(text: str) -> str:
    """Arguments given as a JSON string (some models encode them) are that string's content."""
    stripped = text.strip()
    if stripped.startswith('"'):
        try:
            value = json.loads(stripped)
        except ValueError:
            return stripped
        if isinstance(value, str):
            return value
    return stripped
