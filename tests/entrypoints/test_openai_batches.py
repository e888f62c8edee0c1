"""Files and batches end to end through the `openai` client with the real engine: complete, cancel,
SIGKILL mid-batch and restart on the same data dir (every line answered exactly once), SIGTERM
drain (in-flight requests finish, exit 0)."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import SubprocessServer, wait_until


def _lines(n: int, max_tokens: Any, endpoint: str = "/v1/completions") -> str:
    rows = []
    for i in range(n):
        mt = max_tokens(i) if callable(max_tokens) else max_tokens
        body = (
            {
                "model": "smollm2",
                "prompt": f"Item {i}:",
                "max_tokens": mt,
                "ignore_eos": True,
                "temperature": 0,
            }
            if endpoint == "/v1/completions"
            else {
                "model": "smollm2",
                "messages": [{"role": "user", "content": f"Count to {i}"}],
                "max_tokens": mt,
                "temperature": 0,
            }
        )
        rows.append(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": endpoint, "body": body}))
    return "\n".join(rows) + "\n"


def _create(client: Any, text: str, endpoint: str = "/v1/completions") -> Any:
    f = client.files.create(file=("batch.jsonl", io.BytesIO(text.encode())), purpose="batch")
    assert client.files.retrieve(f.id).bytes == len(text.encode())
    assert client.files.content(f.id).text == text
    return client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")


def _poll(client: Any, batch_id: str, statuses: tuple[str, ...], timeout: float = 180) -> Any:
    seen = []

    def check() -> Any:
        b = client.batches.retrieve(batch_id)
        if not seen or seen[-1] != b.status:
            seen.append(b.status)
        return b if b.status in statuses else None

    b = wait_until(check, timeout=timeout, interval=0.2)
    return b, seen


def _jsonl(client: Any, file_id: str | None) -> list[dict[str, Any]]:
    if not file_id:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("pagedrs._core")
    s = SubprocessServer(
        tmp_path_factory.mktemp("batch-data"),
        ["--served-model-name", "smollm2", "--max-batch-concurrency", "2"],
    )
    s.start()
    yield s
    s.kill()


def test_batch_completes_keyed_by_custom_id(server: SubprocessServer) -> None:
    client = server.client()
    text = _lines(4, 3) + "not json\n"
    b = _create(client, text)
    assert b.status == "validating" and b.endpoint == "/v1/completions"
    done, seen = _poll(client, b.id, ("completed", "failed"))
    assert done.status == "completed", done
    assert seen[-1] == "completed" and set(seen) <= {"validating", "in_progress", "finalizing", "completed"}
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 4, 1)
    out = {x["custom_id"]: x for x in _jsonl(client, done.output_file_id)}
    assert sorted(out) == [f"line-{i}" for i in range(4)]
    for x in out.values():
        body = x["response"]["body"]
        assert x["response"]["status_code"] == 200 and body["usage"]["completion_tokens"] == 3
    errors = _jsonl(client, done.error_file_id)
    assert len(errors) == 1 and errors[0]["error"]["code"] == "invalid_json"
    # the same prompt through the HTTP API gives the same (greedy) text
    direct = client.completions.create(
        model="smollm2", prompt="Item 0:", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out["line-0"]["response"]["body"]["choices"][0]["text"] == direct.choices[0].text
    assert b.id in [x.id for x in client.batches.list(limit=100).data]
    client.files.delete(done.output_file_id)
    assert done.output_file_id not in [f.id for f in client.files.list().data]


def test_chat_batch(server: SubprocessServer) -> None:
    client = server.client()
    done, _ = _poll(
        client,
        _create(client, _lines(2, 2, "/v1/chat/completions"), "/v1/chat/completions").id,
        ("completed", "failed"),
    )
    assert done.request_counts.completed == 2
    assert all(
        x["response"]["body"]["object"] == "chat.completion" for x in _jsonl(client, done.output_file_id)
    )


def test_cancel_mid_run_keeps_finished_lines(server: SubprocessServer) -> None:
    client = server.client()
    b = _create(client, _lines(12, lambda i: 4 + 4 * i))
    wait_until(lambda: client.batches.retrieve(b.id).request_counts.completed >= 2, timeout=180, interval=0.1)
    assert client.batches.cancel(b.id).status in ("cancelling", "cancelled")
    done, _ = _poll(client, b.id, ("cancelled",))
    kept = _jsonl(client, done.output_file_id)
    assert 2 <= len(kept) < 12 and len(kept) == done.request_counts.completed
    assert len({x["custom_id"] for x in kept}) == len(kept)
    assert all(x["response"]["status_code"] == 200 for x in kept)


def test_sigkill_mid_batch_then_restart(tmp_path: Path) -> None:
    pytest.importorskip("pagedrs._core")
    n = 10
    first = SubprocessServer(tmp_path, ["--served-model-name", "smollm2", "--max-batch-concurrency", "2"])
    first.start()
    try:
        client = first.client()
        b = _create(client, _lines(n, lambda i: 3 + 3 * i))
        wait_until(
            lambda: client.batches.retrieve(b.id).request_counts.completed >= 2, timeout=180, interval=0.05
        )
    finally:
        first.kill()  # SIGKILL: no shutdown path runs
    second = SubprocessServer(
        tmp_path, ["--served-model-name", "smollm2", "--max-batch-concurrency", "2"], port=first.port
    )
    second.start()
    try:
        client = second.client()
        done, _ = _poll(client, b.id, ("completed",))
        out = _jsonl(client, done.output_file_id)
        ids = [x["custom_id"] for x in out]
        assert sorted(ids) == sorted(f"line-{i}" for i in range(n))  # each exactly once
        assert done.request_counts.completed == n and done.request_counts.failed == 0
        assert done.error_file_id is None
        for x in out:
            i = int(x["custom_id"].split("-")[1])
            assert x["response"]["body"]["usage"]["completion_tokens"] == 3 + 3 * i

        # SIGTERM with a request in flight: it finishes, then the process exits 0.
        result: dict[str, httpx.Response] = {}

        def call() -> None:
            with second.http() as h:
                result["r"] = h.post(
                    "/v1/completions", json={"prompt": "Once", "max_tokens": 30, "ignore_eos": True}
                )

        t = threading.Thread(target=call)
        t.start()
        wait_until(
            lambda: (
                "pagedrs:num_requests_running{" in (txt := httpx.get(f"{second.base_url}/metrics").text)
                and any(
                    line.startswith("pagedrs:num_requests_running{") and not line.endswith(" 0.0")
                    for line in txt.splitlines()
                )
            ),
            timeout=30,
            interval=0.02,
        )
        t0 = time.monotonic()
        assert second.terminate(timeout=60) == 0, second.log()
        t.join(30)
        assert result["r"].status_code == 200
        assert result["r"].json()["usage"]["completion_tokens"] == 30
        assert time.monotonic() - t0 < 60
    finally:
        second.kill()
