"""Structured outputs on the default model: 30 JSON schemas x 3 prompts all parse and validate
(jsonschema), regex outputs fullmatch, choices are members, json_object parses; greedy structured output
with chunked prefill and preemption forced equals the unforced run; bad constraints are ValueErrors
naming the field and the engine keeps serving."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from pagedrs import LLM, SamplingParams
from pagedrs.structured_outputs import GuidedDecodingParams, StructuredOutputsParams
from tests.engine.conftest import PlanSpy

PROMPTS = ["Return a JSON record:", "Here is the data as JSON:", "Output:"]


def schemas() -> list[dict[str, Any]]:
    """30 schemas: nested objects, arrays with min/max items, enums, bounded numbers, required,
    additionalProperties false."""
    s: list[dict[str, Any]] = []
    name = {"type": "string", "maxLength": 12}
    for i in range(30):
        props: dict[str, Any] = {"id": {"type": "integer", "minimum": i, "maximum": i + 50}}
        if i % 2 == 0:
            props["name"] = name
        if i % 3 == 0:
            props["tags"] = {
                "type": "array",
                "items": {"type": "string", "maxLength": 6},
                "minItems": 1,
                "maxItems": 3,
            }
        if i % 4 == 0:
            props["color"] = {"enum": ["red", "green", "blue"]}
        if i % 5 == 0:
            props["score"] = {"type": "number", "minimum": 0, "maximum": 10}
        if i % 6 == 0:
            props["owner"] = {
                "type": "object",
                "properties": {"first": name, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                "required": ["first", "age"],
                "additionalProperties": False,
            }
        if i % 7 == 0:
            props["active"] = {"type": "boolean"}
        if i % 8 == 0:
            props["points"] = {
                "type": "array",
                "items": {"type": "integer", "minimum": -5, "maximum": 5},
                "minItems": 2,
                "maxItems": 2,
            }
        s.append(
            {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}
        )
    return s


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    engine = LLM(device="cpu", dtype="float32", max_model_len=512, disable_log_stats=True)
    yield engine
    engine.shutdown()


def _greedy(so: StructuredOutputsParams, max_tokens: int = 160, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so, **kw)


def test_30_json_schemas_parse_and_validate(llm: LLM) -> None:
    all_schemas = schemas()
    prompts, params = [], []
    for schema in all_schemas:
        for p in PROMPTS:
            prompts.append(p)
            params.append(_greedy(StructuredOutputsParams(json=schema)))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, out in enumerate(outs):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", (i, text)
        jsonschema.validate(json.loads(text), all_schemas[i // len(PROMPTS)])


def test_regex_choice_json_object_and_grammar(llm: LLM) -> None:
    regex = r"[A-Z][a-z]{2,8} \d{2}"
    choice = ["positive", "negative", "neutral"]
    grammar = 'root ::= "yes" | "no" | "maybe"'
    params = [
        _greedy(StructuredOutputsParams(regex=regex)),
        _greedy(StructuredOutputsParams(choice=choice)),
        _greedy(StructuredOutputsParams(json_object=True), max_tokens=400),
        _greedy(StructuredOutputsParams(grammar=grammar)),
        SamplingParams(
            temperature=0.8, seed=3, n=2, max_tokens=40, guided_decoding=GuidedDecodingParams(choice=choice)
        ),
    ]
    outs = llm.generate(
        [
            "A name and age:",
            "Sentiment of 'I love it':",
            'The point {"x": 1, "y": 2} as JSON:',
            "Answer:",
            "Mood:",
        ],
        params,
        use_tqdm=False,
    )
    assert re.fullmatch(regex, outs[0].outputs[0].text)
    assert outs[1].outputs[0].text in choice
    assert isinstance(json.loads(outs[2].outputs[0].text), dict)
    assert outs[3].outputs[0].text in ("yes", "no", "maybe")
    assert len(outs[4].outputs) == 2 and all(c.text in choice for c in outs[4].outputs)


def test_forced_chunking_and_preemption_equal_the_plain_run(llm: LLM) -> None:
    schema = schemas()[6]
    prompts = ["Return a JSON record: " + "x " * 40, "Output:", "Here is the data as JSON:", "Another one:"]
    params = _greedy(StructuredOutputsParams(json=schema))
    want = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    small = LLM(
        device="cpu",
        dtype="float32",
        max_model_len=512,
        disable_log_stats=True,
        block_size=4,
        num_kv_blocks=40,
        max_num_batched_tokens=16,
    )
    spy = PlanSpy().attach(small.llm_engine)
    got = [o.outputs[0].text for o in small.generate(prompts, params, use_tqdm=False)]
    assert spy.chunked_prefills > 0 and spy.preemptions > 0
    assert got == want
    small.shutdown()


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"json": {"type": "nope"}}, "invalid json"),
        ({"regex": "a(b"}, "invalid regex"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"json": {"type": "object"}, "regex": "a"}, "exactly one of"),
        ({}, "exactly one of"),
        ({"grammar": "root ::= "}, "invalid grammar"),
    ],
)
def test_bad_constraints_are_value_errors(llm: LLM, kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        so = StructuredOutputsParams(**kwargs)
        llm.generate("x", _greedy(so), use_tqdm=False)
    assert llm.generate("still serving", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
