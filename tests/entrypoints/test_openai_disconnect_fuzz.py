"""Client disconnects free everything at once; fuzzed request bodies never get a 5xx (real engine)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import SubprocessServer, metric_value, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def http(real_server: SubprocessServer) -> Iterator[httpx.Client]:
    with real_server.http() as c:
        yield c


def _idle(http: httpx.Client) -> bool:
    text = http.get("/metrics").text
    return (
        metric_value(text, "pagedrs:num_requests_running") == 0
        and metric_value(text, "pagedrs:num_requests_waiting") == 0
        and metric_value(text, "pagedrs:kv_cache_usage_perc") == 0
    )


def test_dropped_streams_and_requests_free_blocks(real_server: SubprocessServer, http: httpx.Client) -> None:
    wait_until(lambda: _idle(http), timeout=60)
    opened = []
    for i in range(4):
        c = real_server.http()
        path, body = (
            (
                "/v1/completions",
                {"prompt": f"Story {i}:", "max_tokens": 400, "ignore_eos": True, "stream": True},
            )
            if i % 2 == 0
            else (
                "/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": f"Tell story {i}"}],
                    "max_tokens": 400,
                    "ignore_eos": True,
                    "stream": True,
                },
            )
        )
        resp = c.send(c.build_request("POST", path, json=body), stream=True)
        lines = resp.iter_lines()  # kept alive until closed below
        assert next(line for line in lines if line).startswith("data: ")
        opened.append((c, resp, lines))

    errors: list[BaseException] = []

    def abandoned() -> None:  # a non-streaming request whose client gives up
        try:
            httpx.post(
                f"{real_server.base_url}/v1/completions",
                json={"prompt": "Long", "max_tokens": 400, "ignore_eos": True},
                headers={"Authorization": f"Bearer {real_server.api_key}"},
                timeout=1.5,
            )
        except BaseException as exc:  # checked below
            errors.append(exc)

    t = threading.Thread(target=abandoned)
    t.start()

    def busy() -> bool:
        text = http.get("/metrics").text
        return (
            metric_value(text, "pagedrs:num_requests_running")
            + metric_value(text, "pagedrs:num_requests_waiting")
            >= 5
            and metric_value(text, "pagedrs:kv_cache_usage_perc") > 0
        )

    wait_until(busy, timeout=30)
    for c, resp, _ in opened:
        resp.close()
        c.close()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], httpx.TimeoutException)
    wait_until(lambda: _idle(http), timeout=15)
    assert 'finished_reason="abort"' in http.get("/metrics").text
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


# ---- fuzzing -------------------------------------------------------------------------------------
_json_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=20)
)
_json = st.recursive(
    _json_scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
# Valid values stay small so accepted requests finish fast; anything else must be rejected cleanly.
_small_valid = {
    "max_tokens": st.integers(1, 3),
    "n": st.integers(1, 2),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 2),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=5), st.lists(st.text(min_size=1, max_size=5), max_size=3)),
    "logprobs": st.integers(0, 5),
    "echo": st.booleans(),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 1),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=3),
}
_prompt = st.one_of(
    st.text(max_size=40),
    st.lists(st.text(max_size=10), min_size=1, max_size=3),
    st.lists(st.integers(0, 49151), min_size=1, max_size=8),
    st.lists(st.lists(st.integers(0, 49151), min_size=1, max_size=4), min_size=1, max_size=2),
)
_bad_prompt = st.one_of(st.lists(st.integers(-5, 60000), max_size=8), _json)
_role = st.sampled_from(["system", "user", "assistant", "developer"])
_messages = st.lists(
    st.fixed_dictionaries({"role": _role, "content": st.text(max_size=30)}), min_size=1, max_size=3
)
_bad_messages = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.one_of(_role, st.text(max_size=6)), "content": st.one_of(st.text(max_size=30), _json)}
        ),
        max_size=3,
    ),
    _json,
)
_chat_valid = {
    **{k: v for k, v in _small_valid.items() if k not in ("logprobs", "echo")},
    "logprobs": st.just(True),
}


def _body(
    core: st.SearchStrategy[dict[str, Any]],
    bad_core: st.SearchStrategy[dict[str, Any]],
    fields: dict[str, st.SearchStrategy[Any]],
) -> st.SearchStrategy[dict[str, Any]]:
    """Valid bodies, valid bodies with one field replaced by any JSON value, and bodies of any JSON."""
    valid_fields = st.fixed_dictionaries({}, optional=fields)
    valid = st.tuples(valid_fields, core, st.sampled_from([None, "smollm2"])).map(
        lambda t: {
            **t[0],
            **t[1],
            **({"model": t[2]} if t[2] else {}),
            "max_tokens": t[0].get("max_tokens", 2),
        }
    )
    one_bad = st.tuples(valid, st.sampled_from([*_small_valid, "model", "messages", "prompt"]), _json).map(
        lambda t: {**t[0], t[1]: t[2]}
    )
    garbage = st.tuples(valid, bad_core).map(lambda t: {**t[0], **t[1]})
    anything = st.dictionaries(st.sampled_from([*_small_valid, "prompt", "messages", "n"]), _json, max_size=5)
    return st.one_of(valid, valid, one_bad, garbage, anything).map(_bounded)


def _bounded(body: dict[str, Any]) -> dict[str, Any]:
    """Keeps accepted requests short: no output budget above 3 tokens, at most 3 samples (a null
    max_tokens means "up to max_model_len", a fine value but a slow one on a CPU)."""
    body = dict(body)
    for key, cap in (("max_tokens", 3), ("max_completion_tokens", 3), ("n", 3)):
        v = body.get(key)
        if (key == "max_tokens" and key not in body) or (
            key in body
            and (v is None or (isinstance(v, int) and not isinstance(v, bool) and cap < v <= 2**31))
        ):
            body[key] = 2
    return body


_completion_body = _body(
    st.fixed_dictionaries({"prompt": _prompt}), st.fixed_dictionaries({"prompt": _bad_prompt}), _small_valid
)
_chat_body = _body(
    st.fixed_dictionaries(
        {"messages": _messages},
        optional={"top_logprobs": st.integers(0, 3), "max_completion_tokens": st.integers(1, 3)},
    ),
    st.fixed_dictionaries(
        {"messages": _bad_messages}, optional={"top_logprobs": _json, "max_completion_tokens": _json}
    ),
    _chat_valid,
)


STATUSES: Counter[int] = Counter()


def _send(http: httpx.Client, path: str, body: Any) -> None:
    data = json.dumps(body).encode() if not isinstance(body, bytes) else body
    r = http.post(path, content=data, headers={"Content-Type": "application/json"})
    STATUSES[r.status_code] += 1
    assert r.status_code < 500, (body, r.status_code, r.text[:500])
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    elif "text/event-stream" in r.headers.get("content-type", ""):
        assert r.text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in r.text, r.text[-500:]


_SETTINGS = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@_SETTINGS
@given(body=_completion_body)
def test_fuzz_completions(http: httpx.Client, body: dict[str, Any]) -> None:
    _send(http, "/v1/completions", body)


@_SETTINGS
@given(body=_chat_body)
def test_fuzz_chat(http: httpx.Client, body: dict[str, Any]) -> None:
    _send(http, "/v1/chat/completions", body)


@settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(raw=st.one_of(st.binary(max_size=64), _json.map(lambda v: json.dumps(v).encode())))
def test_fuzz_raw_bodies(http: httpx.Client, raw: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/batches"):
        _send(http, path, raw)


def test_healthy_after_fuzzing(http: httpx.Client) -> None:
    """Self-contained: a burst of bad and good bodies of every kind (streams included), then the server is
    healthy, idle (no leaked blocks) and serves."""
    before = Counter(STATUSES)
    bad = [
        b"{",
        b"[]",
        {"prompt": "", "max_tokens": 2},
        {"prompt": "Hi", "max_tokens": -1},
        {"prompt": "Hi", "temperature": "hot"},
        {"prompt": [10**9], "max_tokens": 2},
        {"prompt": "Hi", "max_tokens": 10**6},
        {"messages": "not a list"},
    ]
    good = [
        {"prompt": "Hi", "max_tokens": 3},
        {"prompt": "Hi", "max_tokens": 3, "stream": True},
        {"prompt": ["a", "b"], "max_tokens": 2, "n": 2, "stream": True, "stop": ["x"]},
        {"prompt": "Hi", "max_tokens": 3, "logprobs": 2, "stream": True},
    ]
    for body in bad:
        _send(http, "/v1/completions", body)
        _send(http, "/v1/chat/completions", body)
    for body in good:
        _send(http, "/v1/completions", body)
    _send(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    got = STATUSES - before
    assert got[400] >= 2 * len(bad) - 2 and got[200] == len(good) + 1, got
    assert not any(code >= 500 for code in got), got
    assert http.get("/health").status_code == 200
    wait_until(lambda: _idle(http), timeout=30)
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
