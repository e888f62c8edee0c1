"""Tool calling and reasoning on /v1/chat/completions over a fake engine with scripted replies: the
official client reads hermes calls, the streamed reply equals the non-streamed one for many outputs
(well-formed and malformed), the tool-result turn reaches the chat template, and bad tool requests are
400s in OpenAI's shape."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest
from conftest import API_KEY, ThreadedServer
from helpers_tools import (
    TIME_TOOL,
    WEATHER_TOOL,
    ScriptedEngine,
    fold_chat_stream,
    message_summary,
    server_args,
    sse_bodies,
)

from pagedrs.entrypoints.openai.server.app import build_app

AUTH = {"Authorization": f"Bearer {API_KEY}"}
W = '{"city": "Paris", "days": 3}'


@pytest.fixture(scope="module")
def engine() -> ScriptedEngine:
    return ScriptedEngine(max_model_len=4096)


@pytest.fixture(scope="module")
def server(engine: ScriptedEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    args = server_args(tmp_path_factory.mktemp("tools"), reasoning_parser="qwen3")
    with ThreadedServer(build_app(engine, args)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)


def script(engine: ScriptedEngine, reply: str) -> str:
    """A fresh user message whose reply is `reply`."""
    key = f"q-{uuid.uuid4().hex[:12]}"
    engine.scripts[key] = reply
    return key


def test_auto_reads_hermes_calls(engine: ScriptedEngine, client: openai.OpenAI) -> None:
    reply = (
        f'Checking.\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    )
    key = script(engine, reply)
    r = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": key}], tools=[WEATHER_TOOL, TIME_TOOL]
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("get_time", {"tz": "CET"}),
    ]
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls)
    assert len({c.id for c in calls}) == 2
    assert '<tools>["get_weather", "get_time"]</tools>' in engine.prompts[key]


def test_streamed_tool_calls_through_the_client(engine: ScriptedEngine, client: openai.OpenAI) -> None:
    key = script(engine, f'<tool_call>{{"name": "get_weather", "arguments": {W}}}</tool_call>')
    stream = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": key}], tools=[WEATHER_TOOL], stream=True
    )
    first: dict[int, object] = {}
    args = ""
    finish = None
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or []:
            if tc.index not in first:
                first[tc.index] = tc
                assert tc.id and tc.function.name == "get_weather"  # id and name come first
            else:
                assert tc.id is None and not tc.function.name
            args += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert json.loads(args) == {"city": "Paris", "days": 3} and finish == "tool_calls"


REPLIES = [
    "Plain text, no tools at all.",
    f'<tool_call>{{"name": "get_weather", "arguments": {W}}}</tool_call>',
    f'Let me see. <tool_call>{{"name": "get_weather", "arguments": {W}}}</tool_call>\n<tool_call>{{"name": "get_time", "arguments": {{"tz": "UTC"}}}}</tool_call>',
    '<tool_call>{"arguments": {"tz": "UTC"}, "name": "get_time"}</tool_call>',
    "<tool_call>not json at all</tool_call> then text",
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
    '<tool_call>{"name": "get_weath',
    "<think>The user wants weather.</think>\n"
    f'<tool_call>{{"name": "get_weather", "arguments": {W}}}</tool_call>',
    "<think>Only thinking, cut off",
    "<think>x</think>Answer: 2 < 3 and <tool_c",
    'Unicode: caf\u00e9 \u2603 <tool_call>{"name": "get_time", "arguments": {"tz": "\u00e9"}}</tool_call>',
]


@pytest.mark.parametrize("reply", REPLIES)
def test_streamed_equals_non_streamed(engine: ScriptedEngine, server: ThreadedServer, reply: str) -> None:
    key = script(engine, reply)
    body = {
        "model": "fake",
        "messages": [{"role": "user", "content": key}],
        "tools": [WEATHER_TOOL, TIME_TOOL],
        "max_tokens": 1000,
    }
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=30) as http:
        whole = http.post("/v1/chat/completions", json=body)
        streamed = http.post("/v1/chat/completions", json={**body, "stream": True})
    assert whole.status_code == 200 and streamed.status_code == 200
    summary = message_summary(whole.json())
    assert fold_chat_stream(sse_bodies(streamed.text)) == summary
    # nothing of the reply is lost or invented: the text is content, reasoning or call markup
    texts = [summary["content"] or "", summary["reasoning_content"] or ""]
    texts += [name + args for name, args in summary["tool_calls"]]
    assert all(t in reply or t.replace(" ", "") in reply.replace(" ", "") for t in texts[:2])


def test_tool_result_turn_reaches_the_template(engine: ScriptedEngine, client: openai.OpenAI) -> None:
    key = script(engine, "It is sunny in Paris.")
    r = client.chat.completions.create(
        model="fake",
        tools=[WEATHER_TOOL],
        messages=[
            {"role": "user", "content": key},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": W}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
        ],
    )
    assert r.choices[0].message.content == "It is sunny in Paris." and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.tool_calls in (None, [])
    prompt = engine.prompts[key]
    # the arguments reach the template as an object, the result with its call id
    assert '<call>{"arguments": {"city": "Paris", "days": 3}, "name": "get_weather"}</call>' in prompt
    assert '<tool>{"sky": "sunny"}<id>call_1</id>' in prompt


def test_tool_choice_none_renders_no_tools_and_reads_no_calls(
    engine: ScriptedEngine, client: openai.OpenAI
) -> None:
    reply = f'<tool_call>{{"name": "get_weather", "arguments": {W}}}</tool_call>'
    key = script(engine, reply)
    r = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": key}], tools=[WEATHER_TOOL], tool_choice="none"
    )
    assert r.choices[0].message.content == reply and not r.choices[0].message.tool_calls
    assert "<tools>" not in engine.prompts[key]


def test_parallel_tool_calls_false(engine: ScriptedEngine, client: openai.OpenAI) -> None:
    key = script(engine, REPLIES[2])
    r = client.chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": key}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        parallel_tool_calls=False,
    )
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]


def test_required_and_named_read_the_forced_output(engine: ScriptedEngine, client: openai.OpenAI) -> None:
    key = script(engine, f'[{{"name": "get_weather", "parameters": {W}}}]')
    r = client.chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": key}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
    )
    assert r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls] == [
        ("get_weather", W)
    ]
    key = script(engine, W)
    r = client.chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": key}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert r.choices[0].finish_reason == "stop"  # a named choice stops, as OpenAI's
    assert [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls] == [
        ("get_weather", W)
    ]


def test_reasoning_content(engine: ScriptedEngine, client: openai.OpenAI) -> None:
    key = script(engine, "<think>2 and 2 make 4.</think>\n\nFour.")
    r = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": key}])
    msg = r.choices[0].message
    assert msg.content == "Four." and msg.model_extra["reasoning_content"] == "2 and 2 make 4."


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools"),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ],
)
def test_bad_tool_requests_are_400(server: ThreadedServer, body: dict[str, object], param: str) -> None:
    req = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], **body}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=req, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_serve_flags_reach_the_chat_server() -> None:
    from pagedrs.entrypoints.cli_args import ServerArgs, make_serve_parser
    from pagedrs.entrypoints.openai.chat.output import OutputParsing

    ns = make_serve_parser().parse_args(
        ["--tool-call-parser", "llama4_pythonic", "--enable-auto-tool-choice", "--reasoning-parser", "qwen3"]
    )
    parsing = OutputParsing.from_args(ServerArgs.from_namespace(ns))
    assert parsing == OutputParsing("llama4_pythonic", True, "qwen3")
    assert (
        OutputParsing.from_args(ServerArgs.from_namespace(make_serve_parser().parse_args([])))
        == OutputParsing()
    )
    with pytest.raises(SystemExit):  # argparse: not a parser name
        make_serve_parser().parse_args(["--tool-call-parser", "nope"])
    with pytest.raises(ValueError, match="--tool-call-parser"):
        OutputParsing(enable_auto_tool_choice=True)
