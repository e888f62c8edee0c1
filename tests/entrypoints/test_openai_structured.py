"""Structured outputs through the server with the official `openai` client: response_format json_schema
(strict) on chat, streaming and not; `chat.completions.parse` with a pydantic model; vLLM's guided_*
fields on completions; bad constraints are 400 naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest
from conftest import SubprocessServer

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        "coastal": {"type": "boolean"},
    },
    "required": ["city", "population", "coastal"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe Paris as JSON."}]


@pytest.fixture(scope="module")
def client(real_server: SubprocessServer) -> openai.OpenAI:
    return real_server.client()


def test_json_schema_chat_streaming_and_not(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="smollm2", messages=MESSAGES, max_tokens=120, temperature=0, response_format=RESPONSE_FORMAT
    )
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    stream = client.chat.completions.create(
        model="smollm2",
        messages=MESSAGES,
        max_tokens=120,
        temperature=0,
        response_format=RESPONSE_FORMAT,
        stream=True,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == text


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    class City(pydantic.BaseModel):
        city: str
        population: int
        coastal: bool

    completions = (
        client.chat.completions if hasattr(client.chat.completions, "parse") else client.beta.chat.completions
    )
    r = completions.parse(
        model="smollm2", messages=MESSAGES, max_tokens=120, temperature=0, response_format=City
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City)


def test_guided_fields_on_completions(client: openai.OpenAI) -> None:
    choice = client.completions.create(
        model="smollm2",
        prompt="The sky is",
        max_tokens=10,
        temperature=0,
        extra_body={"guided_choice": ["blue", "green"]},
    )
    assert choice.choices[0].text in ("blue", "green")
    regex = client.completions.create(
        model="smollm2",
        prompt="A year:",
        max_tokens=10,
        temperature=0,
        extra_body={"guided_regex": r"(19|20)\d{2}"},
    )
    assert re.fullmatch(r"(19|20)\d{2}", regex.choices[0].text)
    obj = client.completions.create(
        model="smollm2",
        prompt="JSON:",
        max_tokens=120,
        temperature=0,
        extra_body={"guided_json": SCHEMA},
    )
    jsonschema.validate(json.loads(obj.choices[0].text), SCHEMA)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_json": {"type": "nope"}}, "guided_json"),
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ],
)
def test_bad_constraints_are_400(real_server: SubprocessServer, extra: dict, param: str) -> None:
    with real_server.http() as http:
        body = {"model": "smollm2", "messages": MESSAGES, "max_tokens": 5, **extra}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        ok = http.post(
            "/v1/chat/completions", json={"model": "smollm2", "messages": MESSAGES, "max_tokens": 2}
        )
        assert ok.status_code == 200


def test_structured_lines_in_a_batch(client: openai.OpenAI) -> None:
    import io

    from conftest import wait_until

    rows = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "smollm2",
                "messages": MESSAGES,
                "max_tokens": 120,
                "response_format": RESPONSE_FORMAT,
            },
        }
        for i in range(2)
    ]
    text = "\n".join(json.dumps(r) for r in rows) + "\n"
    f = client.files.create(file=("s.jsonl", io.BytesIO(text.encode())), purpose="batch")
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_until(
        lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, timeout=180
    )
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines() if x.strip()]
    assert len(out) == 2
    for line in out:
        content = line["response"]["body"]["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(content), SCHEMA)
