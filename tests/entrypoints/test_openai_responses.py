"""/v1/responses on the real default model (CPU) with the official client: text.format json_schema
validates, and a streamed response ends with the same output as the non-streamed one (greedy)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from conftest import SubprocessServer

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(real_server: SubprocessServer) -> openai.OpenAI:
    return real_server.client()


def test_json_schema_text_format(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model="smollm2",
        instructions="Answer in JSON.",
        input="Is it sunny in Paris?",
        text={"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}},
        max_output_tokens=40,
        temperature=0,
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


def test_stream_equals_create(client: openai.OpenAI) -> None:
    kwargs = {"model": "smollm2", "input": "Name a color.", "max_output_tokens": 12, "temperature": 0}
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1]  # response.completed, or response.incomplete when max_output_tokens cut it
    assert last.type == ("response.completed" if whole.status == "completed" else "response.incomplete")
    final = last.response
    assert deltas == final.output_text == whole.output_text and whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == whole.output_text


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="smollm2", input="My name is Ada. Say hello.", max_output_tokens=8, temperature=0
    )
    second = client.responses.create(
        model="smollm2",
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0,
    )
    alone = client.responses.create(
        model="smollm2", input="What is my name?", max_output_tokens=8, temperature=0
    )
    assert second.previous_response_id == first.id
    # the earlier turn and its reply are in the prompt
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [i.role for i in items] == ["user", "assistant", "user"]
    assert items[1].content[0].text == first.output_text


def test_output_text_logprobs_equal_chats(client: openai.OpenAI) -> None:
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: one entry per sampled token,
    the same tokens and logprobs as chat completions gives for the same greedy request; streamed, the
    deltas' logprobs add up to the final message's."""
    include = ["message.output_text.logprobs"]
    kwargs = {"model": "smollm2", "input": "Name a fruit.", "max_output_tokens": 10, "temperature": 0}
    r = client.responses.create(**kwargs, include=include, top_logprobs=2)
    part = r.output[-1].content[0]
    assert len(part.logprobs) == r.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
    chat = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Name a fruit."}],
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert chat.choices[0].message.content == r.output_text
    want = chat.choices[0].logprobs.content
    assert [lp.token for lp in part.logprobs] == [lp.token for lp in want]
    assert [lp.logprob for lp in part.logprobs] == pytest.approx([lp.logprob for lp in want], abs=1e-4)
    assert [[t.token for t in lp.top_logprobs] for lp in part.logprobs] == [
        [t.token for t in lp.top_logprobs] for lp in want
    ]
    with client.responses.stream(**kwargs, include=include, top_logprobs=2) as stream:
        events = list(stream)
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    final = [lp.token for lp in events[-1].response.output[-1].content[0].logprobs]
    assert [lp.token for lp in done.logprobs] == final == [lp.token for lp in part.logprobs]
    # the deltas carry the tokens whose text they bring; a token without text (EOS) comes at the end
    assert final[: len(streamed)] == streamed and len(final) - len(streamed) <= 1
    # without include: no logprobs
    plain = client.responses.create(**kwargs)
    assert not plain.output[-1].content[0].logprobs
