"""The official `openai` client's `embeddings.create` against the real server (default model): strings,
lists, token ids, `dimensions`, base64; equal to `LLM.embed`; a batch file of embedding lines; bad inputs
are 400/404 in OpenAI's shape and the server keeps serving."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
from conftest import SubprocessServer, wait_until

TEXTS = ["The capital of France is Paris.", "Embeddings pool the last hidden state."]


@pytest.fixture(scope="module")
def offline() -> Iterator[Any]:
    from pagedrs import LLM

    llm = LLM(device="cpu", dtype="float32", max_model_len=512, disable_log_stats=True)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def client(real_server: SubprocessServer) -> openai.OpenAI:
    return real_server.client()


def _close(a: list[float], b: list[float]) -> bool:
    return bool(np.allclose(np.asarray(a), np.asarray(b), atol=1e-5))


def test_strings_lists_and_token_ids_equal_offline(client: openai.OpenAI, offline: Any) -> None:
    want = [o.outputs.embedding for o in offline.embed(TEXTS, use_tqdm=False)]
    one = client.embeddings.create(model="smollm2", input=TEXTS[0])
    assert one.object == "list" and len(one.data) == 1 and one.data[0].index == 0
    assert _close(one.data[0].embedding, want[0])
    assert abs(np.linalg.norm(one.data[0].embedding) - 1.0) < 1e-4
    many = client.embeddings.create(model="smollm2", input=TEXTS)
    assert [d.index for d in many.data] == [0, 1]
    assert all(_close(d.embedding, w) for d, w in zip(many.data, want, strict=True))
    ids = offline.get_tokenizer().encode(TEXTS[1])
    assert many.usage.prompt_tokens == len(offline.get_tokenizer().encode(TEXTS[0])) + len(ids)
    by_ids = client.embeddings.create(model="smollm2", input=ids)
    assert _close(by_ids.data[0].embedding, want[1])
    lists = client.embeddings.create(model="smollm2", input=[ids, ids[:3]])
    assert len(lists.data) == 2 and _close(lists.data[0].embedding, want[1])


def test_dimensions_and_base64(client: openai.OpenAI) -> None:
    full = client.embeddings.create(model="smollm2", input=TEXTS[0]).data[0].embedding
    cut = client.embeddings.create(model="smollm2", input=TEXTS[0], dimensions=32).data[0].embedding
    assert len(cut) == 32
    head = np.asarray(full[:32])
    assert np.allclose(cut, head / np.linalg.norm(head), atol=1e-5)
    b64 = client.embeddings.create(model="smollm2", input=TEXTS[0], encoding_format="base64")
    value = b64.data[0].embedding  # asked for explicitly, the client hands back the base64 text
    decoded = np.frombuffer(base64.b64decode(value), dtype="<f4") if isinstance(value, str) else value
    assert _close(list(decoded), full)


def test_raw_base64_is_little_endian_float32(real_server: SubprocessServer) -> None:
    with real_server.http() as http:
        r = http.post("/v1/embeddings", json={"input": "x", "encoding_format": "base64"})
        f = http.post("/v1/embeddings", json={"input": "x"})
    raw = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(raw, f.json()["data"][0]["embedding"], atol=1e-6)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": ""}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": ["ok", ""]}, 400, "input[1]"),
        ({"input": "x", "dimensions": 100000}, 400, "dimensions"),
        ({"input": [5] * 600}, 400, "input"),
        ({"input": [10**9]}, 400, "input"),
        ({"input": "x", "encoding_format": "hex"}, 400, "encoding_format"),
        ({"input": "x", "model": "nope"}, 404, "model"),
    ],
)
def test_bad_inputs(real_server: SubprocessServer, body: dict, status: int, param: str) -> None:
    with real_server.http() as http:
        r = http.post("/v1/embeddings", json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["message"]
        ok = http.post("/v1/embeddings", json={"input": "still serving"})
        assert ok.status_code == 200 and len(ok.json()["data"]) == 1


def test_batch_of_embedding_lines(client: openai.OpenAI) -> None:
    rows = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "smollm2", "input": t},
        }
        for i, t in enumerate(TEXTS)
    ]
    text = "\n".join(json.dumps(r) for r in rows) + "\n"
    f = client.files.create(file=("emb.jsonl", io.BytesIO(text.encode())), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    done = wait_until(
        lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, timeout=120
    )
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines() if x.strip()]
    assert sorted(o["custom_id"] for o in out) == ["e0", "e1"]
    direct = client.embeddings.create(model="smollm2", input=TEXTS)
    by_id = {o["custom_id"]: o["response"]["body"]["data"][0]["embedding"] for o in out}
    assert _close(by_id["e0"], direct.data[0].embedding) and _close(by_id["e1"], direct.data[1].embedding)
