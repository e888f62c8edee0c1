"""Bare JSON tool calls (what small models emit instead of their template's markup): read as calls only
when they name an offered tool, the same events however the stream is cut, right after reasoning too."""

from __future__ import annotations

import json

import pytest

from pagedrs.entrypoints.openai.chat.output import ReplyReader
from pagedrs.entrypoints.openai.reasoning import REASONING_PARSERS
from pagedrs.entrypoints.openai.tool_parsers import HermesToolParser, ParsedMessage
from pagedrs.entrypoints.openai.tool_parsers.bare_json import BareJsonCalls, bare_calls

TOOLS = frozenset({"get_weather", "get_time"})


def parser(max_calls: int | None = None) -> BareJsonCalls:
    ids = iter(f"call_{i}" for i in range(100))
    return BareJsonCalls(HermesToolParser(lambda: next(ids), max_calls), TOOLS, lambda: next(ids), max_calls)


def parse(text: str, cuts: list[int] | None = None, max_calls: int | None = None) -> ParsedMessage:
    p = parser(max_calls)
    msg = ParsedMessage()
    edges = [0, *(cuts or []), len(text)]
    for a, b in zip(edges, edges[1:], strict=False):
        msg.add(p.feed(text[a:b]))
    msg.add(p.finish())
    assert p.num_calls >= len(msg.tool_calls)
    return msg


def calls(msg: ParsedMessage) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in msg.tool_calls]


CASES = [
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})], ""),
    ('  {"name": "get_time", "parameters": {"tz": "UTC"}}\n', [("get_time", {"tz": "UTC"})], ""),
    (
        '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]',
        [("get_weather", {"city": "Oslo"}), ("get_time", {})],
        "",
    ),
    (
        '```json\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n```',
        [("get_weather", {"city": "Rome"})],
        "",
    ),
    (
        '{"name": "get_weather", "arguments": "{\\"city\\": \\"Nice\\"}"}',
        [("get_weather", {"city": "Nice"})],
        "",
    ),
    (
        '{"name": "get_weather", "arguments": {"city": "Bern"}} Done.',
        [("get_weather", {"city": "Bern"})],
        "Done.",
    ),
    (
        '{"name": "get_weather", "arguments": {"city": "A"}}\n<tool_call>{"name": "get_time", "arguments": {"tz": "B"}}</tool_call>',
        [("get_weather", {"city": "A"}), ("get_time", {"tz": "B"})],
        "",
    ),
    # not calls: the text stays exactly as it was
    (
        '{"name": "send_email", "arguments": {"to": "x"}}',
        [],
        '{"name": "send_email", "arguments": {"to": "x"}}',
    ),
    ('{"answer": 42}', [], '{"answer": 42}'),
    (
        '{"name": "get_weather", "arguments": {"city": "Pa',
        [],
        '{"name": "get_weather", "arguments": {"city": "Pa',
    ),
    ('{"name": "get_weather", "arguments": [1]}', [], '{"name": "get_weather", "arguments": [1]}'),
    ("The weather is nice.", [], "The weather is nice."),
    ("[1, 2, 3] are numbers", [], "[1, 2, 3] are numbers"),
    ('Call: {"name": "get_weather", "arguments": {}}', [], 'Call: {"name": "get_weather", "arguments": {}}'),
    ("```python\nprint(1)\n```", [], "```python\nprint(1)\n```"),
    (
        '<tool_call>{"name": "get_time", "arguments": {"tz": "C"}}</tool_call>',
        [("get_time", {"tz": "C"})],
        "",
    ),
]


@pytest.mark.parametrize(("text", "want_calls", "want_content"), CASES)
def test_bare_calls_whole_and_cut_everywhere(text: str, want_calls: list[object], want_content: str) -> None:
    whole = parse(text)
    assert calls(whole) == want_calls and whole.content == want_content
    for cut in range(1, len(text)):
        piece = parse(text, [cut])
        assert (calls(piece), piece.content) == (want_calls, want_content), cut
    by_char = parse(text, list(range(1, len(text))))
    assert (calls(by_char), by_char.content) == (want_calls, want_content)


def test_one_call_when_parallel_calls_are_off() -> None:
    text = '[{"name": "get_weather", "arguments": {"city": "X"}}, {"name": "get_time", "arguments": {}}]'
    assert calls(parse(text, max_calls=1)) == [("get_weather", {"city": "X"})]


def test_a_call_right_after_thinking_is_kept() -> None:
    text = (
        '<think>The user wants the weather.</think>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}'
    )
    for cut in (None, 7, 40, 45, len(text) - 3):
        reader = ReplyReader(REASONING_PARSERS["qwen3"](""), BareJsonCalls(HermesToolParser(), TOOLS))
        edges = [0, *([cut] if cut else []), len(text)]
        msg = ParsedMessage()
        for a, b in zip(edges, edges[1:], strict=False):
            msg.add(reader.feed(text[a:b]))
        msg.add(reader.finish())
        assert msg.reasoning == "The user wants the weather."
        assert calls(msg) == [("get_weather", {"city": "Lyon"})] and msg.content == ""
        assert reader.num_calls == 1


def test_bare_calls_checks_every_object() -> None:
    assert bare_calls({"name": "get_time", "arguments": {}}, TOOLS) == [("get_time", {})]
    assert bare_calls([{"name": "get_time"}, {"name": "nope", "arguments": {}}], TOOLS) is None
    assert bare_calls([], TOOLS) is None
    assert bare_calls({"name": "get_time", "arguments": {}, "extra": 1}, TOOLS) is None
