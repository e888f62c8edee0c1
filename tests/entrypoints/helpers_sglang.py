"""SGLang's tutorial cells (its OpenAI API tutorial and its native API page), written as they are there
with `sglang` replaced by pagedrs, as functions the fake-engine and the real-model tests both run."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import openai
import requests


def batch_chat_cell(client: openai.OpenAI, model: str, workdir: Path) -> tuple[Any, list[dict[str, Any]]]:
    """The tutorial's batch cell: lines with "url": "/chat/completions", uploaded, run, polled until
    done; then the output file read and deleted as the tutorial does. Returns (batch, results)."""
    requests_ = [
        {
            "custom_id": "request-1",
            "method": "POST",
            "url": "/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": "Tell me a joke about programming"}],
                "max_tokens": 50,
            },
        },
        {
            "custom_id": "request-2",
            "method": "POST",
            "url": "/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": "What is Python?"}],
                "max_tokens": 50,
            },
        },
    ]
    input_file_path = workdir / "batch_requests.jsonl"
    with open(input_file_path, "w") as f:
        for req in requests_:
            f.write(json.dumps(req) + "\n")
    with open(input_file_path, "rb") as f:
        file_response = client.files.create(file=f, purpose="batch")
    batch_response = client.batches.create(
        input_file_id=file_response.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 300
    while batch_response.status not in ["completed", "failed", "cancelled"]:
        assert time.monotonic() < deadline, "batch did not finish"
        time.sleep(0.1)
        batch_response = client.batches.retrieve(batch_response.id)
    assert batch_response.status == "completed", batch_response
    result_file_id = batch_response.output_file_id
    file_response = client.files.content(result_file_id)
    result_content = file_response.read().decode("utf-8")
    results = [json.loads(line) for line in result_content.split("\n") if line.strip() != ""]
    client.files.delete(result_file_id)
    return batch_response, results


def generate_cell(base_url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """SGLang's native /generate cell: one text, temperature 0, max_new_tokens 32."""
    url = f"{base_url}/generate"
    data = {
        "text": "What is the capital of France?",
        "sampling_params": {"temperature": 0, "max_new_tokens": 32},
    }
    response = requests.post(url, json=data, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


def generate_stream_cell(
    base_url: str, headers: dict[str, str] | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """SGLang's streaming /generate cell: each event carries the text so far; the printed text is the
    concatenation of what each event added. Returns (printed text, events)."""
    response = requests.post(
        f"{base_url}/generate",
        json={
            "text": "The capital of France is",
            "sampling_params": {"temperature": 0, "max_new_tokens": 32},
            "stream": True,
        },
        headers=headers,
        stream=True,
        timeout=120,
    )
    assert response.status_code == 200, response.text
    prev = 0
    printed = ""
    events: list[dict[str, Any]] = []
    for chunk in response.iter_lines(decode_unicode=False):
        chunk = chunk.decode("utf-8")
        if chunk and chunk.startswith("data:"):
            if chunk == "data: [DONE]":
                break
            data = json.loads(chunk[5:].strip("\n"))
            events.append(data)
            output = data["text"]
            printed += output[prev:]
            prev = len(output)
    return printed, events


def model_info_cell(base_url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """SGLang's /get_model_info cell."""
    response = requests.get(f"{base_url}/get_model_info", headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    info: dict[str, Any] = response.json()
    return info
