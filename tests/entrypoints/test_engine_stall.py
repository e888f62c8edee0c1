"""Liveness: /health answers 503 while an engine core holds requests but has not finished a step for
`--engine-stall-timeout` seconds (the process alive, the loop stuck), and 200 again once it steps; an idle
core is never stalled."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import API_KEY, ThreadedServer, wait_until
from fake_engine import FakeEngine

from pagedrs.entrypoints.cli_args import ServerArgs
from pagedrs.entrypoints.openai.server.app import build_app

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture()
def stalling(tmp_path: object) -> Iterator[tuple[FakeEngine, ThreadedServer]]:
    engine = FakeEngine(step_delay=0.0)
    args = ServerArgs(
        api_key=API_KEY,
        data_dir=str(tmp_path),
        served_model_name=["fake"],
        shutdown_grace=2.0,
        engine_stall_timeout=1.0,
    )
    with ThreadedServer(build_app(engine, args)) as server:
        yield engine, server


def test_health_sees_a_stalled_core_and_its_recovery(stalling: tuple[FakeEngine, ThreadedServer]) -> None:
    engine, server = stalling
    health = lambda: httpx.get(f"{server.base_url}/health", timeout=10)  # noqa: E731
    time.sleep(1.5)  # idle for longer than the timeout: not stalled
    assert health().status_code == 200
    engine.step_delay = 4.0  # the next step takes 4 s: the core stops stepping for that long
    done: list[int] = []

    def request() -> None:
        body = {"model": "fake", "prompt": "hello", "max_tokens": 3}
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=AUTH, timeout=60)
        done.append(r.status_code)

    t = threading.Thread(target=request)
    t.start()
    stalled = wait_until(lambda: (r := health()).status_code == 503 and r, timeout=10, interval=0.2)
    message = stalled.json()["error"]["message"]
    assert "has not finished a step" in message and "1 requests in flight" in message, message
    engine.step_delay = 0.0
    t.join(timeout=30)
    assert done == [200]  # the stalled request still completes
    assert wait_until(lambda: health().status_code == 200, timeout=10)


def test_stall_timeout_flag_is_checked() -> None:
    assert ServerArgs(engine_stall_timeout=-1.0).error(enable_lora=False) is not None
    assert ServerArgs(engine_stall_timeout=0.0).error(enable_lora=False) is None
