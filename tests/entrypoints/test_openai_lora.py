"""LoRA adapters through the server (`pagedrs serve --enable-lora --lora-modules ...`, the engine core in
its own process, so each request's LoRARequest crosses the msgspec channel): an adapter's name as `model`
gives the offline `LLM.generate(lora_request=...)` greedy text, /v1/models lists adapters under their
parent, /v1/load_lora_adapter and /v1/unload_lora_adapter work at run time behind the API key, an unknown
name is OpenAI's 404 and a rank above --max-lora-rank a 400."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import SubprocessServer

from pagedrs import LoRARequest, SamplingParams
from pagedrs.entrypoints.cli_args import (
    LoRAModulePath,
    ServerArgs,
    make_serve_parser,
    parse_lora_module,
    serve_args_error,
)
from pagedrs.entrypoints.llm import LLM
from tests.helpers import make_tiny_llama
from tests.lora.helpers_lora import make_peft_adapter

PROMPT = [(11 * i + 5) % 250 for i in range(14)]
MAX_TOKENS = 8
BASE = "tiny"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny base model and four adapters: a and b (served from the start), c (loaded at run time),
    big (rank 16, above the server's --max-lora-rank 8)."""
    root = tmp_path_factory.mktemp("lora-server")
    base = make_tiny_llama(root, arch="llama", seed=6)
    out = {"base": base}
    for seed, name in enumerate(("a", "b", "c"), start=1):
        out[name] = make_peft_adapter(base, root / f"adapter-{name}", seed=seed, r=8)
    out["big"] = make_peft_adapter(base, root / "adapter-big", seed=9, r=16, target_modules=("q_proj",))
    return out


@pytest.fixture(scope="module")
def offline(models: dict[str, Path]) -> dict[str, tuple[list[int], str]]:
    """Greedy (token ids, text) per model name from the offline engine."""
    llm = LLM(
        str(models["base"]), device="cpu", dtype="float32", disable_log_stats=True, num_kv_blocks=64,
        enable_lora=True, max_loras=2, max_lora_rank=8,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out: dict[str, tuple[list[int], str]] = {}
    for i, name in enumerate((None, "a", "b", "c"), start=1):
        lora = LoRARequest(name, i, str(models[name])) if name is not None else None
        o = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False, lora_request=lora)[0].outputs[
            0
        ]
        out[name or BASE] = (list(o.token_ids), o.text)
    return out


@pytest.fixture(scope="module")
def server(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    pytest.importorskip("pagedrs._core")
    b_json = json.dumps({"name": "b", "path": str(models["b"]), "base_model_name": "tiny-base"})
    s = SubprocessServer(
        tmp_path_factory.mktemp("lora-server-data"),
        ["--model", str(models["base"]), "--served-model-name", BASE, "--enable-lora", "--max-loras", "2",
         "--max-lora-rank", "8", "--lora-modules", f"a={models['a']}", b_json,
         "--allow-runtime-lora-updating"],
    )  # fmt: skip
    s.start()
    yield s
    s.kill()


def _complete(http: httpx.Client, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return http.post("/v1/completions", json=body)


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    text: str = r.json()["choices"][0]["text"]
    return text


def test_adapter_name_as_model_equals_offline(
    server: SubprocessServer, offline: dict[str, tuple[list[int], str]]
) -> None:
    assert offline["a"][0] != offline[BASE][0] != offline["b"][0]  # the adapters change the output
    with server.http() as http:
        for name in ("a", "b", BASE, "a"):
            r = _complete(http, name)
            assert _text(r) == offline[name][1], name
            assert r.json()["model"] == name


def test_models_lists_adapters_under_their_parent(server: SubprocessServer, models: dict[str, Path]) -> None:
    with server.http() as http:
        cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
        one = http.get("/v1/models/a").json()
    assert {BASE, "a", "b"} <= set(cards)
    assert (cards["a"]["parent"], cards["a"]["root"]) == (BASE, str(models["a"]))
    assert cards["b"]["parent"] == "tiny-base"  # the JSON form's base_model_name
    assert cards[BASE]["parent"] is None
    assert one["id"] == "a" and one["parent"] == BASE


def test_unknown_adapter_is_openai_404(server: SubprocessServer) -> None:
    with server.http() as http:
        for route in ("completions", "chat/completions"):
            body: dict[str, Any] = {"model": "nope", "max_tokens": 2}
            body.update(
                {"prompt": PROMPT}
                if route == "completions"
                else {"messages": [{"role": "user", "content": "hi"}]}
            )
            r = http.post(f"/v1/{route}", json=body)
            assert r.status_code == 404, r.text
            err = r.json()["error"]
            assert (err["code"], err["param"], err["type"]) == ("model_not_found", "model", "not_found_error")


def test_load_use_unload_at_run_time(
    server: SubprocessServer, models: dict[str, Path], offline: dict[str, tuple[list[int], str]]
) -> None:
    with server.http() as http:
        assert _complete(http, "c").status_code == 404
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(models["c"])})
        assert r.status_code == 200, r.text
        assert (
            http.post(
                "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(models["c"])}
            ).status_code
            == 400
        )
        assert "c" in {c["id"] for c in http.get("/v1/models").json()["data"]}
        assert _text(_complete(http, "c")) == offline["c"][1]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 200
        assert _complete(http, "c").status_code == 404
        assert "c" not in {c["id"] for c in http.get("/v1/models").json()["data"]}
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 404
        assert _text(_complete(http, "a")) == offline["a"][1]  # the others are still served


def test_rank_above_max_lora_rank_is_400(server: SubprocessServer, models: dict[str, Path]) -> None:
    with server.http() as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(models["big"])})
        assert r.status_code == 400, r.text
        assert "max_lora_rank (8)" in r.json()["error"]["message"]
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": "/no/such/folder"})
        assert r.status_code == 400, r.text
        assert "big" not in {c["id"] for c in http.get("/v1/models").json()["data"]}


def test_load_needs_the_api_key(server: SubprocessServer, models: dict[str, Path]) -> None:
    body = {"lora_name": "c2", "lora_path": str(models["c"])}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{server.base_url}/v1/load_lora_adapter", json=body, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
    r = httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": "a"}, timeout=30)
    assert r.status_code == 401
    with server.http() as http:
        assert "c2" not in {c["id"] for c in http.get("/v1/models").json()["data"]}


def test_lora_modules_flag_forms() -> None:
    assert parse_lora_module("x=/p/x") == LoRAModulePath("x", "/p/x")
    assert parse_lora_module('{"name": "y", "path": "/p/y", "base_model_name": "m"}') == LoRAModulePath(
        "y", "/p/y", "m"
    )
    for bad in ("x", "=/p", '{"name": "y"}', '{"name": "y", "path": "/p", "rank": 8}'):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(bad)
    parser = make_serve_parser()
    args = parser.parse_args(["--lora-modules", "x=/p/x", '{"name": "y", "path": "/p/y"}'])
    assert serve_args_error(args) == "--lora-modules requires --enable-lora"
    args = parser.parse_args(["--enable-lora", "--max-loras", "3", "--lora-modules", "x=/p/x"])
    assert serve_args_error(args) is None and args.max_loras == 3
    assert ServerArgs.from_namespace(args).lora_modules == (LoRAModulePath("x", "/p/x"),)


def test_runtime_updating_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDRS_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert not ServerArgs().runtime_lora_updating
    assert ServerArgs(allow_runtime_lora_updating=True).runtime_lora_updating
    monkeypatch.setenv("PAGEDRS_ALLOW_RUNTIME_LORA_UPDATING", "1")
    assert ServerArgs().runtime_lora_updating
