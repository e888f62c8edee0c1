"""The generic tool format, for chat templates that name none (as llama.cpp's generic handler): the
tools are described in a system message and the grammar engine holds the reply to one JSON object,
either calls or a message:

    {"tool_calls": [{"name": "f", "arguments": {...}}, ...]}      or      {"response": "text"}

`GenericToolParser` reads that object back incrementally: calls as calls (arguments streamed as they
come), the response string decoded as content; text that is not such an object is content.
"""

from __future__ import annotations

import json
from typing import Any

from pagedrs.entrypoints.openai.tool_parsers.base import ToolParser
from pagedrs.entrypoints.openai.tool_parsers.events import IdFactory
from pagedrs.entrypoints.openai.tool_parsers.json_calls import JsonCallReader, Status, ValueScanner

_WS = " \t\r\n"
CALLS_KEY, RESPONSE_KEY = "tool_calls", "response"
_HEX = frozenset("0123456789abcdefABCDEF")


def generic_schema(
    tools: list[tuple[str, dict[str, Any]]], parallel: bool, response: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The reply's JSON schema: calls (each a tool's name and arguments following its parameters
    schema; one call at most without `parallel`) or a response (`response`: its schema, default a
    string). `tools`: (name, parameters schema) of every tool."""
    call = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "arguments": schema},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, schema in tools
    ]
    calls: dict[str, Any] = {"type": "array", "items": {"anyOf": call}, "minItems": 1}
    if not parallel:
        calls["maxItems"] = 1
    return {
        "anyOf": [
            _one_key(CALLS_KEY, calls),
            _one_key(RESPONSE_KEY, response if response is not None else {"type": "string"}),
        ]
    }


def _one_key(key: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {key: schema},
        "required": [key],
        "additionalProperties": False,
    }


def generic_system_prompt(tools: list[dict[str, Any]], auto: bool) -> str:
    """The tools (OpenAI function definitions) for a model whose template cannot show them, and with
    `auto` the reply's two shapes (the grammar enforces them; the words help the model choose)."""
    text = "You can call these tools (their arguments follow the JSON schema `parameters`):\n"
    text += "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if auto:
        text += (
            '\n\nReply with one JSON object: {"tool_calls": [{"name": <tool name>, "arguments": '
            '{<arguments>}}]} to call tools, or {"response": "<your answer>"} to answer the user directly.'
        )
    return text


def generic_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation's tool turns in the generic format, for a template that knows no tools (as
    llama.cpp's polyfills): an assistant's calls become its content, a tool result a user message."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> function name
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            body = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
            names.update({c["id"]: c["function"]["name"] for c in calls})
            text = json.dumps({CALLS_KEY: body}, ensure_ascii=False)
            m["content"] = f"{m['content']}\n{text}" if m.get("content") else text
        if m["role"] == "tool":
            call_id = m.pop("tool_call_id", None)
            result = {"tool": names.get(call_id or "", m.pop("name", None)), "content": m["content"]}
            if call_id is not None:
                result["tool_call_id"] = call_id
            m = {"role": "user", "content": json.dumps({"tool_response": result}, ensure_ascii=False)}
        out.append(m)
    return out


def with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """`text` at the end of the first system message, or a new system message first."""
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{text}" if first.get("content") else text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def string_safe_end(body: str) -> tuple[int, bool]:
    """How much of a JSON string's body (after its opening quote) can be decoded now: the index of
    its closing quote (and True), else the longest prefix that ends on no escape still completing
    (a surrogate pair counts as one escape)."""
    i = safe = 0
    while i < len(body):
        ch = body[i]
        if ch == '"':
            return i, True
        if ch != "\\":
            i += 1
        elif i + 1 >= len(body):
            break
        elif body[i + 1] != "u":
            i += 2
        else:
            n = _unicode_escape(body, i)
            if n == 0:
                break
            i += n
        safe = i
    return safe, False


def _unicode_escape(body: str, i: int) -> int:
    """The length of the ``\\uXXXX`` escape (with its low half, for a high surrogate) at `i`; 0 while it
    may still be completing; 2 for a malformed one (left to the decoder's fallback)."""
    digits = body[i + 2 : i + 6]
    if not set(digits) <= _HEX:
        return 2
    if len(digits) < 4:
        return 0
    if not 0xD800 <= int(digits, 16) < 0xDC00:
        return 6
    low = body[i + 6 : i + 12]
    if not low.startswith("\\u"[: len(low)]) or not set(low[2:]) <= _HEX:
        return 6
    return 0 if len(low) < 6 else 12


def decode_string_part(raw: str) -> str:
    """A piece of a JSON string body decoded (raw where it is not valid JSON); a lone surrogate, which
    UTF-8 cannot carry, becomes U+FFFD."""
    try:
        value = json.loads(f'"{raw}"')
    except ValueError:
        return raw
    if not isinstance(value, str):
        return raw
    return "".join("\ufffd" if 0xD800 <= ord(c) < 0xE000 else c for c in value)


class GenericToolParser(ToolParser):
    """Reads ``{"tool_calls": [...]}`` / ``{"response": ...}``; anything else is content."""

    name = "generic"

    def __init__(self, new_id: IdFactory | None = None, max_calls: int | None = None) -> None:
        super().__init__(new_id, max_calls)
        self._state = "open"
        self._raw = ""  # markup consumed since the object opened, given back if it turns out text
        self._reader: JsonCallReader | None = None
        self._scanner: ValueScanner | None = None

    def _advance(self, final: bool) -> bool:
        if self._state == "open":
            return self._open(final)
        if self._state == "item":
            return self._item(final)
        if self._state == "sep":
            return self._sep(final)
        if self._state == "string":
            return self._string(final)
        if self._state == "value":
            return self._value(final)
        if self._state in ("close", "tail"):
            return self._close(final)
        self._content(self._consume(len(self._buf)))  # "text"
        return False

    def _open(self, final: bool) -> bool:
        """Waits for ``{"<key>":`` and the value's first character; decides calls, response or text."""
        head = _split_head(self._buf)
        if head is None:  # not the object's start
            self._state = "text"
            return True
        key, n = head
        if n < 0:  # still completing
            if final:
                self._state = "text"
                return True
            return False
        first = self._buf[n]
        if key == CALLS_KEY and first == "[":
            self._raw = self._consume(n + 1)
            self._reader = JsonCallReader(self)
            self._state = "item"
        elif key == RESPONSE_KEY:
            self._raw = self._consume(n + (first == '"'))
            self._state = "string" if first == '"' else "value"
        else:
            self._state = "text"
        return True

    def _item(self, final: bool) -> bool:
        assert self._reader is not None
        status = self._reader.advance(final)
        if status is Status.MORE:
            return False
        if status is Status.FAIL and final:  # the text ended before this call's arguments began:
            self._consume(len(self._buf))  # a call cut by max_tokens, neither a call nor text
            self._state = "tail"
        elif status is Status.FAIL:  # not a call object: what was read is text
            self._content(self._raw + self._reader.raw)
            self._state = "text"
        else:
            self._raw = ""
            self._state = "sep"
        return True

    def _sep(self, final: bool) -> bool:
        body = self._buf.lstrip(_WS)
        if not body and not final:
            return False
        self._consume(len(self._buf) - len(body))
        if body.startswith(","):
            self._raw = self._consume(1)
            self._reader = JsonCallReader(self)
            self._state = "item"
            return True
        if body.startswith("]"):
            self._consume(1)
        self._state = "close"
        return True

    def _string(self, final: bool) -> bool:
        end, closed = string_safe_end(self._buf)
        if final and not closed:
            end = len(self._buf)
        if end:
            self._content(decode_string_part(self._consume(end)))
        if closed:
            self._consume(1)
            self._state = "close"
            return True
        return False

    def _value(self, final: bool) -> bool:
        if not self._buf:
            self._state = "close"
            return final
        if self._scanner is None:
            self._scanner = ValueScanner(self._buf[0])
        end = self._scanner.scan(self._buf)
        self._content(self._consume(len(self._buf) if end is None else end))
        if end is None and not final:
            return False
        self._state = "close"
        return True

    def _close(self, final: bool) -> bool:
        """The object's closing brace and the whitespace around it are markup; anything more is text."""
        body = self._buf.lstrip(_WS)
        self._consume(len(self._buf) - len(body))
        if not body:
            return False
        if self._state == "close" and body.startswith("}"):
            self._consume(1)
            self._state = "tail"
        else:
            self._state = "text"
        return True


def _split_head(buf: str) -> tuple[str, int] | None:
    """``{"key":`` at the start of `buf` (whitespace allowed): the key and the index of the value's
    first character; n = -1 while that may still be completing; None when `buf` cannot start so."""
    i = len(buf) - len(buf.lstrip(_WS))
    if i == len(buf):
        return "", -1
    if buf[i] != "{":
        return None
    rest = buf[i + 1 :]
    j = i + 1 + len(rest) - len(rest.lstrip(_WS))
    if j == len(buf):
        return "", -1
    if buf[j] != '"':
        return None
    end = buf.find('"', j + 1)
    if end < 0:
        partial = buf[j + 1 :]
        return ("", -1) if any(k.startswith(partial) for k in (CALLS_KEY, RESPONSE_KEY)) else None
    key = buf[j + 1 : end]
    if key not in (CALLS_KEY, RESPONSE_KEY):
        return None
    k = end + 1 + len(buf[end + 1 :]) - len(buf[end + 1 :].lstrip(_WS))
    if k == len(buf):
        return key, -1
    if buf[k] != ":":
        return None
    v = k + 1 + len(buf[k + 1 :]) - len(buf[k + 1 :].lstrip(_WS))
    if v == len(buf):
        return key, -1
    return key, v
