"""`pagedrs serve -tp 2 --enable-lora`: adapters named at start-up and one loaded at run time through
/v1/load_lora_adapter give the offline one-process engine's greedy text through the server, whose engine
core drives two tensor-parallel ranks (each holding its part of every resident adapter); after an
unload the name is OpenAI's 404 and the others still serve."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from pagedrs import LLM, LoRARequest, SamplingParams
from tests.entrypoints.conftest import SubprocessServer
from tests.helpers import make_tiny_llama
from tests.lora.helpers_lora import make_peft_adapter

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

PROMPT = [(13 * i + 3) % 250 for i in range(12)]
MAX_TOKENS = 8


def _text(http: httpx.Client, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def test_serve_tp2_with_adapters_matches_offline(tmp_path: Path) -> None:
    base = make_tiny_llama(tmp_path, arch="llama", seed=4)
    paths = {
        n: make_peft_adapter(base, tmp_path / f"adapter-{n}", seed=s, r=8) for s, n in enumerate("ac", 1)
    }
    llm = LLM(
        str(base), device="cpu", dtype="float32", disable_log_stats=True, enable_lora=True, max_loras=2,
        max_lora_rank=8,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = {}
    for i, name in enumerate((None, "a", "c"), start=1):
        lora = LoRARequest(name, i, str(paths[name])) if name is not None else None
        out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False, lora_request=lora)
        want[name or "base"] = out[0].outputs[0].text
    assert len(set(want.values())) == 3  # each adapter changes the output
    server = SubprocessServer(
        tmp_path / "data",
        ["--model", str(base), "--served-model-name", "base", "-tp", "2", "--enable-lora", "--max-loras", "2",
         "--max-lora-rank", "8", "--lora-modules", f"a={paths['a']}", "--allow-runtime-lora-updating"],
    )  # fmt: skip
    server.start()
    try:
        with server.http() as http:
            for name in ("a", "base", "a"):
                assert _text(http, name) == want[name], name
            r = http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(paths["c"])})
            assert r.status_code == 200, r.text
            assert _text(http, "c") == want["c"]
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 200
            gone = http.post("/v1/completions", json={"model": "c", "prompt": PROMPT, "max_tokens": 2})
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
            assert _text(http, "a") == want["a"]
    finally:
        server.kill()
