"""`tool_choice` auto (OpenAI's default) with no server flags: the call format the chat template names is
read (hermes, llama3 JSON, mistral, pythonic), else the generic format (the tools in a system message,
the reply held by the grammar to ``{"tool_calls": [...]}`` or ``{"response": ...}``), streamed the same
as not; ``--tool-call-parser`` still overrides. The last test runs a generated set of requests on the
real default model (its template has no tool format)."""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from conftest import API_KEY, SubprocessServer, ThreadedServer
from helpers_tools import (
    TIME_TOOL,
    WEATHER_TOOL,
    ScriptedEngine,
    fold_chat_stream,
    grammar_accepts,
    message_summary,
    server_args,
    sse_bodies,
)

from pagedrs.entrypoints.openai.chat.output import OutputParsing
from pagedrs.entrypoints.openai.errors import APIError
from pagedrs.entrypoints.openai.protocol_tools import ChatTool
from pagedrs.entrypoints.openai.server.app import build_app
from pagedrs.entrypoints.openai.tool_parsers import (
    GenericToolParser,
    ParsedMessage,
    template_tool_format,
)
from pagedrs.structured_outputs import StructuredOutputsParams

AUTH = {"Authorization": f"Bearer {API_KEY}"}
W = {"city": "Paris", "days": 3}


@pytest.fixture(scope="module")
def engine() -> ScriptedEngine:
    return ScriptedEngine(max_model_len=8192)


@pytest.fixture(scope="module")
def server(engine: ScriptedEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    """No tool flags; the fake template names no tool format."""
    args = server_args(tmp_path_factory.mktemp("zero"), tool_call_parser=None, enable_auto_tool_choice=False)
    with ThreadedServer(build_app(engine, args)) as s:
        yield s


def script(engine: ScriptedEngine, reply: str) -> str:
    key = f"q-{uuid.uuid4().hex[:12]}"
    engine.scripts[key] = reply
    return key


def post_both(base_url: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A chat request non-streamed and streamed: the two summaries (both must be 200)."""
    with httpx.Client(base_url=base_url, headers=AUTH, timeout=300) as http:
        whole = http.post("/v1/chat/completions", json=body)
        streamed = http.post("/v1/chat/completions", json={**body, "stream": True})
    assert whole.status_code == 200, whole.text
    assert streamed.status_code == 200, streamed.text
    return message_summary(whole.json()), fold_chat_stream(sse_bodies(streamed.text))


GENERIC_REPLIES = [
    '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]}',
    '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}},{"name":"get_time","arguments":{"tz":"CET"}}]}',
    '{"response": "Sunny, 24 \\u00b0C \\ud83d\\ude00 \\"quoted\\"\\nnext line"}',
    '{"response": "cut off in the mid',
    '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Par',
    "not JSON at all",
]


@pytest.mark.parametrize("reply", GENERIC_REPLIES)
def test_generic_streamed_equals_non_streamed(
    engine: ScriptedEngine, server: ThreadedServer, reply: str
) -> None:
    key = script(engine, reply)
    body = {
        "model": "fake",
        "messages": [{"role": "user", "content": key}],
        "tools": [WEATHER_TOOL, TIME_TOOL],
    }
    whole, streamed = post_both(server.base_url, body)
    assert streamed == whole


def test_generic_calls_and_response(engine: ScriptedEngine, server: ThreadedServer) -> None:
    key = script(engine, GENERIC_REPLIES[1])
    body = {
        "model": "fake",
        "messages": [{"role": "user", "content": key}],
        "tools": [WEATHER_TOOL, TIME_TOOL],
    }
    whole, _ = post_both(server.base_url, body)
    assert whole["finish_reason"] == "tool_calls" and whole["content"] is None
    assert [(n, json.loads(a)) for n, a in whole["tool_calls"]] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "CET"}),
    ]
    prompt = engine.prompts[key]
    assert "<tools>" not in prompt  # the template is not given the tools: the system message has them
    assert prompt.startswith("<system>You can call these tools") and '"name": "get_time"' in prompt
    assert '{"response": "<your answer>"}' in prompt
    key = script(engine, GENERIC_REPLIES[2])
    whole, _ = post_both(server.base_url, {**body, "messages": [{"role": "user", "content": key}]})
    assert whole == {
        "content": 'Sunny, 24 \u00b0C \U0001f600 "quoted"\nnext line',
        "reasoning_content": None,
        "tool_calls": [],
        "finish_reason": "stop",
    }


def test_generic_history_and_system_message(engine: ScriptedEngine, server: ThreadedServer) -> None:
    key = script(engine, '{"response": "It is sunny."}')
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": key},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(W)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    body = {"model": "fake", "messages": messages, "tools": [WEATHER_TOOL]}
    whole, _ = post_both(server.base_url, body)
    assert whole["content"] == "It is sunny."
    prompt = engine.prompts[key]
    assert prompt.startswith("<system>Be brief.\n\nYou can call these tools")  # appended to the user's
    assert (
        '<assistant>{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]}'
        in prompt
    )
    tool_response = {"tool_response": {"tool": "get_weather", "content": "sunny", "tool_call_id": "call_1"}}
    assert f"<user>{json.dumps(tool_response)}" in prompt


def test_tool_choice_none_and_forced_stay(engine: ScriptedEngine, server: ThreadedServer) -> None:
    reply = GENERIC_REPLIES[0]
    key = script(engine, reply)
    body = {"model": "fake", "messages": [{"role": "user", "content": key}], "tools": [WEATHER_TOOL]}
    whole, _ = post_both(server.base_url, {**body, "tool_choice": "none"})
    assert whole["content"] == reply and whole["tool_calls"] == []
    assert "You can call these tools" not in engine.prompts[key]
    key = script(engine, '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    body["messages"] = [{"role": "user", "content": key}]
    whole, _ = post_both(server.base_url, {**body, "tool_choice": "required"})
    assert whole["tool_calls"] == [("get_weather", '{"city": "Oslo"}')]


def test_template_format_is_detected(tmp_path: Path) -> None:
    """A template that writes ``<tool_call>`` gets hermes with no flag, and the tools themselves."""
    engine = ScriptedEngine(max_model_len=8192)
    engine.tokenizer.chat_template = "... <tool_call> ..."  # type: ignore[misc]
    args = server_args(tmp_path, tool_call_parser=None, enable_auto_tool_choice=False)
    with ThreadedServer(build_app(engine, args)) as s:
        key = script(
            engine,
            f'Let me check. <tool_call>{{"name": "get_weather", "arguments": {json.dumps(W)}}}</tool_call>',
        )
        body = {"model": "fake", "messages": [{"role": "user", "content": key}], "tools": [WEATHER_TOOL]}
        whole, streamed = post_both(s.base_url, body)
    assert whole == streamed
    assert whole["content"] == "Let me check." and whole["tool_calls"] == [("get_weather", json.dumps(W))]
    assert '<tools>["get_weather"]</tools>' in engine.prompts[key]


@pytest.mark.parametrize(
    "template,name",
    [
        ("{{ '<tool_call>' }}{{ tool | tojson }}", "hermes"),
        ("<|start_header_id|>ipython<|end_header_id|>", "llama3_json"),
        ("{{ '[TOOL_CALLS]' }}", "mistral"),
        ("[func_name1(params_name1=params_value1)]", "pythonic"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
        (None, None),
    ],
)
def test_template_tool_format(template: str | None, name: str | None) -> None:
    assert template_tool_format(template) == name
    parsing = OutputParsing().with_template(template)
    assert parsing.auto_format == (name or "generic")
    # the flag wins over the template
    assert OutputParsing(tool_call_parser="pythonic").with_template(template).auto_format == "pythonic"


def _generic_grammar(**kw: Any) -> Any:
    """The generic format's grammar for the two test tools, as the engine compiles it."""
    import xgrammar as xgr

    tools = [ChatTool.model_validate(WEATHER_TOOL), ChatTool.model_validate(TIME_TOOL)]
    plan = OutputParsing().with_template(None).plan(tools, "auto", kw.pop("parallel", True))
    params = plan.constraint(kw.pop("requested", None), "")
    assert params is not None and params.json is not None
    spec = params.json if isinstance(params.json, str) else json.dumps(params.json)
    return xgr.Grammar.from_json_schema(spec, any_whitespace=False)


def test_generic_grammar_holds_the_reply() -> None:
    schema = _generic_grammar()
    ok = [
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]}',
        '{"tool_calls": [{"name": "get_time", "arguments": {"tz": "UTC"}}, {"name": "get_time", "arguments": {"tz": "CET"}}]}',
        '{"response": "hello"}',
    ]
    bad = [
        "hello",
        '{"tool_calls": [{"name": "nope", "arguments": {}}]}',
        '{"tool_calls": [{"name": "get_weather", "arguments": {"days": 2}}]}',  # city is required
        '{"tool_calls": []}',
        '{"response": "a", "tool_calls": []}',
    ]
    assert all(grammar_accepts(schema, t) for t in ok)
    assert not any(grammar_accepts(schema, t) for t in bad)
    single = _generic_grammar(parallel=False)
    assert not grammar_accepts(single, ok[1]) and grammar_accepts(single, ok[0])
    shaped = _generic_grammar(requested=StructuredOutputsParams(json={"type": "integer"}))
    assert grammar_accepts(shaped, '{"response": 42}') and not grammar_accepts(shaped, '{"response": "x"}')
    with pytest.raises(APIError):
        _generic_grammar(requested=StructuredOutputsParams(regex="a+"))


def test_generic_parser_drops_a_call_cut_before_its_arguments() -> None:
    text = '{"tool_calls": [{"name": "get_time", "arguments": {"tz": "UTC"}}, {"name": "get_ti'
    assert _parse(text, []) == (None, [("get_time", '{"tz": "UTC"}')])
    assert _parse('{"tool_calls": [{"na', []) == ("", [])  # no call, no text


def _parse(text: str, cuts: list[int]) -> tuple[str | None, list[tuple[str, str]]]:
    ids = iter(range(1000))
    parser = GenericToolParser(new_id=lambda: f"call_{next(ids)}")
    msg = ParsedMessage()
    prev = 0
    for c in [*cuts, len(text)]:
        msg.add(parser.feed(text[prev:c]))
        prev = c
    msg.add(parser.finish())
    return msg.content_or_none(), [(c.name, c.arguments) for c in msg.tool_calls]


@pytest.mark.parametrize("text", GENERIC_REPLIES + ['{"response": {"a": [1, 2]}}', '{"other": 1}', '{"resp'])
def test_generic_parser_is_independent_of_the_cuts(text: str) -> None:
    whole = _parse(text, [])
    for i in range(1, len(text)):
        assert _parse(text, [i]) == whole, i
    rng = random.Random(text)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 8))))
        assert _parse(text, cuts) == whole, cuts


# ---------------------------------------------------------------------------------------- real model
def _schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


POOL = {
    "get_weather": _schema(
        {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        ["city", "days"],
    ),
    "get_time": _schema({"tz": {"type": "string", "enum": ["UTC", "CET", "PST"]}}, ["tz"]),
    "add": _schema(
        {
            "a": {"type": "integer", "minimum": -99, "maximum": 99},
            "b": {"type": "integer", "minimum": -99, "maximum": 99},
        },
        ["a", "b"],
    ),
    "search": _schema(
        {
            "query": {"type": "string", "maxLength": 16},
            "limit": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        ["query"],
    ),
    "set_light": _schema(
        {"on": {"type": "boolean"}, "room": {"type": "string", "enum": ["kitchen", "hall"]}}, ["on"]
    ),
}
QUESTIONS = [
    "What is the weather in Paris for the next 3 days?",
    "What time is it in Berlin?",
    "What is 12 plus 30?",
    "Find me a pasta recipe.",
    "Turn on the kitchen light.",
    "Tell me a joke.",
    "Who wrote Hamlet?",
    "Is it raining in Oslo today?",
    "Add 7 and 5, then tell me the time in UTC.",
    "Hello!",
]


def generated_requests(n: int) -> list[dict[str, Any]]:
    """`n` chat requests with tools and no tool_choice: tool subsets, questions, parallel or not, with
    or without a system message (seeded)."""
    rng = random.Random(44)
    out = []
    for i in range(n):
        names = rng.sample(sorted(POOL), rng.randint(1, 3))
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": "You are a helpful assistant."})
        body: dict[str, Any] = {
            "model": "smollm2",
            "messages": messages,
            "tools": [{"type": "function", "function": {"name": n_, "parameters": POOL[n_]}} for n_ in names],
            "max_tokens": 32,
            "temperature": 0,
        }
        if rng.random() < 0.5:
            body["parallel_tool_calls"] = False
        out.append(body)
    return out


@pytest.fixture(scope="module")
def invariant_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    """The default model, no tool flags; batch-invariant so that a request's greedy tokens do not depend
    on what else runs (the streamed and non-streamed copies then produce the same text)."""
    pytest.importorskip("pagedrs._core")
    server = SubprocessServer(
        tmp_path_factory.mktemp("zero-flag"), ["--served-model-name", "smollm2", "--batch-invariant"]
    )
    server.start()
    yield server
    server.kill()


def check_reply(body: dict[str, Any], summary: dict[str, Any]) -> str:
    """Valid calls (names from the request, arguments following the schema; a reply cut by max_tokens
    may end inside its last call) or content; which of the two it was."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in body["tools"]}
    calls = summary["tool_calls"]
    if not calls:
        assert summary["content"], summary
        return "content"
    assert summary["content"] is None, summary
    if body.get("parallel_tool_calls") is False:
        assert len(calls) == 1
    whole = calls[:-1] if summary["finish_reason"] == "length" else calls
    assert summary["finish_reason"] in ("tool_calls", "length"), summary
    assert all(name in schemas for name, _ in calls), summary
    for name, arguments in whole:
        jsonschema.validate(json.loads(arguments), schemas[name])
    return "calls"


def test_generated_requests_on_the_default_model(invariant_server: SubprocessServer) -> None:
    requests = generated_requests(50)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda b: post_both(invariant_server.base_url, b), requests))
    kinds = []
    for body, (whole, streamed) in zip(requests, results, strict=True):
        assert streamed == whole, (body["messages"], whole, streamed)
        kinds.append(check_reply(body, whole))
    assert "calls" in kinds, kinds  # the model does call tools in this format
