"""SGLang drop-in over the fake engine (fast): its tutorial cells, /generate (text, token ids, batches,
n, streams, errors), /get_model_info, batch lines with SGLang's urls, cached-token counts, and
`python -m pagedrs.launch_server`'s flags."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from conftest import API_KEY, ThreadedServer, wait_until
from fake_engine import FakeEngine
from helpers_sglang import batch_chat_cell, generate_cell, generate_stream_cell, model_info_cell

from pagedrs.entrypoints.cli_args import ServerArgs, make_serve_parser, sglang_serve_argv
from pagedrs.entrypoints.openai.server.app import build_app

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    args = ServerArgs(
        api_key=API_KEY,
        data_dir=str(tmp_path_factory.mktemp("sglang")),
        served_model_name=["fake"],
        model="/models/fake-model",
        max_batch_concurrency=4,
        shutdown_grace=2.0,
    )
    with ThreadedServer(build_app(FakeEngine(step_delay=0.001), args)) as s:
        yield s


@pytest.fixture()
def http(server: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=30) as c:
        yield c


@pytest.fixture()
def client(server: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)


def test_tutorial_generate_and_model_info(server: ThreadedServer) -> None:
    out = generate_cell(server.base_url)
    # the fake engine emits letters from the prompt's last byte ("?" -> 63 % 26 = 11 -> "l")
    assert out["text"] == "lmnopqrstuvwxyzabcdefghijklmnopq" and len(out["output_ids"]) == 32
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 32}
    assert meta["prompt_tokens"] == len("What is the capital of France?") and meta["completion_tokens"] == 32
    assert meta["cached_tokens"] == 0 and meta["id"]
    info = model_info_cell(server.base_url)
    assert info["model_path"] == "/models/fake-model" and info["tokenizer_path"] == "/models/fake-model"
    assert info["is_generation"] is True and info["max_model_len"] == 128


def test_tutorial_generate_stream_is_cumulative(server: ThreadedServer) -> None:
    printed, events = generate_stream_cell(server.base_url)
    assert printed == events[-1]["text"] and len(printed) == 32
    texts = [e["text"] for e in events]  # each event: the text so far (a slow reader's events merge)
    assert all(b.startswith(a) and len(b) > len(a) for a, b in zip(texts, texts[1:], strict=False))
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 32}
    assert events[-1]["output_ids"] == list(printed.encode())


def test_generate_batch_token_ids_and_n(http: httpx.Client) -> None:
    r = http.post("/generate", json={"text": ["ab", "xy"], "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200
    assert [o["text"] for o in r.json()] == ["uvw", "rst"]
    r = http.post("/generate", json={"input_ids": [104, 105], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and r.json()["text"] == "bc" and r.json()["meta_info"]["prompt_tokens"] == 2
    r = http.post("/generate", json={"input_ids": [[97], [98, 99]], "sampling_params": {"max_new_tokens": 1}})
    assert [o["text"] for o in r.json()] == ["t", "v"]
    r = http.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2, "n": 2}})
    assert [o["text"] for o in r.json()] == ["tu", "uv"]  # n > 1: a list, one per output
    per_prompt = [{"max_new_tokens": 1}, {"max_new_tokens": 3}]
    r = http.post("/generate", json={"text": ["a", "a"], "sampling_params": per_prompt})
    assert [o["text"] for o in r.json()] == ["t", "tuv"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({}, "text"),
        ({"text": "a", "input_ids": [1]}, "text"),
        ({"text": []}, "text"),
        ({"input_ids": [300]}, "input_ids"),
        ({"text": "a", "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
        ({"text": "a", "sampling_params": {"max_new_tokens": 500}}, "sampling_params.max_new_tokens"),
        ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"text": "a", "sampling_params": {"stop": [""]}}, "sampling_params.stop"),
        (
            {"text": "a", "sampling_params": {"regex": "(", "json_schema": "{}"}},
            "sampling_params.regex",
        ),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
        ({"text": "a", "stream": "yes"}, "stream"),
    ],
)
def test_generate_bad_input_is_400(http: httpx.Client, body: dict[str, object], param: str) -> None:
    r = http.post("/generate", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    assert (
        http.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 1}}).status_code
        == 200
    )


def test_cached_tokens_on_a_repeated_prompt(http: httpx.Client, client: openai.OpenAI) -> None:
    prompt = "a long shared prefix, over two blocks of sixteen tokens: " + "x" * 20
    first = client.completions.create(model="fake", prompt=prompt, max_tokens=2)
    again = client.completions.create(model="fake", prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == (len(prompt) - 1) // 16 * 16 and cached > 0
    messages = [{"role": "user", "content": "chat shares this prefix with the next one " * 2}]
    client.chat.completions.create(model="fake", messages=messages, max_tokens=1)
    chat = client.chat.completions.create(model="fake", messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens_details.cached_tokens >= 64
    stream = client.chat.completions.create(
        model="fake", messages=messages, max_tokens=2, stream=True, stream_options={"include_usage": True}
    )
    usage = [c.usage for c in stream if c.usage is not None]
    assert usage[-1].prompt_tokens_details.cached_tokens >= 64
    meta = http.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 1}}).json()
    assert meta["meta_info"]["cached_tokens"] == cached


def test_tutorial_batch_with_sglang_urls(client: openai.OpenAI, tmp_path: Path) -> None:
    batch, results = batch_chat_cell(client, "fake", tmp_path)
    assert batch.request_counts.completed == 2 and batch.request_counts.failed == 0
    assert sorted(r["custom_id"] for r in results) == ["request-1", "request-2"]
    assert all(r["response"]["body"]["object"] == "chat.completion" for r in results)
    assert batch.output_file_id not in [f.id for f in client.files.list().data]  # the cell deleted it


def _upload(client: openai.OpenAI, lines: list[dict[str, object]]) -> str:
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    return client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id


def test_completions_batch_takes_short_urls_and_all_failed_batch_has_files(client: openai.OpenAI) -> None:
    line = {
        "custom_id": "c",
        "method": "POST",
        "url": "/completions",
        "body": {"prompt": "a", "max_tokens": 2},
    }
    fid = _upload(client, [line])
    b = client.batches.create(input_file_id=fid, endpoint="/v1/completions", completion_window="24h")
    done = wait_until(lambda: (x := client.batches.retrieve(b.id)).status == "completed" and x, timeout=30)
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert out[0]["response"]["body"]["choices"][0]["text"] == "tu"
    bad = [
        {"custom_id": "w", "method": "POST", "url": "/embeddings", "body": {"prompt": "a"}},
        {
            "custom_id": "v",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "a", "max_tokens": 0},
        },
    ]
    b = client.batches.create(
        input_file_id=_upload(client, bad), endpoint="/v1/completions", completion_window="24h"
    )
    done = wait_until(lambda: (x := client.batches.retrieve(b.id)).status == "completed" and x, timeout=30)
    assert done.request_counts.failed == 2 and done.request_counts.completed == 0
    assert client.files.content(done.output_file_id).text == ""  # present, empty: reading it works
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert [e["custom_id"] for e in errors] == ["w", "v"]
    assert "url must be the batch's endpoint" in errors[0]["error"]["message"]
    assert errors[1]["response"]["status_code"] == 400


def test_launch_server_takes_sglang_flags() -> None:
    argv = sglang_serve_argv(
        ["--model-path", "m.gguf", "--tp-size", "2", "--mem-fraction-static=0.7", "--host", "0.0.0.0"]
    )
    args = make_serve_parser().parse_args(argv)
    assert (args.model, args.tensor_parallel_size, args.gpu_memory_utilization) == ("m.gguf", 2, 0.7)
    assert (args.host, args.port) == ("0.0.0.0", 30000)  # SGLang's default port
    args = make_serve_parser().parse_args(sglang_serve_argv(["--port", "31000", "--disable-radix-cache"]))
    assert args.port == 31000 and args.enable_prefix_caching is False
