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
