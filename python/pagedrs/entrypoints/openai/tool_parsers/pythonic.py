"""Pythonic tool calls: the reply is a Python list of calls with literal keyword arguments,
``[get_weather(city="Paris", days=3), get_time(tz='UTC')]``, optionally inside
``<|python_start|>...<|python_end|>`` (Llama 3.2 / 4; vLLM's pythonic parser). Arguments are given as
JSON (``{"city": "Paris", "days": 3}``); a reply that is not such a list is text."""

from __future__ import annotations

import ast
import json
import re

from pagedrs.entrypoints.openai.tool_parsers.base import ToolParser
from pagedrs.entrypoints.openai.tool_parsers.events import IdFactory

START, END = "<|python_start|>", "<|python_end|>"
_WS = " \t\r\n"
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_NUMBER_PREFIX = re.compile(r"-?\d*\.?\d*(?:[eE][+-]?\d*)?")
_STRING = re.compile(r"""'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*\"""")
_CONSTANTS = {"True": "true", "False": "false", "None": "null"}
_OPEN = {"[": "[", "(": "[", "{": "{"}
_CLOSE = {"]": "]", ")": "]", "}": "}"}

Token = tuple[str, str]  # (kind, text): ident, number, string, punct


def next_token(buf: str, final: bool) -> Token | str | None:
    """The token at the start of `buf` (no leading whitespace): a token, None when it may still be
    growing, or "error"."""
    if not buf:
        return None
    ch = buf[0]
    if ch in "'\"":
        m = _STRING.match(buf)
        if m is None:
            return "error" if final or "\n" in buf else None
        return ("string", m.group())
    if not final and _NUMBER_PREFIX.fullmatch(buf):  # a number that may still be growing
        return None
    m = _IDENT.match(buf) or _NUMBER.match(buf)
    if m is not None:
        if m.end() == len(buf) and not final:
            return None
        return ("ident" if m.re is _IDENT else "number", m.group())
    if ch in "[](){},:=":
        return ("punct", ch)
    return "error"


def literal_json(kind: str, text: str) -> str | None:
    """A Python literal token as JSON text, None if it is not a literal."""
    if kind == "punct":
        return _OPEN.get(text) or _CLOSE.get(text) or (", " if text == "," else ": " if text == ":" else None)
    if kind == "ident":
        return _CONSTANTS.get(text)
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None
    return json.dumps(value, ensure_ascii=False)


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def __init__(self, new_id: IdFactory | None = None, max_calls: int | None = None) -> None:
        super().__init__(new_id, max_calls)
        self._state = "start"
        self._raw = ""  # text read before the first call starts, given back if it is not a call list
        self._depth = 0  # nesting inside an argument value
        self._num_args = 0

    def _text(self) -> bool:
        self._content(self._raw + self._consume(len(self._buf)))
        self._raw = ""
        self._state = "text"
        return False

    def _advance(self, final: bool) -> bool:
        if self._state == "text":
            return self._text()
        body = self._buf.lstrip(_WS)
        ws = len(self._buf) - len(body)
        if not body:
            return self._text() if final else False
        if self._state == "start" and not self._raw:  # the optional opening tag
            if body.startswith(START):
                self._raw = self._consume(ws + len(START))
                return True
            if START.startswith(body) and not final:
                return False
        if self._state == "end":  # after the list: its closing tag, then text
            if body.startswith(END):
                self._consume(ws + len(END))
            elif END.startswith(body) and not final:
                return False
            return self._text()
        tok = next_token(body, final)
        if tok is None:
            return self._text() if final else False
        if isinstance(
            tok, str
        ):  # "error" before a call: the reply is text; inside one: the calls so far stay
            return self._text()
        kind, text = tok
        return self._token(kind, text, self._consume(ws + len(text)))

    def _token(self, kind: str, text: str, consumed: str) -> bool:
        state = self._state
        if state == "start":
            self._raw += consumed
            if text != "[":
                return self._text()
            self._state = "name"
        elif state == "name":
            self._raw += consumed
            if kind != "ident":
                return self._text()
            self._name = text
            self._state = "open_paren"
        elif state == "open_paren":
            self._raw += consumed
            if text != "(":
                return self._text()
            self._raw = ""
            self._start_call(self._name)
            self._args("{")
            self._num_args = 0
            self._state = "kw"
        elif state == "kw":
            if text == ")":
                self._args("}")
                self._state = "after_call"
            elif kind == "ident":
                self._args((", " if self._num_args else "") + json.dumps(text) + ": ")
                self._num_args += 1
                self._state = "eq"
            else:
                return self._broken(consumed)
        elif state == "eq":
            if text != "=":
                return self._broken(consumed)
            self._state = "value"
        elif state == "value":
            if self._depth == 0 and text in ",)":
                if text == ")":
                    self._args("}")
                    self._state = "after_call"
                else:
                    self._state = "kw"
                return True
            out = literal_json(kind, text)
            if out is None:
                return self._broken(consumed)
            self._depth += text in _OPEN
            self._depth -= text in _CLOSE
            self._args(out)
        elif state == "after_call":
            if text == ",":
                self._state = "name"
            elif text == "]":
                self._state = "end"
            else:
                return self._broken(consumed)
        else:  # "end": only the closing tag may follow
            return self._broken(consumed)
        return True

    def _broken(self, consumed: str) -> bool:
        """The list broke after a call started: the calls so far stay; the rest is text."""
        self._raw = consumed
        return self._text()
