"""Forced tool choices on the real default model (CPU) with the official client: the grammar engine
makes `required` and a named function produce calls whose arguments validate against the function's
schema, streamed the same as not; the tool-result turn goes through the model's chat template."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from conftest import SubprocessServer

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "Current time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def client(real_server: SubprocessServer) -> openai.OpenAI:
    return real_server.client()


def _calls(message: object) -> list[tuple[str, dict[str, object]]]:
    calls = getattr(message, "tool_calls", None) or []
    out = []
    for c in calls:
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append((c.function.name, args))
    return out


def test_required_calls_validate(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="smollm2",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = _calls(choice.message)
    assert len(calls) == 1 and choice.message.content is None
    stream = client.chat.completions.create(
        model="smollm2",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
        stream=True,
    )
    names, args, finish = [], "", None
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or []:
            if tc.function.name:
                names.append(tc.function.name)
            args += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (names, args, finish) == (
        [choice.message.tool_calls[0].function.name],
        choice.message.tool_calls[0].function.arguments,
        "tool_calls",
    )


def test_named_function_arguments_validate(client: openai.OpenAI) -> None:
    for temperature in (0.0, 1.0):
        r = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What time is it in Berlin?"}],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            max_tokens=30,
            temperature=temperature,
            seed=7,
        )
        assert r.choices[0].finish_reason == "stop"
        assert [name for name, _ in _calls(r.choices[0].message)] == ["get_time"]


def test_tool_result_turn(client: openai.OpenAI) -> None:
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "Sunny, 24 C, all three days."},
    ]
    r = client.chat.completions.create(
        model="smollm2", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=12, temperature=0
    )
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert r.usage.prompt_tokens > 40  # the call and its result are in the prompt
