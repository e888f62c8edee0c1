"""Request validation and the error shape (no engine needed)."""

from __future__ import annotations

import json

import pytest

from pagedrs.entrypoints.openai.chat.protocol import ChatCompletionRequest
from pagedrs.entrypoints.openai.completions.protocol import CompletionRequest
from pagedrs.entrypoints.openai.errors import APIError
from pagedrs.entrypoints.openai.protocol import parse_body


def _err(model: type, body: object) -> APIError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(APIError) as info:
        parse_body(model, raw)
    err = info.value
    shape = err.body()["error"]
    assert set(shape) == {"message", "type", "param", "code"}
    assert err.status == 400
    return err


def test_invalid_json_and_non_object() -> None:
    assert "Invalid JSON" in _err(CompletionRequest, b"{nope").message
    assert "JSON object" in _err(CompletionRequest, [1, 2]).message
    assert "JSON object" in _err(CompletionRequest, b'"text"').message
    _err(CompletionRequest, b"[" * 100000)  # too deep: still a 400, not a crash


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("n", 0),
        ("n", 1000),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("presence_penalty", 3),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("seed", -1),
        ("logprobs", 21),
        ("logprobs", -1),
        ("stop", [""]),
        ("stop", ["a"] * 17),
        ("min_tokens", -1),
        ("stream", "yes"),
        ("echo", []),
        ("logit_bias", {"abc": 1}),
        ("logit_bias", {"5": 500}),
        ("stop_token_ids", [-1]),
        ("stream_options", {"include_usage": True}),
    ],
)
def test_each_bad_sampling_field_names_param(field: str, value: object) -> None:
    err = _err(CompletionRequest, {"model": "m", "prompt": "hi", field: value})
    assert err.param is not None and err.param.startswith(field), (err.param, err.message)


def test_float_nan_rejected() -> None:
    err = _err(CompletionRequest, b'{"prompt": "x", "temperature": NaN}')
    assert err.param == "temperature"


@pytest.mark.parametrize("prompt", ["", [], [[]], [""], ["ok", ""]])
def test_empty_prompt(prompt: object) -> None:
    err = _err(CompletionRequest, {"prompt": prompt})
    assert err.param is not None and err.param.startswith("prompt")


def test_prompt_forms() -> None:
    assert parse_body(CompletionRequest, b'{"prompt": "a"}').prompts() == ["a"]
    assert parse_body(CompletionRequest, b'{"prompt": ["a", "b"]}').prompts() == ["a", "b"]
    assert parse_body(CompletionRequest, b'{"prompt": [1, 2]}').prompts() == [[1, 2]]
    assert parse_body(CompletionRequest, b'{"prompt": [[1], [2, 3]]}').prompts() == [[1], [2, 3]]
    err = _err(CompletionRequest, {"prompt": [1, "a"]})
    assert err.param is not None and err.param.startswith("prompt")
    assert _err(CompletionRequest, {"prompt": [-1]}).param.startswith("prompt")  # type: ignore[union-attr]
    assert _err(CompletionRequest, {}).param == "prompt"


def test_chat_validation() -> None:
    ok = parse_body(
        ChatCompletionRequest,
        json.dumps(
            {
                "messages": [
                    {"role": "developer", "content": "be brief"},
                    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                ],
                "max_completion_tokens": 3,
            }
        ).encode(),
    )
    assert ok.chat_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert ok.requested_max_tokens() == 3
    assert _err(ChatCompletionRequest, {"messages": []}).param == "messages"
    assert (
        _err(ChatCompletionRequest, {"messages": [{"role": "robot", "content": "x"}]}).param
        == "messages[0].role"
    )
    assert (
        _err(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}).param
        == "top_logprobs"
    )
    assert (
        _err(
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 50, "logprobs": True},
        ).param
        == "top_logprobs"
    )
    assert (
        _err(
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        ).param
        == "max_completion_tokens"
    )


def test_unknown_fields_ignored() -> None:
    req = parse_body(CompletionRequest, b'{"prompt": "x", "whatever": {"a": 1}}')
    assert req.prompt == "x"
