"""The OpenAPI document describes every body, and a schema-driven fuzzer (schemathesis, a bounded
number of cases per route, over the fake engine) gets no 5xx from any route in it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from conftest import API_KEY, ThreadedServer
from fake_engine import FakeEngine
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from pagedrs.entrypoints.cli_args import ServerArgs
from pagedrs.entrypoints.openai.server.app import build_app

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY_ROUTES = {
    ("post", "/v1/completions"): "CompletionRequest",
    ("post", "/v1/chat/completions"): "ChatCompletionRequest",
    ("post", "/v1/embeddings"): "EmbeddingRequest",
    ("post", "/v1/batches"): "BatchCreateRequest",
    ("post", "/v1/files"): "FileUploadForm",
    ("post", "/v1/admin/liquid"): "LiquidScaleRequest",
    ("post", "/generate"): "GenerateRequest",
}

JSON_RESPONSES = [
    *BODY_ROUTES,
    ("get", "/version"),
    ("get", "/v1/models"),
    ("get", "/v1/models/{model}"),
    ("get", "/v1/files"),
    ("get", "/v1/files/{file_id}"),
    ("delete", "/v1/files/{file_id}"),
    ("get", "/v1/batches"),
    ("get", "/v1/batches/{batch_id}"),
    ("post", "/v1/batches/{batch_id}/cancel"),
    ("get", "/get_model_info"),
]


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    args = ServerArgs(
        api_key=API_KEY,
        data_dir=str(tmp_path_factory.mktemp("fuzz")),
        served_model_name=["fake"],
        max_body_bytes=200_000,
        shutdown_grace=2.0,
    )
    with ThreadedServer(build_app(FakeEngine(step_delay=0.0), args)) as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(fuzz_server: ThreadedServer) -> Any:
    return schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json")


def test_openapi_names_every_body_and_response(fuzz_server: ThreadedServer) -> None:
    doc = httpx.get(f"{fuzz_server.base_url}/openapi.json").json()
    for (method, path), name in BODY_ROUTES.items():
        op = doc["paths"][path][method]
        (content,) = op["requestBody"]["content"].values()
        assert content["schema"] == {"$ref": f"#/components/schemas/{name}"}
        assert "422" not in op["responses"]
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/ErrorResponse"
        )
    for method, path in JSON_RESPONSES:
        schema = doc["paths"][path][method]["responses"]["200"]["content"]["application/json"]["schema"]
        assert schema.get("$ref") or schema.get("anyOf"), (method, path)
    fields = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "temperature", "guided_json", "min_tokens"} <= set(fields)


# Cases per route and generation mode: 2 modes x ~20 routes x 8 stays at a few hundred requests.
EXAMPLES = 8


def fuzz(op: Any, mode: GenerationMode, base_url: str, seen: dict[Any, set[int]]) -> None:
    """EXAMPLES generated cases of one operation in one mode; each answer's status is noted in `seen`."""

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        derandomize=True,
    )
    def no_5xx(case: Any) -> None:
        response = case.call(base_url=base_url, headers=AUTH, timeout=20)
        seen.setdefault((case.method.lower(), case.path, mode), set()).add(response.status_code)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])

    try:
        no_5xx()
    except Unsatisfiable:
        assert mode == GenerationMode.NEGATIVE  # a route with no input has no invalid one


def test_fuzz_no_server_errors(fuzz_server: ThreadedServer) -> None:
    """Valid bodies (positive mode) and invalid ones (negative mode: wrong types, values out of range,
    missing fields) for every operation in /openapi.json: 2xx or 4xx, never 5xx."""
    api = schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 20
    seen: dict[tuple[str, str, GenerationMode], set[int]] = {}
    for op in operations:
        fuzz(op, GenerationMode.POSITIVE, fuzz_server.base_url, seen)
        # Invalid inputs where the route reads a body or a query (an invalid path is just a 404).
        if op.get_request_payload_content_types() or any(p.location == "query" for p in op.iter_parameters()):
            fuzz(op, GenerationMode.NEGATIVE, fuzz_server.base_url, seen)
    # The fuzzer reached the body validation (400s for invalid bodies) and the engine (2xx).
    for method, path in BODY_ROUTES:
        assert 400 in seen[(method, path, GenerationMode.NEGATIVE)], (method, path, seen)
    assert any(c < 300 for (_, p, _), codes in seen.items() if p == "/v1/completions" for c in codes)


def test_admin_liquid_target_out_of_range_is_400(fuzz_server: ThreadedServer) -> None:
    """Found by the fuzzer: a target past 64 bits could not be sent to the core (a 500)."""
    for target in (2**70, -(2**70), 0):
        r = httpx.post(f"{fuzz_server.base_url}/v1/admin/liquid", headers=AUTH, json={"target": target})
        assert r.status_code == 400 and r.json()["error"]["param"] == "target", r.text
