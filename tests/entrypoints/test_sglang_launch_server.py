"""SGLang's tutorial cells against `python -m pagedrs.launch_server` with SGLang's flags and the real
default model: /get_model_info, /generate (streamed equals not streamed), the OpenAI chat and
completion cells with the prefix cache's count in usage, and the batch cell with SGLang's urls."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests
from conftest import SubprocessServer
from helpers_sglang import batch_chat_cell, generate_cell, generate_stream_cell, model_info_cell

pytestmark = pytest.mark.slow


def _model_path() -> str:
    try:
        from pagedrs.loader.default_model import default_model_path

        return str(default_model_path())
    except (ImportError, ValueError):
        return "default-model-not-installed"


MODEL = _model_path()  # the tutorial names the model by its --model-path


@pytest.fixture(scope="module")
def sglang_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    pytest.importorskip("pagedrs._core")
    flags = ["--model-path", MODEL, "--tp-size", "1", "--mem-fraction-static", "0.8"]
    server = SubprocessServer(
        tmp_path_factory.mktemp("sglang-server"), flags, api_key=None, module="pagedrs.launch_server"
    )
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def client(sglang_server: SubprocessServer) -> openai.OpenAI:
    # As the tutorial: openai.Client(base_url=".../v1", api_key="None")
    return openai.Client(base_url=f"{sglang_server.base_url}/v1", api_key="None", max_retries=0, timeout=120)


def test_model_info_and_generate(sglang_server: SubprocessServer) -> None:
    info = model_info_cell(sglang_server.base_url)
    assert info["model_path"] == MODEL and info["is_generation"] is True
    out = generate_cell(sglang_server.base_url)
    meta = out["meta_info"]
    assert 0 < meta["completion_tokens"] <= 32 and meta["prompt_tokens"] > 5
    assert len(out["output_ids"]) == meta["completion_tokens"]
    if meta["finish_reason"]["type"] == "stop":  # this instruct model may end a bare question at once
        assert meta["finish_reason"]["matched"] == out["output_ids"][-1]  # the EOS token it sampled
    else:
        assert meta["finish_reason"] == {"type": "length", "length": 32} and out["text"]


def test_generate_stream_equals_the_plain_answer(sglang_server: SubprocessServer) -> None:
    printed, events = generate_stream_cell(sglang_server.base_url)
    plain = requests.post(
        f"{sglang_server.base_url}/generate",
        json={
            "text": "The capital of France is",
            "sampling_params": {"temperature": 0, "max_new_tokens": 32},
        },
        timeout=120,
    ).json()
    assert printed == plain["text"] and printed.strip() and len(events) > 1
    assert events[-1]["output_ids"] == plain["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]


def test_chat_and_completion_cells_report_cached_tokens(client: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful AI assistant"},
        {"role": "user", "content": "List 3 countries and their capitals."},
    ]
    first = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16)
    again = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16)
    assert first.choices[0].message.content == again.choices[0].message.content
    assert again.usage.prompt_tokens > 16
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # at least one whole cached block
    prompt = (  # over two blocks of 16 tokens: the last prompt token is never served from the cache
        "Write a short story about a space explorer who finds a strange signal near Jupiter, "
        "follows it past the moons and the rings, and learns at last who sent it and why."
    )
    kwargs = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 8}
    client.completions.create(**kwargs)
    repeated = client.completions.create(**kwargs)
    assert repeated.usage.prompt_tokens > 32
    assert 16 <= repeated.usage.prompt_tokens_details.cached_tokens < repeated.usage.prompt_tokens


def test_batch_cell_with_sglang_urls(client: openai.OpenAI, tmp_path: Path) -> None:
    batch, results = batch_chat_cell(client, MODEL, tmp_path)
    assert batch.request_counts.completed == 2 and batch.request_counts.failed == 0
    for r in results:
        body = r["response"]["body"]
        assert r["response"]["status_code"] == 200 and body["choices"][0]["message"]["content"]
