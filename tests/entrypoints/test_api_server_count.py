"""`--api-server-count 2`: two API server processes share the port and one engine core. Both serve (the
same greedy text as offline), metrics are summed over them, a killed core is restarted under both, a
killed API server ends the whole server, and no process is left after SIGTERM or SIGKILL. Real default
model, CPU."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import (
    API_KEY,
    SERVER_ENGINE_FLAGS,
    SubprocessServer,
    metric_value,
    offline_greedy_texts,
    stream_texts,
    wait_until,
)

from tests.helpers import child_pids, cmdline, process_gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _kids(server: SubprocessServer) -> tuple[int, list[int]]:
    """(engine core pid, API server pids by client index)."""
    assert server.proc is not None
    kids = child_pids(server.proc.pid)
    cores = [k for k in kids if "pagedrs.engine.core.proc" in cmdline(k)]
    apis = [k for k in kids if "pagedrs.entrypoints.openai.server.multi_server" in cmdline(k)]
    apis.sort(key=lambda k: int(cmdline(k).split("--client-index ")[1].split()[0]))
    assert len(cores) == 1 and len(apis) == 2, (cores, apis)
    return cores[0], apis


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    pytest.importorskip("pagedrs._core")
    s = SubprocessServer(
        tmp_path_factory.mktemp("asc"), ["--api-server-count", "2", "--max-engine-restarts", "2"]
    )
    s.start()
    yield s
    s.kill()


def test_both_processes_serve_offline_greedy_text(server: SubprocessServer) -> None:
    core, apis = _kids(server)
    prompts = [f"Question {i}: what is the colour of grass?" for i in range(40)]
    # A connection per request: the kernel spreads them over the two processes' accepts.
    served = asyncio.run(stream_texts(server, prompts, 6, connection_each=True))
    assert served == offline_greedy_texts(prompts, 6)
    log = server.log_path.read_text(errors="replace")
    lines = [x for x in log.splitlines() if '"POST /v1/completions' in x]
    by_index = [sum(f"[api-server {i}]" in x for x in lines) for i in range(2)]
    assert all(n > 0 for n in by_index), by_index  # both processes answered some of the 40
    assert _kids(server) == (core, apis)


def test_metrics_summed_over_processes(server: SubprocessServer) -> None:
    with server.http() as http:

        def success() -> float:
            text = http.get("/metrics").text
            return sum(
                float(x.rsplit(" ", 1)[1])
                for x in text.splitlines()
                if x.startswith("pagedrs:request_success_total{")
            )

        before = success()
        n = 12
        for i in range(n):  # fresh connections: spread over both processes
            with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
                r = c.post("/v1/completions", json={"prompt": f"n{i}", "max_tokens": 2})
                assert r.status_code == 200
        assert success() - before == n
        text = http.get("/metrics").text
        assert metric_value(text, "pagedrs:engine_step_seconds_count") > 0
        assert metric_value(text, "pagedrs:generation_tokens_total") >= 2 * n

        def steps_counted_once() -> bool:
            # both processes process every step message; the core's step time is observed by one
            text = http.get("/metrics").text
            engine = metric_value(text, "pagedrs:engine_step_seconds_count")
            return metric_value(text, "pagedrs:frontend_step_seconds_count") == 2 * engine

        wait_until(steps_counted_once, timeout=30, interval=0.2)


def test_kill_core_fails_streams_in_both_processes_then_restart(server: SubprocessServer) -> None:
    core, apis = _kids(server)
    body = {"prompt": "Count to one hundred:", "max_tokens": 400, "stream": True, "ignore_eos": True}

    async def run() -> list[list[str]]:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        limits = httpx.Limits(max_keepalive_connections=0)

        async def one(started: asyncio.Event) -> list[str]:
            async with (
                httpx.AsyncClient(base_url=server.base_url, headers=headers, timeout=120, limits=limits) as c,
                c.stream("POST", "/v1/completions", json=body) as r,
            ):
                assert r.status_code == 200
                lines = []
                async for line in r.aiter_lines():
                    if line:
                        lines.append(line)
                        started.set()
                return lines

        events = [asyncio.Event() for _ in range(6)]
        tasks = [asyncio.create_task(one(e)) for e in events]
        for e in events:
            await asyncio.wait_for(e.wait(), 120)
        os.kill(core, signal.SIGKILL)
        return list(await asyncio.gather(*tasks))

    for lines in asyncio.run(run()):
        assert lines[-1] == "data: [DONE]" and '"engine_core_died"' in lines[-2], lines[-3:]
    with server.http() as http:
        wait_until(lambda: http.get("/health").status_code == 200, timeout=180, interval=0.25)
        new_core, new_apis = _kids(server)
        assert new_core != core and process_gone(core) and new_apis == apis
        # every process serves again: 8 fresh connections, all answered
        for i in range(8):
            with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
                wait_until(lambda: c.get("/health").status_code == 200, timeout=60, interval=0.25)
                r = c.post("/v1/completions", json={"prompt": f"again {i}", "max_tokens": 3})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        wait_until(
            lambda: metric_value(http.get("/metrics").text, "pagedrs:kv_cache_usage_perc") == 0, timeout=30
        )


def test_killed_api_server_ends_the_server(tmp_path: Path) -> None:
    s = SubprocessServer(tmp_path, ["--api-server-count", "2"])
    s.start()
    try:
        core, apis = _kids(s)
        os.kill(apis[1], signal.SIGKILL)
        assert s.proc is not None
        assert s.proc.wait(90) == 1
        wait_until(lambda: process_gone(core) and process_gone(apis[0]), timeout=30, interval=0.1)
        assert "API server 1" in s.log() and "killed by signal 9" in s.log()
    finally:
        s.kill()


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_no_process_left_behind(tmp_path: Path, how: str) -> None:
    s = SubprocessServer(tmp_path, ["--api-server-count", "2"])
    s.start()
    try:
        core, apis = _kids(s)
        assert s.proc is not None
        if how == "SIGTERM":
            assert s.terminate(timeout=90) == 0
        else:
            s.proc.kill()
            s.proc.wait(30)
        wait_until(lambda: all(process_gone(p) for p in [core, *apis]), timeout=30, interval=0.1)
    finally:
        s.kill()


def test_bad_count_is_refused(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "pagedrs.entrypoints.openai.api_server", *SERVER_ENGINE_FLAGS]
    r = subprocess.run([*cmd, "--api-server-count", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--api-server-count must be at least 1, got 0" in r.stderr
