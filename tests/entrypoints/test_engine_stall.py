"""Liveness: /health answers 503 while an engine core holds requests but has not finished a step for
`--engine-stall-timeout` seconds (the process alive, the loop stuck), and 200 again once it steps; an idle
core is never stalled. A core process that stays stuck for `--engine-stall-restart-timeout` seconds is
killed and restarted as a dead one (real default model, a core paused with SIGSTOP)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import API_KEY, SubprocessServer, ThreadedServer, metric_value, wait_until
from fake_engine import FakeEngine

from pagedrs.entrypoints.cli_args import ServerArgs
from pagedrs.entrypoints.openai.server.app import build_app
from tests.helpers import child_pids, cmdline, process_gone

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


def test_stall_timeout_flags_are_checked() -> None:
    assert ServerArgs(engine_stall_timeout=-1.0).error(enable_lora=False) is not None
    assert ServerArgs(engine_stall_timeout=0.0).error(enable_lora=False) is None
    assert "restart" in (ServerArgs(engine_stall_restart_timeout=-1.0).error(enable_lora=False) or "")
    assert ServerArgs().engine_stall_restart_timeout > ServerArgs().engine_stall_timeout > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_core_that_stays_stalled_is_killed_and_restarted(tmp_path: object) -> None:
    pytest.importorskip("pagedrs._core")
    flags = ["--engine-stall-timeout", "1", "--engine-stall-restart-timeout", "6"]
    server = SubprocessServer(tmp_path, flags)  # type: ignore[arg-type]
    server.start()
    core = 0
    try:
        assert server.proc is not None
        (core,) = [k for k in child_pids(server.proc.pid) if "pagedrs.engine.core.proc" in cmdline(k)]
        with server.http() as http, server.http() as probe:
            body = {"prompt": "Count to one hundred:", "max_tokens": 400, "stream": True, "ignore_eos": True}
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line).startswith("data: {")
                os.kill(core, signal.SIGSTOP)  # alive, but it never steps again
                stalled = wait_until(lambda: (h := probe.get("/health")).status_code == 503 and h, timeout=15)
                assert "has not finished a step" in stalled.json()["error"]["message"]
                text = probe.get("/metrics").text
                assert metric_value(text, "pagedrs:engine_core_stalled_seconds") >= 1.0
                rest = [line for line in lines if line]  # ends once the core is killed
            assert rest[-1] == "data: [DONE]", rest[-3:]
            assert '"engine_core_died"' in rest[-2] and "stalled" in rest[-2], rest[-2]
            assert wait_until(lambda: process_gone(core), timeout=30)
            wait_until(lambda: probe.get("/health").status_code == 200, timeout=180, interval=0.25)
            r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            text = probe.get("/metrics").text
            assert metric_value(text, "pagedrs:engine_core_stall_restarts_total") == 1
            assert metric_value(text, "pagedrs:engine_core_stalled_seconds") == 0
    finally:
        if core:
            with contextlib.suppress(ProcessLookupError):
                os.kill(core, signal.SIGCONT)
        server.kill()
