"""The engine core in its own process behind `pagedrs serve`: kill -9 of the core mid-stream (errors, health,
restart, no leaked blocks), a malformed channel message, a core that cannot load its model, and no process
left behind after SIGTERM or SIGKILL of the server. Real default model, CPU."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import SubprocessServer, metric_value, offline_greedy_texts, stream_texts, wait_until

from tests.helpers import child_pids, cmdline, process_gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _core_pid(server: SubprocessServer) -> int:
    assert server.proc is not None
    kids = [k for k in child_pids(server.proc.pid) if "pagedrs.engine.core.proc" in cmdline(k)]
    assert len(kids) == 1, kids
    return kids[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    pytest.importorskip("pagedrs._core")
    s = SubprocessServer(tmp_path_factory.mktemp("core-proc"), ["--max-engine-restarts", "2"])
    s.start()
    yield s
    s.kill()


def _metrics(http: httpx.Client) -> str:
    return http.get("/metrics").text


def _idle(http: httpx.Client) -> bool:
    text = _metrics(http)
    return metric_value(text, "pagedrs:num_requests_running") == 0 and (
        metric_value(text, "pagedrs:kv_cache_usage_perc") == 0
    )


def test_malformed_channel_message_is_dropped(server: SubprocessServer) -> None:
    import zmq

    core = _core_pid(server)
    cmd = cmdline(core).split()
    addr = cmd[cmd.index("--input") + 1]
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(addr)
    for junk in (b"garbage", b"\x93\xa3add\x01\x02", b"\x92\xa5abort\xc0"):
        sock.send(junk)
    sock.close(linger=2000)
    with server.http() as http:
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert _core_pid(server) == core  # the same core: it did not die


def test_step_timings_in_metrics(server: SubprocessServer) -> None:
    with server.http() as http:
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}).status_code == 200
        text = _metrics(http)
    for name in ("engine_step_seconds", "frontend_step_seconds", "output_send_seconds"):
        assert metric_value(text, f"pagedrs:{name}_count") > 0, name


def test_kill_core_mid_stream_then_restart(server: SubprocessServer) -> None:
    core = _core_pid(server)
    with server.http() as http:
        body = {"prompt": "Count to one hundred:", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
            os.kill(core, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"engine_core_died"' in rest[-2], rest[-3:]
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code in (200, 503)  # 503 while the new core loads
        if r.status_code == 503:
            assert r.json()["error"]["type"] == "service_unavailable_error"
        wait_until(lambda: http.get("/health").status_code == 200, timeout=180, interval=0.25)
        new_core = _core_pid(server)
        assert new_core != core and process_gone(core)
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        wait_until(lambda: _idle(http), timeout=30)


def test_200_concurrent_streams_equal_offline_greedy(server: SubprocessServer) -> None:
    prompts = [f"Item {i}: the colour of the sky is" for i in range(200)]
    served = asyncio.run(stream_texts(server, prompts, 6))
    assert served == offline_greedy_texts(prompts, 6)


def test_core_that_fails_to_load_ends_the_server(tmp_path: Path) -> None:
    """A model folder whose config loads but has no weights: the tokenizer (given separately) loads in the
    server, the model fails in the core; the server exits non-zero with the core's message, no hang."""
    from pagedrs.loader import resolve_model_path

    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16, '
        '"intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2, '
        '"num_hidden_layers": 1, "vocab_size": 49152, "max_position_embeddings": 512}'
    )
    s = SubprocessServer(
        tmp_path / "data", ["--model", str(folder), "--tokenizer", resolve_model_path(None)], api_key=None
    )
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with 1") as info:
        s.start(timeout=180)
    assert "has no weights" in str(info.value) and "failed to start" in str(info.value)
    assert time.monotonic() - start < 180
    s.kill()


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_no_process_left_behind(tmp_path: Path, how: str) -> None:
    s = SubprocessServer(tmp_path, [])
    s.start()
    try:
        core = _core_pid(s)
        assert s.proc is not None
        if how == "SIGTERM":
            assert s.terminate(timeout=60) == 0
        else:
            s.proc.kill()
            s.proc.wait(30)
        wait_until(lambda: process_gone(core), timeout=15, interval=0.1)
    finally:
        s.kill()
