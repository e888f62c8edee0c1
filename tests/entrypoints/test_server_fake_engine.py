"""The HTTP layer over a test-only fake engine (fast): routes, auth, limits, streaming, disconnects,
engine faults. The same behaviour against the real model is in test_openai_*.py."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import API_KEY, ThreadedServer, metric_value, wait_until
from fake_engine import FakeEngine

from pagedrs.entrypoints.cli_args import ServerArgs
from pagedrs.entrypoints.openai.server.app import build_app

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _args(tmp_path: object, **kw: object) -> ServerArgs:
    base = dict(
        api_key=API_KEY,
        data_dir=str(tmp_path),
        max_body_bytes=20_000,
        served_model_name=["fake"],
        max_batch_concurrency=4,
        shutdown_grace=5.0,
    )
    base.update(kw)
    return ServerArgs(**base)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    app = build_app(FakeEngine(), _args(tmp_path_factory.mktemp("fake")))
    with ThreadedServer(app) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)


def test_health_models_metrics(server: ThreadedServer, client: openai.OpenAI) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert [m.id for m in client.models.list().data] == ["fake"]
    text = httpx.get(f"{server.base_url}/metrics").text
    assert "pagedrs:num_requests_running" in text and "pagedrs:time_to_first_token_seconds" in text


@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/files"),
        ("GET", "/v1/batches"),
        ("GET", "/v1/batches/x"),
    ],
)
def test_api_key_required_on_v1(server: ThreadedServer, method: str, path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.request(method, server.base_url + path, headers=headers, json={})
        assert r.status_code == 401
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # no key needed


def test_completion_usage_and_text(client: openai.OpenAI) -> None:
    r = client.completions.create(model="fake", prompt="hello", max_tokens=5)
    assert r.choices[0].text == "hijkl" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 5 and r.usage.total_tokens == 10


def test_stream_equals_non_stream(client: openai.OpenAI) -> None:
    full = client.completions.create(model="fake", prompt=["ab", "cd"], max_tokens=6, n=2)
    chunks = list(
        client.completions.create(
            model="fake",
            prompt=["ab", "cd"],
            max_tokens=6,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts: dict[int, str] = {}
    for c in chunks[:-1]:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert texts == {c.index: c.text for c in full.choices}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24


def test_chat_stream_and_logprobs(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    full = client.chat.completions.create(
        model="fake", messages=msgs, max_tokens=4, logprobs=True, top_logprobs=2
    )
    lp = full.choices[0].logprobs.content
    assert len(lp) == 4 and len(lp[0].top_logprobs) == 2 and lp[0].logprob == -0.5
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model="fake", messages=msgs, max_tokens=4, stream=True)
        if c.choices
    )
    assert text == full.choices[0].message.content


def _post(server: ThreadedServer, path: str, body: object, **kw: object) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        server.base_url + path,
        content=data,
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=30,
        **kw,
    )


@pytest.mark.parametrize(
    "body,status,param",
    [
        (b"{not json", 400, None),
        (b"[1]", 400, None),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "x", "temperature": 9}, 400, "temperature"),
        ({"prompt": "x" * 100, "max_tokens": 100}, 400, "max_tokens"),
        ({"prompt": "x" * 200}, 400, "prompt"),
        ({"prompt": [999999]}, 400, "prompt"),
        ({"prompt": [[5], [999999]]}, 400, "prompt[1]"),
        ({"prompt": "x", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
        ({"prompt": "x", "stop_token_ids": [999999]}, 400, "stop_token_ids"),
        ({"prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
        ({"prompt": "x", "model": "nope"}, 404, "model"),
        ({"prompt": "x" * 30_000}, 413, None),
    ],
)
def test_bad_input_then_good(server: ThreadedServer, body: object, status: int, param: str | None) -> None:
    r = _post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    if param == "max_tokens":
        assert "128" in err["message"] and "200" in err["message"]
    good = _post(server, "/v1/completions", {"prompt": "ok", "max_tokens": 2})
    assert good.status_code == 200


def test_unknown_route_and_ids(server: ThreadedServer) -> None:
    for path in ("/v1/files/file-nope", "/v1/batches/batch_nope", "/v1/nothing"):
        r = httpx.get(server.base_url + path, headers=AUTH)
        assert r.status_code == 404 and "error" in r.json()


def test_disconnects_free_everything(server: ThreadedServer) -> None:
    body = {"prompt": "p", "max_tokens": 100, "stream": True}
    clients = []
    for _ in range(4):
        c = httpx.Client(base_url=server.base_url, headers=AUTH, timeout=30)
        resp = c.send(c.build_request("POST", "/v1/completions", json=body), stream=True)
        lines = resp.iter_lines()  # kept alive: a collected iterator closes the response
        next(lines)
        clients.append((c, resp, lines))
    # and one non-streaming request that is abandoned mid-way
    t = threading.Thread(
        target=lambda: pytest.raises(
            httpx.TimeoutException,
            httpx.post,
            server.base_url + "/v1/completions",
            headers=AUTH,
            json={"prompt": "q", "max_tokens": 100},
            timeout=0.2,
        )
    )
    t.start()
    t.join()
    running = metric_value(httpx.get(f"{server.base_url}/metrics").text, "pagedrs:num_requests_running")
    assert running >= 1
    for c, resp, _ in clients:
        resp.close()
        c.close()

    def idle() -> bool:
        text = httpx.get(f"{server.base_url}/metrics").text
        return (
            metric_value(text, "pagedrs:num_requests_running") == 0
            and metric_value(text, "pagedrs:kv_cache_usage_perc") == 0
        )

    wait_until(idle, timeout=10)
    text = httpx.get(f"{server.base_url}/metrics").text
    assert 'finished_reason="abort"' in text


def _stream_until_fault(c: httpx.Client, inject: Any) -> list[str]:
    with c.stream("POST", "/v1/completions", json={"prompt": "a", "max_tokens": 100, "stream": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert first.startswith("data: {")
        inject()
        return [line for line in lines if line]


def test_failed_step_errors_its_requests_and_keeps_serving(tmp_path: object) -> None:
    engine = FakeEngine(step_delay=0.01)
    app = build_app(engine, _args(tmp_path))
    with ThreadedServer(app) as s:
        c = httpx.Client(base_url=s.base_url, headers=AUTH, timeout=30)
        rest = _stream_until_fault(c, lambda: setattr(engine, "fail_next_step", RuntimeError("boom")))
        assert rest[-1] == "data: [DONE]"
        assert '"error"' in rest[-2] and "boom" in rest[-2]
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 2


def test_dead_core_errors_in_flight_then_restarts(tmp_path: object) -> None:
    engine = FakeEngine(step_delay=0.01)
    app = build_app(engine, _args(tmp_path))
    with ThreadedServer(app) as s:
        c = httpx.Client(base_url=s.base_url, headers=AUTH, timeout=30)
        rest = _stream_until_fault(c, lambda: setattr(engine, "die_next_step", RuntimeError("crash")))
        assert rest[-1] == "data: [DONE]"
        err = json.loads(rest[-2][len("data: ") :])["error"]
        assert err["code"] == "engine_core_died" and err["type"] == "server_error"
        wait_until(lambda: c.get("/health").status_code == 200, timeout=10)  # restarted
        engine.requests.clear()  # the dead core's state (a real core process starts empty)
        r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 2


def test_drain_finishes_inflight(tmp_path: object) -> None:
    engine = FakeEngine(step_delay=0.02)
    app = build_app(engine, _args(tmp_path))
    s = ThreadedServer(app).__enter__()
    result: dict[str, object] = {}

    def call() -> None:
        result["r"] = httpx.post(
            f"{s.base_url}/v1/completions", headers=AUTH, json={"prompt": "a", "max_tokens": 20}, timeout=30
        )

    t = threading.Thread(target=call)
    t.start()
    wait_until(lambda: engine.requests, timeout=5, interval=0.005)
    app.state.server.begin_drain()
    time.sleep(0.05)
    assert httpx.get(f"{s.base_url}/health").status_code == 503
    s.__exit__(None, None, None)
    t.join(10)
    r = result["r"]
    assert isinstance(r, httpx.Response) and r.status_code == 200
    assert len(r.json()["choices"][0]["text"]) == 20


def test_admin_liquid_auth_validation_and_conflict(tmp_path: object) -> None:
    """POST /v1/admin/liquid: the API key is required, bad bodies are 400 naming the field, a second
    move while one runs is 409, and the move's events come back."""
    engine = FakeEngine()
    engine.liquid_delay = 1.0
    app = build_app(engine, _args(tmp_path))
    with ThreadedServer(app) as s:
        c = httpx.Client(base_url=s.base_url, headers=AUTH, timeout=30)
        anon = httpx.post(f"{s.base_url}/v1/admin/liquid", json={"target": 2}, timeout=30)
        assert anon.status_code == 401
        r = c.post("/v1/admin/liquid", json={"liquid_type": "LIQUID_9_9"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "liquid_type"
        r = c.post("/v1/admin/liquid", json={"liquid_type": "LIQUID_2_4"})
        assert (
            r.status_code == 400 and "from 2 active ranks, but 1 are active" in r.json()["error"]["message"]
        )
        r = c.post("/v1/admin/liquid", json={"target": 3})
        assert r.status_code == 400 and "power of two" in r.json()["error"]["message"]
        first: dict[str, httpx.Response] = {}
        t = threading.Thread(
            target=lambda: first.setdefault("r", c.post("/v1/admin/liquid", json={"target": 2}))
        )
        t.start()
        assert engine.liquid_started.wait(10)  # the core is inside the move now
        r = c.post("/v1/admin/liquid", json={"target": 4})
        assert r.status_code == 409 and r.json()["error"]["code"] == "liquid_in_progress"
        t.join(30)
        assert first["r"].status_code == 200, first["r"].text
        assert first["r"].json()["degree"] == 2 and first["r"].json()["events"][0]["dst_degree"] == 2
        r = c.post("/v1/admin/liquid", json={"liquid_type": "LIQUID_2_1"})
        assert r.status_code == 200 and engine.liquid_degree == 1


def test_admin_liquid_needs_an_api_key(tmp_path: object) -> None:
    app = build_app(FakeEngine(), _args(tmp_path, api_key=None))
    with ThreadedServer(app) as s:
        r = httpx.post(f"{s.base_url}/v1/admin/liquid", json={"target": 2}, timeout=30)
        assert r.status_code == 403 and "--api-key" in r.json()["error"]["message"]
