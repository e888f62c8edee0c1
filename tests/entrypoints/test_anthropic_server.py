"""The official `anthropic` SDK against the server on the default model, with no flags: greedy
`messages.create` says what the chat endpoint says for the same conversation, `messages.stream` equals it,
a forced `tool_use` -> `tool_result` round trip, and `count_tokens` equals the prompt the engine ran."""

from __future__ import annotations

import json
from typing import Any

import anthropic
from conftest import SubprocessServer

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CONVERSATION: Any = [{"role": "user", "content": "Name three colours."}]


def client(server: SubprocessServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=server.base_url, api_key=server.api_key or "none", max_retries=0, timeout=120
    )


def test_greedy_message_equals_the_chat_reply_and_the_stream(real_server: SubprocessServer) -> None:
    c = client(real_server)
    kwargs: Any = dict(
        model="smollm2",
        max_tokens=24,
        extra_body={"temperature": 0.0},
        system="Answer briefly.",
        messages=CONVERSATION,
    )
    msg = c.messages.create(**kwargs)
    with real_server.http() as http:
        chat = http.post(
            "/v1/chat/completions",
            json={
                "model": "smollm2",
                "max_tokens": 24,
                "temperature": 0.0,
                "messages": [{"role": "system", "content": "Answer briefly."}, *CONVERSATION],
            },
        ).json()
    (block,) = msg.content
    assert block.type == "text" and block.text == chat["choices"][0]["message"]["content"]
    assert msg.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert (
        msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat["choices"][0]["finish_reason"]]
    )
    with c.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == block.text and final.content[0].text == block.text and final.stop_reason == msg.stop_reason
    counted = c.messages.count_tokens(model="smollm2", system="Answer briefly.", messages=CONVERSATION)
    assert counted.input_tokens == chat["usage"]["prompt_tokens"]


def test_forced_tool_use_and_tool_result(real_server: SubprocessServer) -> None:
    c = client(real_server)
    question: Any = {"role": "user", "content": "What is the weather in Paris?"}
    first = c.messages.create(
        model="smollm2",
        max_tokens=64,
        extra_body={"temperature": 0.0},
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[question],
    )
    assert first.stop_reason == "tool_use"
    call = next(b for b in first.content if b.type == "tool_use")
    assert call.name == "get_weather" and isinstance(call.input, dict) and "city" in call.input
    second = c.messages.create(
        model="smollm2",
        max_tokens=16,
        extra_body={"temperature": 0.0},
        tools=[WEATHER],
        messages=[
            question,
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}],
            },
        ],
    )
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use") and second.usage.output_tokens > 0
    assert second.usage.input_tokens + (second.usage.cache_read_input_tokens or 0) > first.usage.input_tokens


def test_output_config_format_is_followed(real_server: SubprocessServer) -> None:
    schema = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}
    msg = client(real_server).messages.create(
        model="smollm2",
        max_tokens=40,
        messages=[{"role": "user", "content": "Give a colour as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body={"temperature": 0.0},
    )
    value = json.loads(msg.content[0].text)
    assert isinstance(value, dict) and isinstance(value["colour"], str)
