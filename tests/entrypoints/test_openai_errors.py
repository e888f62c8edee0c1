"""Every bad input gets its status and OpenAI's error shape, and the server stays healthy: a good
request succeeds right after each one (real engine, subprocess server)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import API_KEY, SubprocessServer

GOOD = {"model": "smollm2", "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def http(real_server: SubprocessServer) -> Iterator[httpx.Client]:
    with real_server.http() as c:
        yield c


def _check(http: httpx.Client, r: httpx.Response, status: int, param: str | None = "*") -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "*":
        assert err["param"] == param, err
    ok = http.post("/v1/completions", json=GOOD)
    assert ok.status_code == 200, ok.text
    assert http.get("/health").status_code == 200
    return err


def _raw(http: httpx.Client, path: str, data: bytes) -> httpx.Response:
    return http.post(path, content=data, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/batches"])
def test_invalid_json_and_non_object(http: httpx.Client, path: str) -> None:
    _check(http, _raw(http, path, b'{"prompt": "x",'), 400)
    _check(http, _raw(http, path, b'["not", "an", "object"]'), 400)
    _check(http, _raw(http, path, b""), 400)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1),
        ("temperature", "hot"),
        ("top_p", 0),
        ("top_p", 2),
        ("top_k", -5),
        ("min_p", -0.5),
        ("n", 0),
        ("n", 10_000),
        ("max_tokens", 0),
        ("presence_penalty", 5),
        ("frequency_penalty", -5),
        ("repetition_penalty", -1),
        ("seed", "x"),
        ("logprobs", 100),
        ("stop", 5),
        ("stop", [""]),
        ("min_tokens", -1),
        ("logit_bias", {"999999": 1}),
        ("stop_token_ids", [10**9]),
        ("ignore_eos", "yes"),
        ("stream", 3),
    ],
)
def test_each_invalid_sampling_field(http: httpx.Client, field: str, value: Any) -> None:
    err = _check(http, http.post("/v1/completions", json={**GOOD, field: value}), 400)
    assert err["param"] is not None and err["param"].startswith(field), err
    err = _check(http, http.post("/v1/chat/completions", json={**CHAT, field: value}), 400)
    assert err["param"] is not None and err["param"].startswith(field), err


def test_too_long_names_both_numbers(http: httpx.Client) -> None:
    err = _check(http, http.post("/v1/completions", json={**GOOD, "max_tokens": 600}), 400, "max_tokens")
    assert "512" in err["message"] and "600" in err["message"]
    long_prompt = "hello " * 600
    err = _check(http, http.post("/v1/completions", json={**GOOD, "prompt": long_prompt}), 400, "prompt")
    assert "512" in err["message"]
    err = _check(
        http,
        http.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 1000}),
        400,
        "max_completion_tokens",
    )
    assert "512" in err["message"] and "1000" in err["message"]


def test_empty_prompt(http: httpx.Client) -> None:
    for prompt in ("", [], [[]], ["a", ""]):
        err = _check(http, http.post("/v1/completions", json={**GOOD, "prompt": prompt}), 400)
        assert err["param"].startswith("prompt")
    _check(http, http.post("/v1/chat/completions", json={**CHAT, "messages": []}), 400, "messages")


def test_not_found(http: httpx.Client) -> None:
    _check(http, http.post("/v1/completions", json={**GOOD, "model": "gpt-9"}), 404, "model")
    _check(http, http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404, "model")
    _check(http, http.get("/v1/models/gpt-9"), 404, "model")
    _check(http, http.get("/v1/files/file-nope"), 404)
    _check(http, http.get("/v1/files/file-nope/content"), 404)
    _check(http, http.delete("/v1/files/file-nope"), 404)
    _check(http, http.get("/v1/batches/batch_nope"), 404)
    _check(http, http.post("/v1/batches/batch_nope/cancel"), 404)
    _check(
        http,
        http.post(
            "/v1/batches",
            json={"input_file_id": "file-nope", "endpoint": "/v1/completions", "completion_window": "24h"},
        ),
        404,
    )


@pytest.mark.parametrize(
    "path,method",
    [
        ("/v1/models", "GET"),
        ("/v1/completions", "POST"),
        ("/v1/chat/completions", "POST"),
        ("/v1/files", "GET"),
        ("/v1/files", "POST"),
        ("/v1/batches", "GET"),
        ("/v1/batches", "POST"),
        ("/v1/batches/b/cancel", "POST"),
    ],
)
def test_api_key(real_server: SubprocessServer, http: httpx.Client, path: str, method: str) -> None:
    for headers in ({}, {"Authorization": "Bearer " + API_KEY[:-1] + "x"}, {"Authorization": API_KEY}):
        r = httpx.request(method, real_server.base_url + path, headers=headers, json=GOOD)
        _check(http, r, 401)


def test_body_too_large(http: httpx.Client) -> None:
    big = json.dumps({**GOOD, "prompt": "x" * 1_100_000}).encode()
    _check(http, _raw(http, "/v1/completions", big), 413)

    def chunked() -> Iterator[bytes]:  # no content-length: counted as it arrives
        for _ in range(12):
            yield b" " * 100_000
        yield json.dumps(GOOD).encode()

    _check(
        http,
        http.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"}),
        413,
    )


def test_unknown_route_is_openai_shaped(http: httpx.Client) -> None:
    _check(http, http.get("/v1/nope"), 404)
    _check(http, http.get("/v1/completions"), 405)
