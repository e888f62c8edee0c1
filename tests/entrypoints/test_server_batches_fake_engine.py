"""Files and batches over the fake engine (fast): the SQLite store, the worker, cancel, resume."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import API_KEY, ThreadedServer, wait_until
from fake_engine import FakeEngine

from pagedrs.entrypoints.cli_args import ServerArgs
from pagedrs.entrypoints.openai.batches.store import BatchStore
from pagedrs.entrypoints.openai.batches.worker import parse_input
from pagedrs.entrypoints.openai.server.app import build_app


def _app(data_dir: Path, step_delay: float = 0.002, concurrency: int = 4) -> Any:
    args = ServerArgs(
        api_key=API_KEY,
        data_dir=str(data_dir),
        served_model_name=["fake"],
        max_batch_concurrency=concurrency,
        shutdown_grace=0.5,
    )
    return build_app(FakeEngine(step_delay=step_delay), args)


def _client(server: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)


def _lines(n: int, endpoint: str = "/v1/completions", max_tokens: Any = 4) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        mt = max_tokens(i) if callable(max_tokens) else max_tokens
        body = (
            {"model": "fake", "prompt": f"p{i}", "max_tokens": mt}
            if endpoint == "/v1/completions"
            else {"model": "fake", "messages": [{"role": "user", "content": f"m{i}"}], "max_tokens": mt}
        )
        out.append({"custom_id": f"req-{i}", "method": "POST", "url": endpoint, "body": body})
    return out


def _upload(client: openai.OpenAI, lines: list[Any]) -> str:
    data = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    return client.files.create(file=("in.jsonl", io.BytesIO(data.encode())), purpose="batch").id


def _poll(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...], timeout: float = 30) -> Any:
    return wait_until(
        lambda: (b := client.batches.retrieve(batch_id)).status in statuses and b,
        timeout=timeout,
        interval=0.05,
    )


def _jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]


def test_store_answers_a_line_once(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    f = store.create_file(b"x\n", "a.jsonl", "batch")
    b = store.create_batch("/v1/completions", f["id"], "24h", {"k": "v"})
    assert store.record_result(b["id"], 0, "a", True, {"n": 1})
    assert not store.record_result(b["id"], 0, "a", True, {"n": 2})
    assert store.counts(b["id"]) == (1, 0)
    assert [json.loads(x) for x in store.results(b["id"], True)] == [{"n": 1}]
    store.close()
    again = BatchStore(tmp_path)  # persisted
    assert again.get_batch(b["id"])["metadata"] == {"k": "v"}
    assert again.read_file(f["id"]) == b"x\n"
    assert again.delete_file(f["id"]) and again.get_file(f["id"]) is None


def test_parse_input_bad_lines() -> None:
    raw = "\n".join(
        [
            json.dumps(_lines(1)[0]),
            "{bad",
            json.dumps({"custom_id": "x", "url": "/v1/other", "method": "POST", "body": {}}),
            "",
            json.dumps(_lines(1)[0]),
            "[]",
        ]
    ).encode()
    good, bad = parse_input(raw, "/v1/completions")
    assert [g.line_no for g in good] == [0]
    assert [no for no, _ in bad] == [1, 2, 3, 4]  # blank line skipped; duplicate custom_id is bad


def test_batch_end_to_end(tmp_path: Path) -> None:
    with ThreadedServer(_app(tmp_path)) as s:
        client = _client(s)
        lines: list[Any] = _lines(6) + ["{not json"]
        lines.append({**_lines(1)[0], "custom_id": "bad-field", "body": {"prompt": "x", "top_p": 7}})
        batch = client.batches.create(
            input_file_id=_upload(client, lines),
            endpoint="/v1/completions",
            completion_window="24h",
            metadata={"job": "t"},
        )
        assert batch.status == "validating"
        done = _poll(client, batch.id, ("completed", "failed"))
        assert done.status == "completed", done
        assert done.request_counts.total == 8
        assert (done.request_counts.completed, done.request_counts.failed) == (6, 2)
        out = {x["custom_id"]: x for x in _jsonl(client, done.output_file_id)}
        assert sorted(out) == [f"req-{i}" for i in range(6)]
        assert all(x["response"]["status_code"] == 200 for x in out.values())
        assert out["req-0"]["response"]["body"]["choices"][0]["text"]
        errs = _jsonl(client, done.error_file_id)
        assert len(errs) == 2 and {e["custom_id"] for e in errs} == {None, "bad-field"}
        assert [b.id for b in client.batches.list()] == [batch.id]
        assert any(f.id == done.output_file_id for f in client.files.list())


def test_chat_batch_and_bad_input(tmp_path: Path) -> None:
    with ThreadedServer(_app(tmp_path)) as s:
        client = _client(s)
        fid = _upload(client, _lines(3, "/v1/chat/completions"))
        with pytest.raises(openai.NotFoundError):
            client.batches.create(
                input_file_id="file-missing", endpoint="/v1/chat/completions", completion_window="24h"
            )
        with pytest.raises(openai.BadRequestError):
            client.batches.create(
                input_file_id=fid,
                endpoint="/v1/moderations",  # type: ignore[arg-type]
                completion_window="24h",
            )
        b = client.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")
        done = _poll(client, b.id, ("completed", "failed"))
        assert done.request_counts.completed == 3
        body = _jsonl(client, done.output_file_id)[0]["response"]["body"]
        assert body["object"] == "chat.completion"
        client.files.delete(fid)
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(fid)


def test_cancel_keeps_finished_lines(tmp_path: Path) -> None:
    with ThreadedServer(_app(tmp_path, step_delay=0.01, concurrency=2)) as s:
        client = _client(s)
        fid = _upload(client, _lines(20, max_tokens=10))
        b = client.batches.create(input_file_id=fid, endpoint="/v1/completions", completion_window="24h")
        wait_until(lambda: client.batches.retrieve(b.id).request_counts.completed >= 2, timeout=30)
        c = client.batches.cancel(b.id)
        assert c.status in ("cancelling", "cancelled")
        done = _poll(client, b.id, ("cancelled",))
        kept = _jsonl(client, done.output_file_id)
        assert 2 <= len(kept) < 20 and len(kept) == done.request_counts.completed
        assert len({x["custom_id"] for x in kept}) == len(kept)


def test_restart_resumes_unanswered_lines(tmp_path: Path) -> None:
    lines = _lines(12, max_tokens=lambda i: 5 + 3 * i)
    with ThreadedServer(_app(tmp_path, step_delay=0.01, concurrency=3)) as s:
        client = _client(s)
        b = client.batches.create(
            input_file_id=_upload(client, lines), endpoint="/v1/completions", completion_window="24h"
        )
        wait_until(lambda: client.batches.retrieve(b.id).request_counts.completed >= 2, timeout=30)
    # stopped mid-batch (shutdown grace 0.5 s): the rest is unanswered
    first = BatchStore(tmp_path)
    answered = first.answered_lines(b.id)
    status = first.get_batch(b.id)["status"]
    first.close()
    assert status == "in_progress" and 2 <= len(answered) < 12
    time.sleep(0.05)
    with ThreadedServer(_app(tmp_path)) as s:
        client = _client(s)
        done = _poll(client, b.id, ("completed",))
        out = _jsonl(client, done.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(12))
        assert done.request_counts.completed == 12 and done.request_counts.failed == 0


def test_batches_across_api_server_processes(tmp_path: Path) -> None:
    """Two API servers on one data dir (`--api-server-count 2`): a job created and cancelled through
    server 1 is run and stopped by server 0 (the one that runs jobs, polling the shared store); both
    answer the same status and results."""

    def app(index: int) -> Any:
        args = ServerArgs(
            api_key=API_KEY,
            data_dir=str(tmp_path),
            served_model_name=["fake"],
            max_batch_concurrency=2,
            shutdown_grace=0.5,
            api_server_count=2,
            api_server_index=index,
        )
        return build_app(FakeEngine(step_delay=0.01), args)

    with ThreadedServer(app(0)) as s0, ThreadedServer(app(1)) as s1:
        c0, c1 = _client(s0), _client(s1)
        b = c1.batches.create(
            input_file_id=_upload(c1, _lines(6)), endpoint="/v1/completions", completion_window="24h"
        )
        done = _poll(c1, b.id, ("completed", "failed"))
        assert done.status == "completed" and done.request_counts.completed == 6
        assert c0.batches.retrieve(b.id).status == "completed"
        out = _jsonl(c0, done.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(6))

        slow = c1.batches.create(
            input_file_id=_upload(c1, _lines(30, max_tokens=10)),
            endpoint="/v1/completions",
            completion_window="24h",
        )
        wait_until(lambda: c1.batches.retrieve(slow.id).request_counts.completed >= 2, timeout=30)
        c1.batches.cancel(slow.id)
        cancelled = _poll(c0, slow.id, ("cancelled",))
        kept = _jsonl(c1, cancelled.output_file_id)
        assert 2 <= len(kept) < 30 and len(kept) == cancelled.request_counts.completed
