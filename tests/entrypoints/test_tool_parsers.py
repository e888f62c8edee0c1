"""Tool-call and reasoning parsers on hand-written model outputs (well-formed and malformed), and the
property the server's streaming rests on: however a reply is cut into deltas, the events fold into the
same message as the whole reply's."""

from __future__ import annotations

import itertools
import json

import pytest
from helpers_tools import grammar_accepts
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedrs.entrypoints.openai.chat.output import OutputParsing, ReplyReader
from pagedrs.entrypoints.openai.protocol_tools import ChatTool
from pagedrs.entrypoints.openai.reasoning import REASONING_PARSERS
from pagedrs.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    Event,
    NamedCallParser,
    ParsedMessage,
    RequiredCallsParser,
    ToolParser,
    chat_deltas,
)

W = '{"city": "Paris", "days": 3}'
T = '{"tz": "UTC"}'

# (parser, model output, expected content, expected [(name, arguments)])
CASES: list[tuple[str, str, str | None, list[tuple[str, str]]]] = [
    ("hermes", "The weather is nice.", "The weather is nice.", []),
    (
        "hermes",
        f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>',
        None,
        [("get_weather", W)],
    ),
    (
        "hermes",
        f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n'
        f'<tool_call>\n{{"name": "get_time", "arguments": {T}}}\n</tool_call>',
        "Let me check.",
        [("get_weather", W), ("get_time", T)],
    ),
    ("hermes", f'<tool_call>{{"arguments": {T}, "name": "get_time"}}</tool_call>', None, [("get_time", T)]),
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        None,
        [("f", '{"a": 1}')],
    ),
    ("hermes", '<tool_call>{"name": "f"}</tool_call>', None, [("f", "{}")]),
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"s": "</tool_call> }"}}</tool_call>',
        None,
        [("f", '{"s": "</tool_call> }"}')],
    ),
    # malformed: the text is content
    ("hermes", "<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    ("hermes", '<tool_call>{"nam": "f"}</tool_call>', '<tool_call>{"nam": "f"}</tool_call>', []),
    ("hermes", '<tool_call>{"name": 5, "arguments": {}}', '<tool_call>{"name": 5, "arguments": {}}', []),
    ("hermes", 'Hi <tool_call>{"name": "f", "argu', 'Hi <tool_call>{"name": "f", "argu', []),
    ("hermes", "a < b and <tool_ca", "a < b and <tool_ca", []),
    # truncated inside the arguments: the call stays with what came
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": [1, 2', None, [("f", '{"a": [1, 2')]),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {W}}}', None, [("get_weather", W)]),
    (
        "llama3_json",
        f'<|python_tag|>{{"name": "get_weather", "parameters": {W}}}; {{"name": "get_time", "parameters": {T}}}',
        None,
        [("get_weather", W), ("get_time", T)],
    ),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", "Paris is sunny.", "Paris is sunny.", []),
    ("llama3_json", '{"name": "f", "parameters": {}} and more', "and more", [("f", "{}")]),
    (
        "mistral",
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {W}}}, {{"name": "get_time", "arguments": {T}}}]',
        None,
        [("get_weather", W), ("get_time", T)],
    ),
    (
        "mistral",
        f"Sure. [TOOL_CALLS]get_weather[ARGS]{W}[TOOL_CALLS]get_time[ARGS]{T}",
        "Sure.",
        [("get_weather", W), ("get_time", T)],
    ),
    ("mistral", "[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
    ("mistral", "[TOOL_CALLS][1, 2]", "[TOOL_CALLS][1, 2]", []),
    ("mistral", "No tools [TOOL_CALL", "No tools [TOOL_CALL", []),
    (
        "pythonic",
        "[get_weather(city=\"Paris\", days=3), get_time(tz='UTC')]",
        None,
        [("get_weather", W), ("get_time", T)],
    ),
    (
        "pythonic",
        "[f(x={'a': [True, None, -1.5]}, y=(1, 2)), g()]",
        None,
        [("f", '{"x": {"a": [true, null, -1.5]}, "y": [1, 2]}'), ("g", "{}")],
    ),
    ("pythonic", '<|python_start|>[get_time(tz="UTC")]<|python_end|>', None, [("get_time", T)]),
    ("pythonic", "[f(a=1e5, b=-.5, c='x\\'y')]", None, [("f", '{"a": 100000.0, "b": -0.5, "c": "x\'y"}')]),
    ("pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("pythonic", "Hello world", "Hello world", []),
    ("pythonic", "[hello world]", "[hello world]", []),
    # broken after the call started: the call keeps what came, the rest is text
    ("pythonic", "[f(a=b)]", "b)]", [("f", '{"a": ')]),
]


def run(parser: ToolParser | ReplyReader, pieces: list[str]) -> ParsedMessage:
    msg = ParsedMessage()
    for piece in pieces:
        msg.add(parser.feed(piece))
    return msg.add(parser.finish())


def ids() -> itertools.count[int]:
    return itertools.count()


def make(name: str) -> ToolParser:
    counter = ids()
    return TOOL_PARSERS[name](new_id=lambda: f"call_{next(counter)}")


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parser_on_hand_written_output(
    name: str, text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    msg = run(make(name), [text])
    assert msg.content_or_none() == content
    assert [(c.name, c.arguments) for c in msg.tool_calls] == calls
    assert [c.id for c in msg.tool_calls] == [f"call_{i}" for i in range(len(calls))]
    for _, args in calls:
        if args.endswith("}"):
            json.loads(args)  # complete calls carry JSON arguments


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_one_character_at_a_time_is_the_same(
    name: str, text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    assert run(make(name), list(text)) == run(make(name), [text])


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = CASES[2][1]
    msg = run(TOOL_PARSERS["hermes"](max_calls=1), [text])
    assert [c.name for c in msg.tool_calls] == ["get_weather"] and msg.content == "Let me check."


def test_forced_readers() -> None:
    msg = run(NamedCallParser("get_weather"), ['{"city": ', '"Paris"}'])
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert msg.content_or_none() is None
    text = f'[{{"name": "get_weather", "parameters": {W}}}, {{"name": "get_time", "parameters": {T}}}]'
    msg = run(RequiredCallsParser(), [text])
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [("get_weather", W), ("get_time", T)]


def test_chat_deltas_fold_to_the_message() -> None:
    """The stream's deltas (what the server sends) rebuild the message."""
    text = CASES[2][1]
    parser = make("hermes")
    events: list[Event] = []
    for ch in text:
        events += parser.feed(ch)
    events += parser.finish()
    content, calls = "", {}
    for delta in chat_deltas(events):
        content += delta.get("content", "")
        for tc in delta.get("tool_calls", []):
            call = calls.setdefault(tc["index"], ["", ""])
            call[0] += tc.get("function", {}).get("name", "")
            call[1] += tc["function"].get("arguments", "")
    expected = run(make("hermes"), [text])
    assert content == expected.content
    assert [tuple(c) for _, c in sorted(calls.items())] == [
        (c.name, c.arguments) for c in expected.tool_calls
    ]


REASONING_CASES = [
    (
        "deepseek_r1",
        "",
        "<think>Paris is in France.</think>\n\nIt is sunny.",
        "Paris is in France.",
        "It is sunny.",
    ),
    ("deepseek_r1", "", "Paris is in France.</think>It is sunny.", "Paris is in France.", "It is sunny."),
    ("deepseek_r1", "", "still thinking", "still thinking", ""),
    ("deepseek_r1", "<|user|>hi<think>\n\n</think>\n\n", "Just content.", "", "Just content."),
    ("qwen3", "", "<think>hmm</think>answer", "hmm", "answer"),
    ("qwen3", "", "answer without thinking", "", "answer without thinking"),
    ("qwen3", "", "<think>cut off", "cut off", ""),
    ("qwen3", "prompt<think>\n", "open in the prompt</think>done", "open in the prompt", "done"),
    ("qwen3", "", "a < b </thin", "", "a < b </thin"),
]


@pytest.mark.parametrize("name,prompt,text,reasoning,content", REASONING_CASES)
def test_reasoning_parser(name: str, prompt: str, text: str, reasoning: str, content: str) -> None:
    for pieces in ([text], list(text)):
        msg = run(ReplyReader(REASONING_PARSERS[name](prompt), None), pieces)
        assert (msg.reasoning, msg.content) == (reasoning, content)


def test_reasoning_then_tool_calls() -> None:
    text = f'<think>I need the weather.</think>\n<tool_call>{{"name": "get_weather", "arguments": {W}}}</tool_call>'
    for pieces in ([text], list(text)):
        reader = ReplyReader(REASONING_PARSERS["qwen3"](""), TOOL_PARSERS["hermes"]())
        msg = run(reader, pieces)
        assert msg.reasoning == "I need the weather." and msg.content_or_none() is None
        assert [(c.name, c.arguments) for c in msg.tool_calls] == [("get_weather", W)]


# ------------------------------------------------------------------ property: splits never matter
SAMPLES = [(name, text) for name, text, _, _ in CASES] + [
    ("hermes", "<think>x</think>" + CASES[2][1]),
    ("mistral", CASES[18][1][:-5]),
]


def _variants(text: str, cut: int, drop: int) -> list[str]:
    """The text, truncated, and with one character dropped: well-formed and malformed outputs."""
    cut %= len(text) + 1
    drop %= max(len(text), 1)
    return [text, text[:cut], text[:drop] + text[drop + 1 :]]


@pytest.mark.parametrize("name,text", SAMPLES)
def test_every_single_cut_of_every_truncation(name: str, text: str) -> None:
    """Exhaustive over two-piece splits of the sample and of each of its prefixes (cut-off replies)."""
    for end in range(len(text) + 1):
        prefix = text[:end]
        whole = run(make(name), [prefix])
        for i in range(1, end):
            assert run(make(name), [prefix[:i], prefix[i:]]) == whole, (prefix, i)


@settings(max_examples=300, deadline=None)
@given(
    sample=st.sampled_from(SAMPLES),
    reasoning=st.sampled_from([None, "deepseek_r1", "qwen3"]),
    cut=st.integers(0, 10_000),
    drop=st.integers(0, 10_000),
    splits=st.lists(st.integers(0, 10_000), max_size=12),
)
def test_any_split_gives_the_same_message(
    sample: tuple[str, str], reasoning: str | None, cut: int, drop: int, splits: list[int]
) -> None:
    name, base = sample

    def reader() -> ReplyReader:
        counter = ids()
        parser = TOOL_PARSERS[name](new_id=lambda: f"call_{next(counter)}")
        return ReplyReader(REASONING_PARSERS[reasoning]("") if reasoning else None, parser)

    for text in _variants(base, cut, drop):
        points = sorted({s % (len(text) + 1) for s in splits})
        pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
        whole = run(reader(), [text])
        assert run(reader(), pieces) == whole
        # nothing is lost: every character is content, reasoning, call markup or arguments
        assert len(whole.content) + len(whole.reasoning) <= len(text)


# ------------------------------------------------------------------ constraints after reasoning
CONSTRAINT_CASES = [
    # (parser, prompt, reply, accepted)
    ("deepseek_r1", "", '<think>2 < 3, so</think>\n\n{"a": 1}', True),
    ("deepseek_r1", "", 'no opening tag</think>{"a": 1}', True),
    ("deepseek_r1", "", '{"a": 1}', False),  # it must reason first
    ("deepseek_r1", "", 'x</think>y</think>{"a": 1}', False),  # the block ends at the first </think>
    ("deepseek_r1", "", '<think>x</think>{"a": "one"}', False),  # the schema still holds after it
    ("qwen3", "", '<think>hmm</think>{"a": 1}', True),
    ("qwen3", "", '{"a": 1}', True),  # no block at all
    ("qwen3", "", 'hmm</think>{"a": 1}', False),
    ("qwen3", "<think>\n", 'left open by the prompt</think>{"a": 1}', True),
    ("qwen3", "<think>\n\n</think>\n\n", '{"a": 1}', True),  # closed by the prompt: the answer only
    ("qwen3", "<think>\n\n</think>\n\n", '<think>x</think>{"a": 1}', False),
]


@pytest.mark.parametrize("name,prompt,reply,accepted", CONSTRAINT_CASES)
def test_constraint_applies_after_the_reasoning_block(
    name: str, prompt: str, reply: str, accepted: bool
) -> None:
    """The grammar the engine compiles lets the reasoning block through and holds the reply after it
    to the schema."""
    import xgrammar as xgr

    from pagedrs.structured_outputs import StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = REASONING_PARSERS[name](prompt).after_reasoning(StructuredOutputsParams(json=schema), prompt)
    assert params is not None
    if params.grammar is None:  # nothing to let through first: the schema itself
        assert REASONING_PARSERS[name].initial_state(prompt) == "content" and params.json == schema
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    else:
        grammar = xgr.Grammar.from_ebnf(params.grammar)
    assert grammar_accepts(grammar, reply) == accepted


# Pieces of every format's markup (and of broken markup): their random concatenations are mostly
# malformed replies.
PIECES = [
    "<tool_call>", "</tool_call>", "{", "}", '"name"', '"arguments"', '"parameters"', ":", ", ", '"f"',
    '"x\\"y"', "[", "]", "[TOOL_CALLS]", "[ARGS]", "(", ")", "=", "f", "1", "-", ".", "e", "'", '"',
    "\\", " ", "\n", "<think>", "</think>", ";", "<|python_tag|>", "<|python_start|>", "<|python_end|>",
    "True", "None", "text", "\u00e9", "<", "/", '{"name": "f", "arguments": {"a": 1}}', "[f(a=1)]",
]  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(
    kind=st.sampled_from([*TOOL_PARSERS, "named", "required"]),
    reasoning=st.sampled_from([None, "deepseek_r1", "qwen3"]),
    parts=st.lists(st.sampled_from(PIECES), max_size=25),
    splits=st.lists(st.integers(0, 10_000), max_size=8),
)
def test_random_markup_never_fails_and_splits_never_matter(
    kind: str, reasoning: str | None, parts: list[str], splits: list[int]
) -> None:
    def reader() -> ReplyReader:
        counter = ids()

        def new_id() -> str:
            return f"call_{next(counter)}"

        if kind == "named":
            tools: ToolParser = NamedCallParser("f", new_id)
        elif kind == "required":
            tools = RequiredCallsParser(new_id)
        else:
            tools = TOOL_PARSERS[kind](new_id)
        return ReplyReader(REASONING_PARSERS[reasoning]("") if reasoning else None, tools)

    text = "".join(parts)
    points = sorted({s % (len(text) + 1) for s in splits})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    assert run(reader(), pieces) == run(reader(), [text])


STRICT_CASES = [
    ("Just text, no call.", True),
    ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', True),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": 5}}\n</tool_call>', False),  # schema
    ('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', False),  # not a tool
    ('<tool_call>\n{"name": "get_time", "arguments": {"any": [1]}}\n</tool_call>', True),  # not strict
]


@pytest.mark.parametrize("reply,accepted", STRICT_CASES)
def test_auto_with_strict_tools_constrains_the_calls(reply: str, accepted: bool) -> None:
    """tool_choice auto with a `strict` tool (hermes format): text is free, a call the model opens
    follows its function's schema, and the hermes parser reads what the grammar allows."""
    tools = [
        ChatTool.model_validate(
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "strict": True,
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}},
                        "required": ["city"],
                        "additionalProperties": False,
                    },
                },
            }
        ),
        ChatTool.model_validate({"type": "function", "function": {"name": "get_time"}}),
    ]
    plan = OutputParsing("hermes", True).plan(tools, "auto")
    params = plan.constraint(None, "")
    assert params is not None and params.grammar is not None
    assert grammar_accepts(params.grammar, reply) == accepted
    if accepted and "<tool_call>" in reply:
        msg = run(make("hermes"), [reply])
        assert len(msg.tool_calls) == 1 and json.loads(msg.tool_calls[0].arguments) is not None
    assert OutputParsing("hermes", True).plan(tools[1:], "auto").constraint(None, "") is None  # none strict


def test_constraint_grammars_on_the_default_models_vocabulary() -> None:
    """The same grammars over a real BPE vocabulary (the default model's tokenizer): the reasoning
    block and a strict call are let through token by token, a wrong answer is not."""
    from pagedrs.loader import load_tokenizer
    from pagedrs.structured_outputs import StructuredOutputsParams

    try:
        tokenizer = load_tokenizer(None)
    except ValueError as exc:  # the default model is not installed
        pytest.skip(str(exc))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = REASONING_PARSERS["deepseek_r1"]("").after_reasoning(StructuredOutputsParams(json=schema), "")
    assert params is not None
    assert grammar_accepts(params.grammar, '<think>2 < 3, </thin k>\n</think>\n\n{"a": 1}', tokenizer)
    assert not grammar_accepts(params.grammar, '<think>x</think>{"a": "1"}', tokenizer)
    tool = ChatTool.model_validate(
        {"type": "function", "function": {"name": "f", "strict": True, "parameters": schema}}
    )
    strict = OutputParsing("hermes", True).plan([tool], "auto").constraint(None, "")
    assert strict is not None
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 7}}\n</tool_call>'
    assert grammar_accepts(strict.grammar, "Sure. " + call, tokenizer)
    assert not grammar_accepts(strict.grammar, call.replace("7", "true"), tokenizer)
