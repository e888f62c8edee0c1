"""The Anthropic Messages API over a fake engine with scripted replies, through the official `anthropic`
SDK: text, thinking and tool_use blocks, the streamed reply equal to the whole one for many outputs, a
tool_use -> tool_result round trip reaching the chat template, count_tokens, stop sequences, and bad input
as 400s in Anthropic's error shape."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from conftest import API_KEY, ThreadedServer
from helpers_tools import ScriptedEngine, server_args, sse_bodies

from pagedrs.entrypoints.openai.server.app import build_app

W = '{"city": "Paris", "days": 3}'
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}}}


@pytest.fixture(scope="module")
def engine() -> ScriptedEngine:
    return ScriptedEngine(max_model_len=4096)


@pytest.fixture(scope="module")
def server(engine: ScriptedEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    args = server_args(tmp_path_factory.mktemp("anthropic"), reasoning_parser="qwen3")
    with ThreadedServer(build_app(engine, args)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ThreadedServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=30)


def script(engine: ScriptedEngine, reply: str) -> str:
    key = f"q-{uuid.uuid4().hex[:12]}"
    engine.scripts[key] = reply
    return key


def test_text_reply(engine: ScriptedEngine, client: anthropic.Anthropic, server: ThreadedServer) -> None:
    key = script(engine, "Hello there.")
    msg = client.messages.create(
        model="fake", max_tokens=100, system="Be brief.", messages=[{"role": "user", "content": key}]
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "fake"
    assert [(b.type, b.text) for b in msg.content] == [("text", "Hello there.")]
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert engine.prompts[key].index("Be brief.") < engine.prompts[key].index(key)  # system first
    # the same conversation on the chat endpoint: same prompt, same reply, same token counts
    chat = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={
            "model": "fake",
            "max_tokens": 100,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": key}],
        },
        timeout=30,
    ).json()
    assert chat["choices"][0]["message"]["content"] == "Hello there."
    assert msg.usage.output_tokens == chat["usage"]["completion_tokens"]
    prompt_tokens = msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
    assert prompt_tokens == chat["usage"]["prompt_tokens"]


def test_tool_use_then_tool_result(engine: ScriptedEngine, client: anthropic.Anthropic) -> None:
    key = script(engine, f'Checking.<tool_call>{{"name": "get_weather", "arguments": {W}}}</tool_call>')
    msg = client.messages.create(
        model="fake", max_tokens=200, tools=[WEATHER, TIME], messages=[{"role": "user", "content": key}]
    )
    assert msg.stop_reason == "tool_use"
    text, call = msg.content
    assert text.type == "text" and text.text == "Checking."
    assert (
        call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Paris", "days": 3}
    )
    follow = script(engine, "It is sunny in Paris.")
    reply = client.messages.create(
        model="fake",
        max_tokens=200,
        tools=[WEATHER, TIME],
        messages=[
            {"role": "user", "content": key},
            {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"},
                    {"type": "text", "text": follow},
                ],
            },
        ],
    )
    assert reply.content[0].text == "It is sunny in Paris." and reply.stop_reason == "end_turn"
    prompt = engine.prompts[follow]
    assert "sunny, 21 C" in prompt and "get_weather" in prompt  # the result and the call reached the template
    assert prompt.index("sunny, 21 C") < prompt.index(follow)


REPLIES = [
    "Plain text, no tools at all.",
    f'{{"name": "get_weather", "arguments": {W}}}',
    f'<think>Weather.</think>\n```json\n[{{"name": "get_weather", "arguments": {W}}}]\n```',
    '{"name": "send_email", "arguments": {"to": "x"}}',
    f'<tool_call>{{"name": "get_weather", "arguments": {W}}}</tool_call>',
    f'Let me see. <tool_call>{{"name": "get_weather", "arguments": {W}}}</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>',
    "<tool_call>not json at all</tool_call> then text",
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
    f'<think>The user wants weather.</think>\n<tool_call>{{"name": "get_weather", "arguments": {W}}}</tool_call>',
    "<think>Only thinking, cut off",
    "<think>x</think>Answer: 2 < 3 and <tool_c",
    'Unicode: caf\u00e9 \u2603 <tool_call>{"name": "get_time", "arguments": {"tz": "\u00e9"}}</tool_call>',
]


def summary(blocks: list[Any]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for b in blocks:
        b = b if isinstance(b, dict) else b.model_dump()
        if b["type"] == "tool_use":
            out.append(("tool_use", b["name"], b["input"]))
        else:
            out.append((b["type"], b[b["type"]]))
    return out


@pytest.mark.parametrize("reply", REPLIES)
def test_streamed_equals_non_streamed(
    engine: ScriptedEngine, client: anthropic.Anthropic, reply: str
) -> None:
    key = script(engine, reply)
    kwargs: Any = dict(
        model="fake", max_tokens=1000, tools=[WEATHER, TIME], messages=[{"role": "user", "content": key}]
    )
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        kinds = [ev.type for ev in stream]
        streamed = stream.get_final_message()
    assert summary(streamed.content) == summary(whole.content)
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (
        whole.stop_reason,
        whole.usage.output_tokens,
    )
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == len(whole.content)
    if "<think>" in reply:
        assert whole.content[0].type == "thinking"


def test_stream_event_order(engine: ScriptedEngine, server: ThreadedServer) -> None:
    key = script(engine, "<think>hm</think>Hi")
    body = {"model": "fake", "max_tokens": 50, "stream": True, "messages": [{"role": "user", "content": key}]}
    r = httpx.post(f"{server.base_url}/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    names = [line[len("event: ") :] for line in r.text.splitlines() if line.startswith("event: ")]
    datas = sse_bodies(r.text)
    assert names == [d["type"] for d in datas]
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        *["content_block_delta"] * (len(names) - 8),
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert datas[1]["content_block"]["type"] == "thinking" and datas[4]["content_block"]["type"] == "text"
    assert datas[-2]["delta"]["stop_reason"] == "end_turn"


def test_stop_sequence(engine: ScriptedEngine, client: anthropic.Anthropic) -> None:
    key = script(engine, "one two STOP three")
    msg = client.messages.create(
        model="fake", max_tokens=100, stop_sequences=["STOP"], messages=[{"role": "user", "content": key}]
    )
    assert (
        msg.content[0].text == "one two "
        and msg.stop_reason == "stop_sequence"
        and msg.stop_sequence == "STOP"
    )


def test_max_tokens_stop_reason(engine: ScriptedEngine, client: anthropic.Anthropic) -> None:
    key = script(engine, "a long reply that will be cut")
    msg = client.messages.create(model="fake", max_tokens=4, messages=[{"role": "user", "content": key}])
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 4


def test_count_tokens_is_the_prompt(engine: ScriptedEngine, client: anthropic.Anthropic) -> None:
    key = script(engine, "ok")
    messages: Any = [{"role": "user", "content": key}]
    counted = client.messages.count_tokens(model="fake", messages=messages, tools=[WEATHER], system="Sys.")
    msg = client.messages.create(
        model="fake", max_tokens=10, messages=messages, tools=[WEATHER], system="Sys."
    )
    assert counted.input_tokens == len(engine.prompts[key])
    assert counted.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)


def test_beta_client_and_tool_choice(engine: ScriptedEngine, client: anthropic.Anthropic) -> None:
    key = script(engine, '{"city": "Rome"}')
    msg = client.beta.messages.create(
        model="fake",
        max_tokens=100,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": key}],
    )
    assert msg.stop_reason == "tool_use"
    (call,) = msg.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Rome"}


BAD = [
    ({"max_tokens": -1}, "max_tokens"),
    (
        {"max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "bogus", "text": "x"}]}]},
        "bogus",
    ),
    (
        {
            "max_tokens": 10,
            "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}],
        },
        "toolu_1",
    ),
    ({"max_tokens": 10, "tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, "nope"),
    ({"max_tokens": 10, "model": "not-served"}, "not-served"),
]


@pytest.mark.parametrize(("patch", "named"), BAD)
def test_bad_input_is_400_in_anthropic_shape(
    server: ThreadedServer, patch: dict[str, Any], named: str
) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], **patch}
    r = httpx.post(f"{server.base_url}/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=30)
    assert r.status_code in (400, 404), r.text
    err = r.json()
    assert err["type"] == "error" and named in err["error"]["message"], err
    assert err["error"]["type"] == ("not_found_error" if r.status_code == 404 else "invalid_request_error")


def test_sdk_raises_on_bad_request_and_auth(server: ThreadedServer, client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="fake", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as auth:
        wrong.messages.create(model="fake", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert auth.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    # the OpenAI routes keep OpenAI's shape
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions", json={"model": "fake"}, headers={"x-api-key": API_KEY}
    )
    assert r.status_code == 400 and "param" in r.json()["error"]


def test_bare_json_reply_is_a_call_on_both_endpoints(engine: ScriptedEngine, server: ThreadedServer) -> None:
    """A small model's bare JSON call (no template markup) is a tool call on /v1/chat/completions and
    /v1/messages, streamed or not."""
    key = script(engine, f'{{"name": "get_weather", "arguments": {W}}}')
    chat_tool = {
        "type": "function",
        "function": {"name": WEATHER["name"], "parameters": WEATHER["input_schema"]},
    }
    body = {"model": "fake", "max_tokens": 200, "messages": [{"role": "user", "content": key}]}
    with httpx.Client(base_url=server.base_url, headers={"x-api-key": API_KEY}, timeout=30) as http:
        chat = http.post("/v1/chat/completions", json=body | {"tools": [chat_tool]}).json()
        streamed = sse_bodies(
            http.post("/v1/chat/completions", json=body | {"tools": [chat_tool], "stream": True}).text
        )
        message = http.post("/v1/messages", json=body | {"tools": [WEATHER]}).json()
    choice = chat["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(
        call["function"]["arguments"]
    ) == json.loads(W)
    args = "".join(
        tc["function"].get("arguments") or ""
        for c in streamed
        for ch in c["choices"]
        for tc in ch["delta"].get("tool_calls") or []
    )
    assert json.loads(args) == json.loads(W)
    assert message["stop_reason"] == "tool_use" and message["content"][0]["input"] == json.loads(W)
