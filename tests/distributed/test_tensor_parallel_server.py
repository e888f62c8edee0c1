"""`pagedrs serve -tp 2` on a tiny model: the openai client gets what `LLM.generate` gives; a worker
killed mid-stream fails the request with a 500-class error, the core restarts with fresh workers and
serves again, and no process is left behind after SIGTERM."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from pagedrs import LLM, SamplingParams
from tests.entrypoints.conftest import SubprocessServer, wait_until
from tests.helpers import child_pids, cmdline, make_tiny_llama, process_gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

PROMPTS = ["Tensor parallel says", "abc", "The quick brown fox"]
MAX_TOKENS = 8


def _workers_of(pid: int) -> list[int]:
    """TP worker processes under the server's engine core."""
    found: list[int] = []
    for core in child_pids(pid):
        if "pagedrs.engine.core.proc" in cmdline(core):
            found += [w for w in child_pids(core) if "pagedrs.executor.rank_main" in cmdline(w)]
    return found


def test_serve_tp2_matches_offline_and_survives_a_dead_worker(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path, vocab_size=259)
    llm = LLM(str(folder), device="cpu", dtype="float32", disable_log_stats=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    server = SubprocessServer(
        tmp_path / "data",
        ["--model", str(folder), "-tp", "2", "--max-engine-restarts", "1"],
        api_key=None,
    )
    server.start()
    assert server.proc is not None
    try:
        workers = _workers_of(server.proc.pid)
        assert len(workers) == 1, workers
        client = server.client()
        name = client.models.list().data[0].id
        for prompt, want in zip(PROMPTS, expected, strict=True):
            r = client.completions.create(
                model=name,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert r.choices[0].text == want
        stream = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        # A worker dies mid-stream: the stream ends with an error, then the core comes back.
        with server.http() as http:
            body = {"prompt": "Count:", "max_tokens": 400, "stream": True, "ignore_eos": True}
            with http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                assert next(line for line in lines if line).startswith("data: {")
                os.kill(workers[0], signal.SIGKILL)
                rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2], rest[-3:]
            assert "rank 1" in rest[-2] or "engine_core_died" in rest[-2], rest[-2]
            # The core exits after reporting the failure; the server starts a new one, with new workers.
            wait_until(lambda: _workers_of(server.proc.pid) not in ([], workers), timeout=180, interval=0.25)
            wait_until(lambda: http.get("/health").status_code == 200, timeout=180, interval=0.25)
            new_workers = _workers_of(server.proc.pid)
            assert len(new_workers) == 1 and process_gone(workers[0])
            # the whole log: on a slow machine the health polls above push the line out of log()'s tail
            assert "tensor-parallel rank 1 failed" in server.log_path.read_text(errors="replace")
        r = client.completions.create(
            model=name,
            prompt=PROMPTS[0],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert r.choices[0].text == expected[0]
        everything = [*child_pids(server.proc.pid), *new_workers]
        assert server.terminate(timeout=60) == 0
        wait_until(lambda: all(process_gone(p) for p in everything), timeout=15, interval=0.1)
    finally:
        server.kill()
